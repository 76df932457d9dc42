"""Checks on frames from game servers. Each failure says what to fix."""

from __future__ import annotations

import json
import re

from system.gateway.v1 import gateway_pb2

from services.runtime.errors import FailedPrecondition, InvalidArgument, Unauthenticated

__all__ = ["check_hello", "check_presence", "normalize_language"]

IDENTIFIER = re.compile(r"^[a-z0-9_.-]+:[a-z0-9_./-]+$")
MAX_ID = 64
MAX_TOOLS = 256
MAX_FEATURES = 64
MAX_SCHEMA = 16_384
MAX_PERMISSION = 4
LANGUAGES = ("zh", "en")


def normalize_language(code: str) -> str:
    """`zh_cn`, `zh-TW`, `ZH` → `zh`; `en_us` → `en`; anything else → `en`."""
    short = code.strip().lower().replace("-", "_").split("_")[0]
    return short if short in LANGUAGES else "en"


def check_id(what: str, value: str) -> None:
    if not value:
        raise InvalidArgument(f"{what} is required")
    if len(value) > MAX_ID or not value.isprintable():
        raise InvalidArgument(f"{what} must be at most {MAX_ID} printable characters")


def check_hello(hello: gateway_pb2.Hello, authenticated_server: str, protocol: int) -> None:
    """Validates a hello against the token's server id and the protocol version we speak."""
    check_id("hello.server_id", hello.server_id)
    if hello.server_id != authenticated_server:
        raise Unauthenticated(
            f"the token was issued for server {authenticated_server!r}, not {hello.server_id!r}"
        )
    if hello.protocol_version != protocol:
        raise FailedPrecondition(
            f"this gateway speaks protocol version {protocol}; the hello asked for "
            f"{hello.protocol_version}. Update the plugin or the gateway so both speak {protocol}"
        )
    if len(hello.features) > MAX_FEATURES:
        raise InvalidArgument(f"hello.features lists more than {MAX_FEATURES} features")
    if len(hello.tools) > MAX_TOOLS:
        raise InvalidArgument(f"hello.tools lists more than {MAX_TOOLS} tools")
    seen: set[str] = set()
    for index, tool in enumerate(hello.tools):
        where = f"hello.tools[{index}]"
        if not IDENTIFIER.match(tool.name):
            raise InvalidArgument(f"{where}.name {tool.name!r} is not of the form namespace:path")
        if tool.name in seen:
            raise InvalidArgument(f"{where}.name {tool.name} is offered twice")
        seen.add(tool.name)
        if len(tool.input_schema) > MAX_SCHEMA:
            raise InvalidArgument(f"{where}.input_schema is longer than {MAX_SCHEMA} characters")
        try:
            schema = json.loads(tool.input_schema or "{}")
        except json.JSONDecodeError as exc:
            raise InvalidArgument(f"{where}.input_schema is not JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise InvalidArgument(f"{where}.input_schema must be a JSON object")


def check_presence(presence: gateway_pb2.PlayerPresence) -> None:
    if presence.kind not in (
        gateway_pb2.PRESENCE_KIND_JOIN,
        gateway_pb2.PRESENCE_KIND_LEAVE,
        gateway_pb2.PRESENCE_KIND_UPDATE,
    ):
        raise InvalidArgument("presence.kind must be JOIN, LEAVE or UPDATE")
    check_id("presence.player_id", presence.player_id)
    if len(presence.player_name) > MAX_ID:
        raise InvalidArgument(f"presence.player_name must be at most {MAX_ID} characters")
    if presence.permission_level > MAX_PERMISSION:
        raise InvalidArgument(f"presence.permission_level must be 0..{MAX_PERMISSION}")


MAX_EVENT_KEY = 128
MAX_EVENT_DATA_BYTES = 16 * 1024


def check_event(event: gateway_pb2.GameEvent) -> None:
    """A game event needs a player, a `namespace:path` type and a key of at most 128
    characters; its data is bounded (events carry facts, not documents)."""
    check_id("event.player_id", event.player_id)
    check_id("event.event_type", event.event_type)
    if ":" not in event.event_type:
        raise InvalidArgument(
            f"event.event_type {event.event_type!r} must be namespace:path "
            "(for example minecraft:advancement)"
        )
    if not event.event_key or len(event.event_key) > MAX_EVENT_KEY:
        raise InvalidArgument(f"event.event_key is required, at most {MAX_EVENT_KEY} characters")
    size = event.data.ByteSize()
    if size > MAX_EVENT_DATA_BYTES:
        raise InvalidArgument(f"event.data is {size} bytes; the limit is {MAX_EVENT_DATA_BYTES}")
