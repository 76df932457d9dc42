"""The router's one model call: the capability catalogue in, one module id (or `clarify`) out.

The catalogue lists only the modules this player may use; `structuredOnly` modules are left
out and `explicitOnly` ones are flagged, so the model is told to pick them only when it is very
sure the current request asks for exactly that. Only ids from this catalogue decode; anything
else (free text, an unknown id, malformed JSON) is treated as `clarify`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

import grpc
from system.common.v1 import catalog_pb2, common_pb2
from system.model.v1 import model_pb2, model_pb2_grpc

from router_service.commands import after_alias
from services.untrusted import request_text

__all__ = ["CLARIFY", "ROUTING_MODULE_ID", "ModelChoice", "ModelRouter", "capability_catalogue"]

log = logging.getLogger("system.router.model")

CLARIFY = "clarify"
MODEL_TIMEOUT_SECONDS = 20.0
ROUTING_MODULE_ID = "system:router"
"""The module id of the routing call (CompleteRequest.module_id): its spend is shown under it
in `/system spend`, and a providers file may give it a model list of its own
(`[routes] "system:router" = [...]`, a cheap model, say). No module of the catalogue has
this id."""

_INSTRUCTIONS = """You route a Minecraft player's request to one capability of an in-game \
assistant. Reply with JSON only: {"capabilityId": "<id>", "arguments": {...}}.
Rules:
- Choose only an id from the catalogue, or "clarify" when none fits or the request is unclear.
- Judge the current request alone; earlier turns and similarity are not permission.
- A capability marked "explicitOnly": true may be chosen only when the player clearly and \
explicitly asks for exactly it; otherwise answer "clarify".
- "arguments" holds only values the player wrote in this request, matching the inputSchema.
"""


@dataclasses.dataclass(frozen=True)
class ModelChoice:
    """What the model chose: a module and its arguments, or clarify (module_id == CLARIFY)."""

    module_id: str
    arguments: dict[str, Any]


def capability_catalogue(
    modules: list[catalog_pb2.ModuleDescriptor], language: str
) -> list[dict[str, Any]]:
    """The catalogue sent to the model: interactive modules, structuredOnly ones left out."""
    catalogue = []
    for module in modules:
        if (
            module.routing_mode
            in (
                catalog_pb2.ROUTING_MODE_STRUCTURED_ONLY,
                catalog_pb2.ROUTING_MODE_UNSPECIFIED,
            )
            or not module.interactive
        ):
            continue
        text = module.description.text
        catalogue.append(
            {
                "id": module.module_id,
                "description": text.get(language) or text.get("en") or "",
                "inputSchema": json.loads(module.input_schema or "{}"),
                "explicitOnly": module.routing_mode == catalog_pb2.ROUTING_MODE_EXPLICIT_ONLY,
            }
        )
    catalogue.append({"id": CLARIFY, "description": "The request is unclear or fits nothing."})
    return catalogue


def decode_choice(content: str, allowed: set[str]) -> ModelChoice:
    """Reads the model's answer; only ids in `allowed` (plus clarify) decode."""
    text = content.strip()
    if text.startswith("```"):  # tolerate a fenced block
        text = text.strip("`").removeprefix("json").strip()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return ModelChoice(CLARIFY, {})
    if not isinstance(data, dict):
        return ModelChoice(CLARIFY, {})
    module_id = data.get("capabilityId")
    arguments = data.get("arguments") or {}
    if (
        not isinstance(module_id, str)
        or module_id not in allowed
        or not isinstance(arguments, dict)
    ):
        return ModelChoice(CLARIFY, {})
    return ModelChoice(module_id, arguments)


def with_text_argument(
    choice: ModelChoice, modules: list[catalog_pb2.ModuleDescriptor], text: str
) -> ModelChoice:
    """A module whose command takes free text (`/question <text>`) gets the player's words
    when the model chose it without filling that field: the choice is the model's, the
    argument is what the player wrote in this request, read as the command reads it (`buy 2
    bread` gives `/buy` the words `2 bread`, as `/buy 2 bread` would)."""
    if choice.module_id == CLARIFY:
        return choice
    module = next((m for m in modules if m.module_id == choice.module_id), None)
    for command in module.commands if module is not None else ():
        field = command.argument_field
        if (
            command.argument_kind == catalog_pb2.ARGUMENT_KIND_REQUIRED_TEXT
            and field
            and field not in choice.arguments
        ):
            words = after_alias(text.strip(), command.aliases) or text.strip()
            return ModelChoice(choice.module_id, {**choice.arguments, field: words})
    return choice


class ModelRouter:
    """Asks the model gateway which module a text means."""

    def __init__(self, stub: model_pb2_grpc.ModelGatewayServiceAsyncStub) -> None:
        self._stub = stub

    async def choose(
        self,
        player: common_pb2.PlayerContext,
        text: str,
        modules: list[catalog_pb2.ModuleDescriptor],
    ) -> ModelChoice | None:
        """The model's choice, or None when no model can be asked (none configured, provider
        down, out of time): the caller then falls back locally."""
        catalogue = capability_catalogue(modules, player.language)
        allowed = {entry["id"] for entry in catalogue}
        request = model_pb2.CompleteRequest(
            player_id=player.player_id,
            # Attributed to routing in the spend view, and checked against the player's rank.
            module_id=ROUTING_MODULE_ID,
            permission_level=player.permission_level,
            temperature=0.0,
            max_tokens=200,
            messages=[
                model_pb2.ChatMessage(role=model_pb2.MESSAGE_ROLE_SYSTEM, content=_INSTRUCTIONS),
                model_pb2.ChatMessage(
                    role=model_pb2.MESSAGE_ROLE_USER,
                    content=json.dumps(
                        {
                            "catalogue": catalogue,
                            "playerLanguage": player.language,
                            # The asker's own words: the request, cleaned of formatting
                            # codes and invisible characters like every text the model reads.
                            "request": request_text(text),
                        },
                        ensure_ascii=False,
                    ),
                ),
            ],
        )
        try:
            response = await self._stub.Complete(request, timeout=MODEL_TIMEOUT_SECONDS)
        except grpc.aio.AioRpcError as exc:
            log.info("model routing unavailable: %s %s", exc.code().name, exc.details())
            return None
        return with_text_argument(decode_choice(response.content, allowed), modules, text)
