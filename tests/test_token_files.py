"""Service credentials from mounted files, rotated without a restart (issue 19):
`service_token_file` and `caller_tokens_file` are read again when they change (looked at no
more often than every few seconds), a half-written or malformed file keeps the last tokens,
and the file and variable forms are exclusive."""

from __future__ import annotations

import logging
import os
import pathlib
from collections.abc import AsyncIterator

import grpc
import pytest

from services.runtime import watched_file
from services.runtime.channels import open_channel
from services.runtime.config import ConfigError, ServerConfig
from services.runtime.security import (
    AccessPolicy,
    ChannelSecurity,
    current_caller,
    read_caller_tokens_file,
    read_token_file,
)
from services.runtime.server import ServiceHost
from services.runtime.watched_file import WatchedFile

ECHO = "test.Whoami"
OLD, NEW = "engine-token-old-0123456789", "engine-token-new-0123456789"


def rewrite(path: pathlib.Path, text: str) -> None:
    """Writes `text` with a modification time past the last one, as a Secret update does."""
    before = path.stat().st_mtime_ns if path.exists() else 0
    path.write_text(text)
    os.utime(path, ns=(before + 1_000_000_000, before + 1_000_000_000))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# --- the watcher -----------------------------------------------------------------------------


def test_a_watched_file_is_read_again_only_when_changed_and_at_most_every_recheck(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "token"
    rewrite(path, "first-token-0123456789\n")
    reads: list[str] = []

    def load() -> str:
        reads.append("read")
        return read_token_file(str(path))

    clock = Clock()
    watched = WatchedFile([str(path)], load, what="service_token_file", clock=clock)
    assert watched.recheck_seconds == watched_file.RECHECK_SECONDS
    assert (watched.current(), len(reads)) == ("first-token-0123456789", 1)

    # Unchanged: looked at (a stat), never read again.
    clock.now += 10
    assert (watched.current(), len(reads)) == ("first-token-0123456789", 1)
    # Changed, but within the recheck interval: not even looked at.
    rewrite(path, "second-token-0123456789")
    clock.now += watched.recheck_seconds / 2
    assert watched.current() == "first-token-0123456789"
    clock.now += watched.recheck_seconds
    assert (watched.current(), watched.reloads) == ("second-token-0123456789", 1)

    # Half-written (empty) or malformed: the last token stays, with a warning, and the next
    # check tries again.
    with caplog.at_level(logging.WARNING):
        for broken in ("", "two tokens"):
            rewrite(path, broken)
            clock.now += watched.recheck_seconds
            assert watched.current() == "second-token-0123456789"
    assert caplog.text.count("service_token_file changed but was not taken") == 2
    path.unlink()
    clock.now += watched.recheck_seconds
    assert watched.current() == "second-token-0123456789"
    rewrite(path, "third-token-0123456789")
    clock.now += watched.recheck_seconds
    assert (watched.current(), watched.reloads) == ("third-token-0123456789", 2)


def test_a_watched_file_that_cannot_be_used_at_start_raises(tmp_path: pathlib.Path) -> None:
    missing = str(tmp_path / "missing")
    with pytest.raises(ConfigError, match="service_token_file .* cannot be read"):
        WatchedFile([missing], lambda: read_token_file(missing), what="service_token_file")


def test_a_caller_tokens_file_may_give_a_caller_two_tokens_during_a_rotation(
    tmp_path: pathlib.Path,
) -> None:
    path = tmp_path / "caller-tokens"
    path.write_text(f"# rotation\nengine={OLD}\nengine={NEW}, router=router-token-0123456789\n")
    assert read_caller_tokens_file(str(path)) == {
        OLD: "engine",
        NEW: "engine",
        "router-token-0123456789": "router",
    }
    for text, words in (
        ("", "holds no caller=token entry"),
        ("# only a comment\n", "holds no caller=token entry"),
        ("engine", r"caller_tokens_file\[0\] must look like caller=token"),
        (f"engine={OLD}\nrouter={OLD}", "two callers"),
    ):
        path.write_text(text)
        with pytest.raises(ConfigError, match=words):
            read_caller_tokens_file(str(path))


# --- settings --------------------------------------------------------------------------------


def _config(**overrides: object) -> ServerConfig:
    return ServerConfig(port=0, metrics_port=-1, drain_seconds=0, grace_seconds=0.2, **overrides)  # type: ignore[arg-type]


def test_file_and_variable_forms_are_exclusive_and_files_are_checked_at_start(
    tmp_path: pathlib.Path,
) -> None:
    token, callers = tmp_path / "token", tmp_path / "callers"
    token.write_text(OLD + "\n")
    callers.write_text(f"engine={OLD}\n")
    with pytest.raises(ConfigError, match="service_token and service_token_file are exclusive"):
        _config(service_token=OLD, service_token_file=str(token)).validate()
    with pytest.raises(ConfigError, match="caller_tokens and caller_tokens_file are exclusive"):
        _config(caller_tokens=(f"engine={OLD}",), caller_tokens_file=str(callers)).validate()
    with pytest.raises(ConfigError, match="service_token and service_token_file are exclusive"):
        ChannelSecurity(token=OLD, token_file=str(token))
    with pytest.raises(ConfigError, match="caller_tokens_file .* cannot be read"):
        _config(caller_tokens_file=str(tmp_path / "missing")).validate()
    with pytest.raises(ConfigError, match="service_token_file .* is empty"):
        empty = tmp_path / "empty"
        empty.write_text("\n")
        _config(service_token_file=str(empty)).validate()
    # A caller tokens file is a credential: a reachable address may start with it.
    _config(
        host="0.0.0.0", caller_tokens_file=str(callers), service_token_file=str(token)
    ).validate()
    with pytest.raises(ConfigError, match="caller_tokens_file or tls_client_ca_file"):
        _config(host="0.0.0.0").validate()


def test_outbound_metadata_carries_the_token_file_as_it_is_now(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(watched_file, "RECHECK_SECONDS", 0.0)
    token = tmp_path / "token"
    rewrite(token, OLD)
    security = _config(service_token_file=str(token)).channel_settings().security
    assert security.metadata == (("authorization", f"Bearer {OLD}"),)
    rewrite(token, NEW + "\n")
    # As the client interceptor (each call) and a multiplexed stream's opener (each open) ask.
    assert security.metadata == (("authorization", f"Bearer {NEW}"),)


# --- real servers on loopback ----------------------------------------------------------------


async def _whoami(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return current_caller().encode()


def _register(server: grpc.aio.Server) -> None:
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                ECHO, {"Call": grpc.unary_unary_rpc_method_handler(_whoami)}
            ),
        )
    )


@pytest.fixture
async def rotating(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[ServiceHost, pathlib.Path]]:
    """A host on loopback accepting the engine's tokens from a caller tokens file."""
    monkeypatch.setattr(watched_file, "RECHECK_SECONDS", 0.0)
    callers = tmp_path / "caller-tokens"
    rewrite(callers, f"engine={OLD}\n")
    config = _config(caller_tokens_file=str(callers))
    config.validate()
    host = ServiceHost(
        "whoami", config, [_register], [ECHO], access=AccessPolicy({ECHO: ["engine"]})
    )
    await host.start()
    try:
        yield host, callers
    finally:
        await host.stop()


async def _call(channel: grpc.aio.Channel) -> str:
    answer = await channel.unary_unary(f"/{ECHO}/Call")(b"", timeout=5)
    return bytes(answer).decode()


async def _call_with(target: str, token: str) -> str:
    channel = open_channel(target, settings=_config(service_token=token).channel_settings())
    try:
        return await _call(channel)
    finally:
        await channel.close()


async def test_a_rotated_caller_token_is_accepted_and_the_old_refused_without_restart(
    rotating: tuple[ServiceHost, pathlib.Path],
    tmp_path: pathlib.Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    host, callers = rotating
    # The engine's side: one channel, opened once, its token from a file.
    token = tmp_path / "engine-token"
    rewrite(token, OLD + "\n")
    settings = _config(service_token_file=str(token)).channel_settings()
    engine = open_channel(host.target, settings=settings)
    # As a multiplexed stream is opened: no interceptor, the metadata asked for on each open.
    bare = open_channel(host.target, settings=settings, interceptors=False)

    async def bare_call() -> str:
        metadata = settings.security.metadata
        answer = await bare.unary_unary(f"/{ECHO}/Call")(b"", timeout=5, metadata=metadata)
        return bytes(answer).decode()

    try:
        assert await _call(engine) == "engine"
        assert await bare_call() == "engine"
        with pytest.raises(grpc.aio.AioRpcError) as early:
            await _call_with(host.target, NEW)
        assert early.value.code() == grpc.StatusCode.UNAUTHENTICATED

        # Rotation, step 1: the receiver accepts both tokens.
        rewrite(callers, f"engine={OLD}\nengine={NEW}\n")
        assert await _call_with(host.target, NEW) == "engine"
        assert await _call(engine) == "engine"
        # Step 2: the caller sends the new one, on the channels it already had.
        rewrite(token, NEW + "\n")
        assert await _call(engine) == "engine"
        # Step 3: the old token is removed and refused; the rotated caller goes on.
        rewrite(callers, f"engine={NEW}\n")
        with pytest.raises(grpc.aio.AioRpcError) as removed:
            await _call_with(host.target, OLD)
        assert removed.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert await _call(engine) == "engine"
        assert await bare_call() == "engine"

        # Half-written during the next rotation: the tokens last taken stay.
        with caplog.at_level(logging.WARNING):
            rewrite(callers, "engine")
            rewrite(token, "")
            assert await _call(engine) == "engine"
        assert "caller_tokens_file changed but was not taken" in caplog.text
        assert "service_token_file changed but was not taken" in caplog.text
        assert host.guard.book.watched is not None and host.guard.book.watched.reloads == 2
    finally:
        await engine.close()
        await bare.close()
