"""The game-tool catalogue: the committed docs/game-tools.md and .json are what the registry
generates, every example validates against its own schemas, and the engine serves the same
catalogue over GetGameToolCatalog."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import shutil
import subprocess
import sys
from types import ModuleType

import pytest
from jsonschema import Draft202012Validator
from system.engine.v1 import engine_pb2, engine_pb2_grpc

from engine_service.app import build_registry
from engine_service.config import EngineConfig
from engine_service.registry import ExecutionPolicy, ModuleRegistry, ModuleSpec
from engine_service.tool_catalog import game_tool_catalog
from tests.inprocess import running_chain

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gen_tool_catalog.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_tool_catalog", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _document() -> dict:
    return json.loads((ROOT / "docs" / "game-tools.json").read_text(encoding="utf-8"))


def test_committed_catalogue_is_what_the_registry_generates() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_check_fails_when_a_file_differs(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = _script()
    for name in ("MARKDOWN", "JSON"):
        copy = tmp_path / getattr(script, name).name
        shutil.copy(getattr(script, name), copy)
        monkeypatch.setattr(script, name, copy)
    assert script.stale() == []
    script.JSON.write_text(
        script.JSON.read_text().replace('"read_only": true', '"read_only": false')
    )
    assert script.stale() == [script.JSON]
    script.MARKDOWN.unlink()
    assert script.stale() == [script.MARKDOWN, script.JSON]


def test_every_example_validates_against_its_own_schemas() -> None:
    tools = _document()["tools"]
    assert {t["name"] for t in tools} >= {"minecraft:inventory.read", "minecraft:item.give"}
    for tool in tools:
        for side in ("input", "output"):
            schema = tool[f"{side}_schema"]
            Draft202012Validator.check_schema(schema)
            assert schema["type"] == "object", tool["name"]
            example = tool[f"example_{side}"]
            assert example is not None, f"{tool['name']} documents no example {side}"
            errors = [e.message for e in Draft202012Validator(schema).iter_errors(example)]
            assert errors == [], (tool["name"], side, errors)


def test_catalogue_names_the_modules_needing_each_tool() -> None:
    tools = {t["name"]: t for t in _document()["tools"]}
    inventory = tools["minecraft:inventory.read"]
    assert inventory["read_only"] and inventory["idempotent"] and inventory["event_allowed"]
    core = {"owner_feature": "system:core"}
    assert {"module_id": "system:inventory", "required": True, **core} in inventory["needed_by"]
    assert {"module_id": "system:reasoning", "required": False, **core} in inventory["needed_by"]
    give = tools["minecraft:item.give"]
    assert not give["read_only"] and not give["idempotent"] and give["event_allowed"]
    assert give["needed_by"] == [
        {"module_id": "system:advancement_reward", "required": True, **core}
    ]
    # A module of an optional feature says so: servers without it need not offer the tool.
    query = tools["ftbquests:quest.query"]["needed_by"]
    assert {"module_id": "system:quests", "required": True, "owner_feature": "ftbquests"} in query
    # The output schema says what system:inventory reads: items[].item and items[].count.
    item = inventory["output_schema"]["properties"]["items"]["items"]
    assert set(item["required"]) == {"item", "count"}
    markdown = (ROOT / "docs" / "game-tools.md").read_text(encoding="utf-8")
    assert "## `minecraft:inventory.read`" in markdown and "system.error.tool_output_invalid" in (
        markdown
    )


async def test_engine_serves_the_same_catalogue(tmp_path: pathlib.Path) -> None:
    async with running_chain(tmp_path) as chain:
        stub = engine_pb2_grpc.EngineServiceStub(chain.channel("engine"))
        response = await stub.GetGameToolCatalog(engine_pb2.GetGameToolCatalogRequest(), timeout=10)
        catalog = await stub.GetCatalog(engine_pb2.GetCatalogRequest(), timeout=10)
    assert response.generation == catalog.generation
    served = {entry.tool.name: entry for entry in response.tools}
    documented = {t["name"]: t for t in _document()["tools"]}
    assert set(served) == set(documented)
    for name, entry in served.items():
        doc = documented[name]
        assert entry.declared
        assert json.loads(entry.tool.input_schema) == doc["input_schema"]
        assert json.loads(entry.tool.output_schema) == doc["output_schema"]
        assert json.loads(entry.example_output) == doc["example_output"]
        assert (entry.tool.read_only, entry.tool.idempotent, entry.tool.event_allowed) == (
            doc["read_only"],
            doc["idempotent"],
            doc["event_allowed"],
        )
        assert [(n.module_id, n.required) for n in entry.needed_by] == [
            (n["module_id"], n["required"]) for n in doc["needed_by"]
        ]


def test_a_tool_named_without_declaration_is_listed_as_undeclared() -> None:
    registry = build_registry(EngineConfig())
    catalog = {entry.spec.tool_id: entry for entry in game_tool_catalog(registry)}
    assert all(entry.spec.declared for entry in catalog.values())

    class Quests:
        spec = ModuleSpec(
            module_id="test:quests",
            description={"en": "Quests."},
            input_schema={"type": "object"},
            tools=("ftbquests:quests.list",),
            policy=ExecutionPolicy(tool_calls=1, steps=1, write_steps=1),
        )

        async def run(self, data, ctx):  # type: ignore[no-untyped-def]
            raise AssertionError

    modules = ModuleRegistry()
    modules.register(Quests())
    modules.freeze()
    entry = next(e for e in game_tool_catalog(modules) if e.spec.tool_id == "ftbquests:quests.list")
    assert not entry.spec.declared and not entry.spec.read_only
    assert [(n.module_id, n.required) for n in entry.needed_by] == [("test:quests", True)]
