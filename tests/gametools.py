"""Calling the simulated world's game tools in tests, the way the engine would read them."""

from __future__ import annotations

import functools
from typing import Any

from engine_service.app import build_registry
from engine_service.config import EngineConfig
from engine_service.schema import violation
from engine_service.tools import ToolSpec
from services.gamesim.world import World

__all__ = ["call_tool", "tool_spec"]


@functools.cache
def _specs() -> dict[str, ToolSpec]:
    return {spec.tool_id: spec for spec in build_registry(EngineConfig()).tools.specs()}


def tool_spec(tool: str) -> ToolSpec:
    """The catalogue's declaration of a game tool."""
    return _specs()[tool]


def call_tool(world: World, tool: str, data: dict[str, Any], player: str = "steve") -> Any:
    """Runs a tool in `world` and checks its answer against the catalogue's output schema."""
    answer = world.call(player, tool, data)
    found = violation(tool_spec(tool).output_schema, answer)
    assert found is None, (tool, data, found and found.text())
    return answer
