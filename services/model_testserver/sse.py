"""The chunks of a streamed chat completion, in OpenAI's `chat.completion.chunk` shape.

Pure functions: the server writes each returned dict as one server-sent event
(`data: <json>\\n\\n`), then `data: [DONE]`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["completion_chunks", "split"]


def split(text: str, size: int) -> list[str]:
    """`text` in pieces of `size` characters (at least one piece, possibly empty)."""
    if not text:
        return [""]
    return [text[i : i + size] for i in range(0, len(text), size)]


def completion_chunks(
    *,
    completion_id: str,
    created: int,
    model: str,
    content: str,
    tool_calls: Sequence[dict[str, Any]],
    finish_reason: str | None,
    usage: dict[str, Any] | None,
    chunk_chars: int,
) -> list[dict[str, Any]]:
    """Every chunk of one streamed answer.

    The first chunk names the role; content follows in `chunk_chars` pieces; each tool call
    comes as a chunk with its id and name, then its arguments in pieces; the finish reason
    rides on a last chunk with an empty delta (left out when `finish_reason` is None, which
    makes a stream that ends without one); `usage`, when given, comes on a final chunk with no
    choices, as OpenAI sends it for `stream_options.include_usage`.
    """

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "system_fingerprint": "fake-openai",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }

    chunks = [chunk({"role": "assistant", "content": ""})]
    if content:
        chunks.extend(chunk({"content": piece}) for piece in split(content, chunk_chars))
    for index, call in enumerate(tool_calls):
        function = call.get("function", {})
        head = {
            "index": index,
            "id": call.get("id", f"call_{index}"),
            "type": "function",
            "function": {"name": function.get("name", ""), "arguments": ""},
        }
        chunks.append(chunk({"tool_calls": [head]}))
        for piece in split(function.get("arguments", ""), chunk_chars):
            if piece:
                part = {"index": index, "function": {"arguments": piece}}
                chunks.append(chunk({"tool_calls": [part]}))
    if finish_reason is not None:
        chunks.append(chunk({}, finish_reason))
    if usage is not None:
        final = chunk({})
        final["choices"] = []
        final["usage"] = usage
        chunks.append(final)
    return chunks
