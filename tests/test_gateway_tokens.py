"""Game-server tokens from a mounted file, rotated without a restart (issue 19): open streams go
on, new streams need the new token, a half-written file changes nothing, and a server unknown at
start is not admitted by a reload."""

from __future__ import annotations

import logging
import os
import pathlib
from typing import Any

import grpc
import pytest

from services.gamesim.client import GatewayRefused
from services.gateway import tokens
from services.gateway.config import GatewayConfig
from services.gateway.tokens import TokenBook
from services.runtime.config import ConfigError
from tests.inprocess import running_chain

OLD, NEW = "lobby-token-old-1", "lobby-token-new-2"


def rewrite(path: pathlib.Path, text: str) -> None:
    """Writes `text` with a modification time past the last one, as a Secret update does."""
    before = path.stat().st_mtime_ns if path.exists() else 0
    path.write_text(text)
    os.utime(path, ns=(before + 1_000_000_000, before + 1_000_000_000))


async def test_a_rotated_token_is_taken_without_dropping_open_streams(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(tokens, "RECHECK_SECONDS", 0.0)
    secret = tmp_path / "tokens"
    rewrite(secret, f"# game servers\nlobby={OLD}\n\n")
    async with running_chain(tmp_path, tokens_file=str(secret)) as chain:
        lobby = await chain.client("lobby", OLD)
        await lobby.join("steve", "Steve", "en_us")

        rewrite(secret, f"lobby={NEW}\nextra=extra-token-123\n")
        with pytest.raises(GatewayRefused) as refused:
            await chain.client("lobby", OLD)
        assert refused.value.details == "the token is not valid for any game server"
        # The stream opened with the old token goes on.
        assert (await lobby.chat("steve", "help")).reply.module_id == "system:help"
        # A new stream needs the new token (and, as any newer stream, replaces the old one).
        again = await chain.client("lobby", NEW)
        await again.join("alex", "Alex", "en_us")
        assert (await again.chat("alex", "help")).reply.module_id == "system:help"
        # A server first named by a reload waits for a restart.
        with pytest.raises(GatewayRefused):
            await chain.client("extra", "extra-token-123")
        assert "unknown at start (extra)" in caplog.text

        # Half-written during a rotation: the last good book stays.
        with caplog.at_level(logging.WARNING):
            rewrite(secret, "lobby")
            assert (await chain.client("lobby", NEW)).server_id == "lobby"
        assert "tokens_file changed but was not taken" in caplog.text


def test_token_files_are_checked_at_start(tmp_path: pathlib.Path) -> None:
    secret = tmp_path / "tokens"
    secret.write_text("lobby=lobby-token-1\n")
    base = {"tokens": ("main=main-token-1",), "tokens_file": str(secret)}
    assert GatewayConfig(**base).token_book() == {  # type: ignore[arg-type]
        "main-token-1": "main",
        "lobby-token-1": "lobby",
    }
    for text, words in (
        ("lobby", "tokens_file[0] must look like server_id=token"),
        ("lobby=short", "shorter than 8"),
        ("main=other-token-1", "server main or its token is also in tokens"),
    ):
        secret.write_text(text)
        with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
            GatewayConfig(**base).validate()  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="cannot be read"):
        GatewayConfig(tokens_file=str(tmp_path / "missing")).validate()
    with pytest.raises(ConfigError, match="no game-server token is set"):
        GatewayConfig().validate()
    # As the `tokens` variable holds them: one Secret value serves both.
    secret.write_text("lobby=lobby-token-1, pvp=pvp-token-1\n")
    book = TokenBook((), str(secret))
    assert (book.server_of("lobby-token-1"), book.server_of("pvp-token-1")) == ("lobby", "pvp")


async def test_a_refusal_that_raced_the_hello_is_asked_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """grpc reports its own INTERNAL, not the gateway's status, for a hello written as the
    gateway refused the stream: the simulated game server connects again to learn why, and
    passes any other refusal on at once."""
    from services.gamesim import client as gamesim

    race = GatewayRefused(grpc.StatusCode.INTERNAL, gamesim.CORE_WRITE_RACE)
    why = GatewayRefused(
        grpc.StatusCode.UNAUTHENTICATED, "the token is not valid for any game server"
    )
    tries: list[int] = []

    def connecting(outcomes: list[GatewayRefused]) -> Any:
        async def once(self: object, timeout: float) -> None:
            tries.append(1)
            raise outcomes[min(len(tries), len(outcomes)) - 1]

        return once

    game = gamesim.GameServerClient("127.0.0.1:1", "lobby", OLD)
    monkeypatch.setattr(gamesim.GameServerClient, "_connect_once", connecting([race, why]))
    with pytest.raises(GatewayRefused) as refused:
        await game.connect()
    assert refused.value is why and len(tries) == 2

    tries.clear()
    monkeypatch.setattr(gamesim.GameServerClient, "_connect_once", connecting([race]))
    with pytest.raises(GatewayRefused) as raced:
        await game.connect()
    assert raced.value is race and len(tries) == gamesim.HELLO_RACE_ATTEMPTS

    tries.clear()
    monkeypatch.setattr(gamesim.GameServerClient, "_connect_once", connecting([why]))
    with pytest.raises(GatewayRefused):
        await game.connect()
    assert len(tries) == 1
