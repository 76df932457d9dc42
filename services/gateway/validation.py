"""Checks on frames from game servers, made before anything in a frame is forwarded. Each
failure says what to fix, and echoes a value the game server sent at most 64 characters long
(`shown`), so a huge id can grow neither a FrameError nor a log line.

Limits (a frame over one is refused alone, with a FrameError):

| what | limit |
|---|---|
| ids (request, player, call, card, action), player names | 64 characters |
| module, event and tool names | 128 characters |
| Struct nesting (invoke input, event data, tool output) | 16 levels (the next hop's protobuf decoder refuses about 32) |
| invoke input, event data | 16 KiB encoded |
| tool output | 256 KiB encoded |
| button args | 32 entries, 64-character keys, 4096-character values |
| tool failure | key 128, message 1024 characters, 16 args of 256 |
| hello | 64 features of 64 characters, 256 tools, descriptions 1024, schemas 16384 characters |
"""

from __future__ import annotations

import re

from google.protobuf import struct_pb2
from system.gateway.v1 import gateway_pb2

from services.runtime.errors import FailedPrecondition, InvalidArgument, Unauthenticated

__all__ = [
    "MAX_STRUCT_DEPTH",
    "check_card_action",
    "check_event",
    "check_hello",
    "check_id",
    "check_presence",
    "check_struct",
    "check_tool_result",
    "normalize_language",
    "shown",
]

IDENTIFIER = re.compile(r"^[a-z0-9_.-]+:[a-z0-9_./-]+$")
MAX_ID = 64
MAX_NAME = 128
MAX_TOOLS = 256
MAX_FEATURES = 64
MAX_SCHEMA = 16_384
MAX_DESCRIPTION = 1024
MAX_SOFTWARE = 128
MAX_PERMISSION = 4
MAX_LANGUAGE = 16
MAX_STRUCT_DEPTH = 16
MAX_INPUT_BYTES = 16 * 1024
MAX_OUTPUT_BYTES = 256 * 1024
MAX_ARGS = 32
MAX_ARG_VALUE = 4096
MAX_FAILURE_MESSAGE = 1024
MAX_FAILURE_ARGS = 16
MAX_FAILURE_ARG = 256
MAX_SHOWN = 64
LANGUAGES = ("zh", "en")


def shown(value: str, limit: int = MAX_SHOWN) -> str:
    """`value` as an error message or log line may echo it: at most `limit` characters, then
    `…` when it was longer."""
    return value if len(value) <= limit else value[:limit] + "…"


def normalize_language(code: str) -> str:
    """`zh_cn`, `zh-TW`, `ZH` → `zh`; `en_us` → `en`; anything else → `en`."""
    short = code.strip().lower().replace("-", "_").split("_")[0]
    return short if short in LANGUAGES else "en"


def check_id(what: str, value: str, limit: int = MAX_ID) -> None:
    if not value:
        raise InvalidArgument(f"{what} is required")
    if len(value) > limit or not value.isprintable():
        raise InvalidArgument(f"{what} must be at most {limit} printable characters")


def _check_text(what: str, value: str, limit: int) -> None:
    if len(value) > limit:
        raise InvalidArgument(f"{what} has {len(value)} characters; the limit is {limit}")


def _depth_over(struct: struct_pb2.Struct, limit: int) -> bool:
    """Whether the Struct nests deeper than `limit` levels (a Struct or list inside a value
    is one more level). Stops at the first branch over the limit."""
    stack: list[tuple[object, int]] = [(struct, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        values = (
            node.fields.values() if isinstance(node, struct_pb2.Struct) else node.values  # type: ignore[attr-defined]
        )
        for value in values:
            kind = value.WhichOneof("kind")
            if kind == "struct_value":
                stack.append((value.struct_value, depth + 1))
            elif kind == "list_value":
                stack.append((value.list_value, depth + 1))
    return False


def check_struct(what: str, struct: struct_pb2.Struct, max_bytes: int) -> None:
    """A Struct a game server sent, before it is forwarded: at most `max_bytes` encoded and
    MAX_STRUCT_DEPTH levels deep."""
    size = struct.ByteSize()
    if size > max_bytes:
        raise InvalidArgument(f"{what} is {size} bytes; the limit is {max_bytes}")
    if _depth_over(struct, MAX_STRUCT_DEPTH):
        raise InvalidArgument(f"{what} nests deeper than {MAX_STRUCT_DEPTH} levels")


def check_hello(hello: gateway_pb2.Hello, authenticated_server: str, protocol: int) -> None:
    """Validates a hello against the token's server id and the protocol version we speak."""
    check_id("hello.server_id", hello.server_id)
    if hello.server_id != authenticated_server:
        raise Unauthenticated(
            f"the token was issued for server {authenticated_server!r}, "
            f"not {shown(hello.server_id)!r}"
        )
    if hello.protocol_version != protocol:
        raise FailedPrecondition(
            f"this gateway speaks protocol version {protocol}; the hello asked for "
            f"{hello.protocol_version}. Update the plugin or the gateway so both speak {protocol}"
        )
    if len(hello.features) > MAX_FEATURES:
        raise InvalidArgument(f"hello.features lists more than {MAX_FEATURES} features")
    for index, feature in enumerate(hello.features):
        check_id(f"hello.features[{index}]", feature)
    _check_text("hello.software", hello.software, MAX_SOFTWARE)
    if len(hello.tools) > MAX_TOOLS:
        raise InvalidArgument(f"hello.tools lists more than {MAX_TOOLS} tools")
    seen: set[str] = set()
    for index, tool in enumerate(hello.tools):
        where = f"hello.tools[{index}]"
        if len(tool.name) > MAX_NAME:
            raise InvalidArgument(f"{where}.name is longer than {MAX_NAME} characters")
        if not IDENTIFIER.match(tool.name):
            raise InvalidArgument(f"{where}.name {tool.name!r} is not of the form namespace:path")
        if tool.name in seen:
            raise InvalidArgument(f"{where}.name {tool.name} is offered twice")
        seen.add(tool.name)
        _check_text(f"{where}.description", tool.description, MAX_DESCRIPTION)
        for field in ("input_schema", "output_schema"):
            text = getattr(tool, field)
            if len(text) > MAX_SCHEMA:
                raise InvalidArgument(f"{where}.{field} is longer than {MAX_SCHEMA} characters")
        # A schema that is not JSON or not a JSON Schema refuses that tool alone, with a
        # ToolProblem in the Welcome (services.gateway.tool_contract), not the connection.


def check_presence(presence: gateway_pb2.PlayerPresence, max_player_id: int = MAX_ID) -> None:
    if presence.kind not in (
        gateway_pb2.PRESENCE_KIND_JOIN,
        gateway_pb2.PRESENCE_KIND_LEAVE,
        gateway_pb2.PRESENCE_KIND_UPDATE,
    ):
        raise InvalidArgument("presence.kind must be JOIN, LEAVE or UPDATE")
    check_id("presence.player_id", presence.player_id, max_player_id)
    if len(presence.player_name) > MAX_ID:
        raise InvalidArgument(f"presence.player_name must be at most {MAX_ID} characters")
    _check_text("presence.language", presence.language, MAX_LANGUAGE)
    if presence.permission_level > MAX_PERMISSION:
        raise InvalidArgument(f"presence.permission_level must be 0..{MAX_PERMISSION}")


def check_card_action(action: gateway_pb2.CardAction) -> None:
    """A button press: bounded ids and args (the button's JSON input is checked when read)."""
    check_id("card_action.action_id", action.action_id)
    _check_text("card_action.source.card_id", action.source.card_id, MAX_ID)
    if len(action.args) > MAX_ARGS:
        raise InvalidArgument(f"card_action.args has more than {MAX_ARGS} entries")
    for key, value in action.args.items():
        _check_text("a card_action.args key", key, MAX_ID)
        _check_text(f"card_action.args[{shown(key)!r}]", value, MAX_ARG_VALUE)


def check_tool_result(result: gateway_pb2.ToolResult) -> None:
    """A tool answer, before it goes to the engine: a bounded output or failure."""
    kind = result.WhichOneof("outcome")
    if kind == "output":
        check_struct("tool_result.output", result.output, MAX_OUTPUT_BYTES)
    elif kind == "failure":
        failure = result.failure
        _check_text("tool_result.failure.key", failure.key, MAX_NAME)
        _check_text("tool_result.failure.message", failure.message, MAX_FAILURE_MESSAGE)
        if len(failure.args) > MAX_FAILURE_ARGS:
            raise InvalidArgument(
                f"tool_result.failure.args has more than {MAX_FAILURE_ARGS} entries"
            )
        for key, value in failure.args.items():
            _check_text("a tool_result.failure.args key", key, MAX_ID)
            _check_text("a tool_result.failure.args value", value, MAX_FAILURE_ARG)


MAX_EVENT_KEY = 128
MAX_EVENT_DATA_BYTES = 16 * 1024


def check_event(event: gateway_pb2.GameEvent, max_player_id: int = MAX_ID) -> None:
    """A game event needs a player, a `namespace:path` type and a key of at most 128
    characters; its data is bounded (events carry facts, not documents)."""
    check_id("event.player_id", event.player_id, max_player_id)
    check_id("event.event_type", event.event_type, MAX_NAME)
    if ":" not in event.event_type:
        raise InvalidArgument(
            f"event.event_type {event.event_type!r} must be namespace:path "
            "(for example minecraft:advancement)"
        )
    if not event.event_key or len(event.event_key) > MAX_EVENT_KEY:
        raise InvalidArgument(f"event.event_key is required, at most {MAX_EVENT_KEY} characters")
    check_struct("event.data", event.data, MAX_EVENT_DATA_BYTES)
