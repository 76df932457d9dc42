"""A chat request and its answer: the types, their validation, and the OpenAI request body.

Domain code: no gRPC and no I/O. `ChatRequest.validate` raises InvalidArgument with a message
that names the field at fault; `ChatRequest.openai_params` is what the `openai` client sends.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from typing import Any, Literal

from services.runtime.errors import InvalidArgument

__all__ = [
    "ROLES",
    "check_player_id",
    "ChatMessage",
    "ChatRequest",
    "Completion",
    "Limits",
    "ToolCall",
    "ToolChoice",
    "ToolSpec",
]

MAX_PLAYER_ID = 64  # the storage service's bound on player ids
MAX_MODULE_ID = 128
MAX_PERMISSION_LEVEL = 4
ROLES: frozenset[str] = frozenset({"system", "user", "assistant", "tool"})
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
TOOL_MODES: frozenset[str] = frozenset({"", "auto", "none", "required", "tool"})
MAX_TOOLS = 64
ResponseFormat = Literal["", "text", "json_object"]


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One function call the model asked for (or, in a message, made earlier)."""

    id: str
    name: str
    arguments_json: str


@dataclasses.dataclass(frozen=True)
class ChatMessage:
    """One message of the conversation sent to the model."""

    role: str
    """`system`, `user`, `assistant` or `tool`."""
    content: str
    """The text; may be empty on an assistant message holding tool calls."""
    tool_calls: tuple[ToolCall, ...] = ()
    """Calls the model made (assistant messages only)."""
    tool_call_id: str = ""
    """The call a tool message answers (tool messages only)."""


@dataclasses.dataclass(frozen=True)
class ToolSpec:
    """A function the model may call."""

    name: str
    description: str = ""
    parameters_json: str = ""
    """JSON Schema of the arguments, as JSON text; empty for none."""


@dataclasses.dataclass(frozen=True)
class ToolChoice:
    """`mode` is "" (provider default), auto, none, required, or tool (with `tool_name`)."""

    mode: str = ""
    tool_name: str = ""


@dataclasses.dataclass(frozen=True)
class Limits:
    """The gateway's bounds on a request."""

    max_prompt_chars: int
    default_max_tokens: int
    max_answer_tokens: int


@dataclasses.dataclass(frozen=True)
class Completion:
    """The model's answer and what it cost."""

    content: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    model: str
    tool_calls: tuple[ToolCall, ...] = ()
    prompt_cache_hit_tokens: int = 0
    prompt_cache_miss_tokens: int = 0
    attempts: int = 1
    provider: str = ""
    """The configured provider that answered."""
    cost_micros: int = 0
    """What the answer cost at its model's configured prices, in millionths of the prices'
    currency (0 for a model without prices)."""


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    """One Complete request, as the gateway received it."""

    messages: Sequence[ChatMessage]
    max_tokens: int = 0
    temperature: float = 0.0
    player_id: str = ""
    tools: Sequence[ToolSpec] = ()
    tool_choice: ToolChoice = ToolChoice()
    response_format: ResponseFormat = ""
    module_id: str = ""
    """The module asking; picks its provider/model list ("" for the default list)."""
    permission_level: int = 0
    """The player's operator permission level: picks the rank whose budgets apply."""

    def validate(self, limits: Limits) -> None:
        """Raises InvalidArgument, naming the field at fault, for a request that cannot be
        sent."""
        check_player_id(self.player_id, required=False)
        if len(self.module_id) > MAX_MODULE_ID or not self.module_id.isprintable():
            raise InvalidArgument(f"module_id must be at most {MAX_MODULE_ID} printable characters")
        if self.module_id and ":" not in self.module_id:
            # Storage records spend under it and takes catalogue ids alone: refused here, not
            # when the use is settled after the call.
            raise InvalidArgument(
                f"module_id must be a catalogue id `namespace:path` (or empty), got "
                f"{self.module_id!r}"
            )
        if not 0 <= self.permission_level <= MAX_PERMISSION_LEVEL:
            raise InvalidArgument(
                f"permission_level must be 0 to {MAX_PERMISSION_LEVEL}, got {self.permission_level}"
            )
        if not self.messages:
            raise InvalidArgument("messages must hold at least one message")
        for index, message in enumerate(self.messages):
            _check_message(index, message)
        if self.prompt_chars() > limits.max_prompt_chars:
            raise InvalidArgument(
                f"the messages and tool schemas hold {self.prompt_chars()} characters; the "
                f"limit is {limits.max_prompt_chars}"
            )
        # Written so NaN fails too.
        if not 0.0 <= self.temperature <= 2.0:
            raise InvalidArgument(f"temperature must be between 0 and 2, got {self.temperature:g}")
        if self.max_tokens > limits.max_answer_tokens:
            raise InvalidArgument(
                f"max_tokens is {self.max_tokens}; the most a request may ask for is "
                f"{limits.max_answer_tokens}"
            )
        self._check_tools()
        if self.response_format == "json_object" and not any(
            "json" in m.content.lower() for m in self.messages
        ):
            # The provider refuses json_object mode otherwise; say so before paying for it.
            raise InvalidArgument(
                "response_format RESPONSE_FORMAT_JSON_OBJECT needs the word 'json' in a message "
                "(for example in the system message: 'Answer with one JSON object'), as the "
                "provider requires"
            )

    def _check_tools(self) -> None:
        if len(self.tools) > MAX_TOOLS:
            raise InvalidArgument(f"tools holds {len(self.tools)} tools; the most is {MAX_TOOLS}")
        names: set[str] = set()
        for index, tool in enumerate(self.tools):
            if not TOOL_NAME.match(tool.name):
                raise InvalidArgument(
                    f"tools[{index}].name must be 1 to 64 of A-Z a-z 0-9 _ -, got {tool.name!r}"
                )
            if tool.name in names:
                raise InvalidArgument(f"tools[{index}].name {tool.name!r} is given twice")
            names.add(tool.name)
            _schema(index, tool)
        choice = self.tool_choice
        if choice.mode not in TOOL_MODES:
            raise InvalidArgument(f"tool_choice.mode {choice.mode!r} is not a mode")
        if choice.mode and not self.tools:
            raise InvalidArgument("tool_choice is set but tools is empty; give the tools too")
        if choice.mode == "tool":
            if choice.tool_name not in names:
                raise InvalidArgument(
                    f"tool_choice.tool_name {choice.tool_name!r} is not one of the tools "
                    f"({', '.join(sorted(names))})"
                )
        elif choice.tool_name:
            raise InvalidArgument(
                "tool_choice.tool_name is only for TOOL_CHOICE_MODE_TOOL; leave it empty"
            )

    def prompt_chars(self) -> int:
        """Characters of the messages, earlier tool calls and tool schemas together."""
        total = 0
        for message in self.messages:
            total += len(message.content)
            total += sum(len(c.name) + len(c.arguments_json) for c in message.tool_calls)
        for tool in self.tools:
            total += len(tool.name) + len(tool.description) + len(tool.parameters_json)
        return total

    def answer_tokens(self, limits: Limits) -> int:
        return self.max_tokens or limits.default_max_tokens

    def worst_case_tokens(self, limits: Limits) -> int:
        """Tokens to reserve: one per prompt character (DeepSeek's tokenizer gives fewer for
        English and Chinese alike, so this is an upper bound) plus the answer bound."""
        return self.prompt_chars() + self.answer_tokens(limits)

    def openai_params(self, model: str, limits: Limits) -> dict[str, Any]:
        """Keyword arguments for `client.chat.completions.create` (streaming)."""
        params: dict[str, Any] = {
            "model": model,
            "messages": [_openai_message(m) for m in self.messages],
            "max_tokens": self.answer_tokens(limits),
            # Proto floats are 32-bit: 0.7 arrives as 0.699999988; send what was meant.
            "temperature": round(self.temperature, 3),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.tools:
            params["tools"] = [_openai_tool(t) for t in self.tools]
        if self.tool_choice.mode == "tool":
            params["tool_choice"] = {
                "type": "function",
                "function": {"name": self.tool_choice.tool_name},
            }
        elif self.tool_choice.mode:
            params["tool_choice"] = self.tool_choice.mode
        if self.response_format:
            params["response_format"] = {"type": self.response_format}
        return params


def check_player_id(player_id: str, *, required: bool) -> None:
    """Raises InvalidArgument unless `player_id` is 1 to 64 printable characters (or empty,
    when not required)."""
    if not player_id:
        if required:
            raise InvalidArgument("player_id is required: the player the call is metered to")
        return
    if len(player_id) > MAX_PLAYER_ID:
        raise InvalidArgument(f"player_id is longer than {MAX_PLAYER_ID} characters")
    if not player_id.isprintable():
        raise InvalidArgument("player_id must hold printable characters only")


def _check_message(index: int, message: ChatMessage) -> None:
    where = f"messages[{index}]"
    if message.role not in ROLES:
        raise InvalidArgument(
            f"{where}.role must be system, user, assistant or tool, got {message.role!r}"
        )
    if message.tool_calls and message.role != "assistant":
        raise InvalidArgument(f"{where}.tool_calls is only for assistant messages")
    if message.role == "tool" and not message.tool_call_id:
        raise InvalidArgument(f"{where}.tool_call_id is required on a tool message")
    if message.tool_call_id and message.role != "tool":
        raise InvalidArgument(f"{where}.tool_call_id is only for tool messages")
    if not message.content.strip() and not message.tool_calls:
        raise InvalidArgument(f"{where}.content is empty")
    for number, call in enumerate(message.tool_calls):
        if not call.id or not TOOL_NAME.match(call.name):
            raise InvalidArgument(
                f"{where}.tool_calls[{number}] needs the id and name the model gave it"
            )


def _schema(index: int, tool: ToolSpec) -> dict[str, Any]:
    if not tool.parameters_json.strip():
        return {"type": "object", "properties": {}}
    try:
        schema = json.loads(tool.parameters_json)
    except ValueError as exc:
        raise InvalidArgument(
            f"tools[{index}].parameters_json is not JSON ({exc}); give a JSON Schema object"
        ) from None
    if not isinstance(schema, dict):
        raise InvalidArgument(
            f"tools[{index}].parameters_json must be a JSON Schema object, like "
            '{"type": "object", "properties": {...}}'
        )
    return schema


def _openai_tool(tool: ToolSpec) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name, "parameters": _schema(0, tool)}
    if tool.description:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def _openai_message(message: ChatMessage) -> dict[str, Any]:
    if message.role == "tool":
        return {"role": "tool", "tool_call_id": message.tool_call_id, "content": message.content}
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        out["content"] = message.content or None
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments_json},
            }
            for call in message.tool_calls
        ]
    return out
