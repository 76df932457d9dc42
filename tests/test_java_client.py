"""The Java game-server client (clients/java/), built from protos/ with Debian's jars, runs its
example plugin against the whole stack: what `make java-client` does (scripts/java_client_check.py).
Also: the checks of that script can fail (a drifted tool schema, a missing check)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_check():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(
        "java_client_check", ROOT / "scripts" / "java_client_check.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


check = _load_check()

_TOOLS = [
    {
        "name": "minecraft:item.give",
        "input_schema": json.dumps(
            {
                "type": "object",
                "properties": {"item": {"type": "string"}, "count": {"type": "integer"}},
            }
        ),
        "output_schema": json.dumps({"type": "object", "required": ["item"]}),
        "read_only": False,
        "idempotent": False,
        "event_allowed": True,
    }
]


def _catalogue(**changes: object) -> dict[str, object]:
    entry: dict[str, object] = {
        "name": "minecraft:item.give",
        "input_schema": {
            "type": "object",
            "description": "annotations do not count",
            "properties": {
                "item": {"type": "string", "description": "Item id."},
                "count": {"type": "integer"},
            },
        },
        "output_schema": {"type": "object", "required": ["item"]},
        "read_only": False,
        "idempotent": False,
        "event_allowed": True,
    }
    entry.update(changes)
    return {"protocol_version": 1, "tools": [entry]}


def test_catalogue_comparison_ignores_annotations_only() -> None:
    assert check.catalogue_mismatches(_TOOLS, _catalogue()) == []
    drifted = _catalogue(output_schema={"type": "object", "required": ["item", "count"]})
    assert "output_schema differs" in "\n".join(check.catalogue_mismatches(_TOOLS, drifted))
    flipped = _catalogue(idempotent=True)
    assert check.catalogue_mismatches(_TOOLS, flipped) == [
        "minecraft:item.give: idempotent is False, the catalogue says True"
    ]
    missing = {"tools": [{**_catalogue()["tools"][0], "name": "minecraft:quest.list"}]}  # type: ignore[index]
    assert "not offered by the Java world" in check.catalogue_mismatches(_TOOLS, missing)[0]


def test_a_tool_the_catalogue_says_honours_call_ids_must_honour_them() -> None:
    honoured = _catalogue(honours_call_id=True)
    assert check.catalogue_mismatches(_TOOLS, honoured) == [
        "minecraft:item.give: honours_call_id is False, the catalogue says True"
    ]
    promising = [{**_TOOLS[0], "honours_call_id": True}]
    assert check.catalogue_mismatches(promising, honoured) == []
    assert check.catalogue_mismatches(promising, _catalogue()) == []  # a harmless promise


def test_tools_of_a_feature_the_java_world_lacks_may_be_missing() -> None:
    quests = {
        "name": "ftbquests:quest.query",
        "read_only": True,
        "needed_by": [
            {"module_id": "system:quests", "required": True, "owner_feature": "ftbquests"},
            {"module_id": "system:reasoning", "required": False, "owner_feature": "system:core"},
        ],
    }
    catalogue = {"protocol_version": 1, "tools": [quests]}
    assert check.catalogue_mismatches([], catalogue) == []
    assert check.catalogue_mismatches([], catalogue, ("ftbquests",)) == [
        "ftbquests:quest.query: documented in the catalogue, not offered by the Java world"
    ]
    core = dict(quests, needed_by=[dict(quests["needed_by"][0], owner_feature="system:core")])
    assert check.catalogue_mismatches([], {"tools": [core]}) != []


def test_a_session_missing_a_check_fails() -> None:
    names = check.expected_checks(True)
    stdout = "".join(f"CHECK ok {name}\n" for name in names[1:]) + "RESULT ok 14 checks\n"
    done = subprocess.CompletedProcess(["java"], 0, stdout, "")
    assert check.check_session(done, True) == [f"checks missing from the output: {names[0]}"]
    full = "".join(f"CHECK ok {name}\n" for name in names) + "RESULT ok 15 checks\n"
    assert check.check_session(subprocess.CompletedProcess(["java"], 0, full, ""), True) == []
    failed = full + "CHECK FAIL reconnect: welcomes=1\n"
    assert check.check_session(subprocess.CompletedProcess(["java"], 1, failed, ""), True) == [
        "CHECK FAIL reconnect: welcomes=1",
        "the example exited with 1",
    ]


@pytest.mark.e2e
def test_java_example_against_the_stack(capsys: pytest.CaptureFixture[str]) -> None:
    """Builds the Java client and runs the example session in plaintext, and over TLS (and
    with a CA the gateway's certificate is not from) when the gateway has TLS settings."""
    try:
        check.build()
    except check.JavaMissing as exc:
        pytest.skip(f"the Java toolchain or Debian's grpc-java jars are not installed: {exc}")
    code = check.main(["--no-build"])
    output = capsys.readouterr().out
    assert code == 0, output[-12000:]
    assert "=== plaintext" in output
    if check.gateway_tls_env() is not None:
        assert "=== tls" in output and "TLS handshake" in output


@pytest.mark.e2e
def test_the_example_console_forwards_what_the_operator_types(tmp_path: Path) -> None:
    """`ExamplePlugin --console`: the server console joined as a player of its own at level 4
    (ServerConsole), every line of standard input sent as its chat and every answer printed
    to the console; in the operators' language (here zh)."""
    from services.stack import Stack

    try:
        classpath = check.build()
    except check.JavaMissing as exc:
        pytest.skip(f"the Java toolchain or Debian's grpc-java jars are not installed: {exc}")
    stack = Stack(tmp_path / "stack", server_id=check.SERVER_ID, token=check.TOKEN)
    stack.start(timeout=90)
    try:
        typed = "/system 路由诊断\n\n/help\n/system revoke nobody\n"
        done = subprocess.run(
            check.java_command(
                classpath,
                "--address",
                stack.target("gateway"),
                "--server-id",
                check.SERVER_ID,
                "--console",
                "--console-language",
                "zh_cn",
            ),
            input=typed,
            capture_output=True,
            text=True,
            encoding="utf-8",
            timeout=120,
            env={**os.environ, "SYSTEM_GAME_SERVER_TOKEN": check.TOKEN},
        )
    finally:
        stack.stop()
    printed = done.stdout.splitlines()
    assert done.returncode == 0, done.stdout + done.stderr
    # Three lines typed (the blank one skipped), three answers, each printed after its line.
    assert [line for line in printed if line.startswith("[console] > ")] == [
        "[console] > /system 路由诊断",
        "[console] > /help",
        "[console] > /system revoke nobody",
    ]
    assert "[console] ┌─ 路由诊断" in printed
    assert any(line.startswith("[console] │ /revoke ") for line in printed)  # an admin's help
    assert "[console] ┌─ 已撤销 nobody" in printed
    assert all(line.startswith("[console] ") for line in printed), printed
