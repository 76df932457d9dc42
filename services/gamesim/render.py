"""Cards and responses as readable text, the way a chat window would show them."""

from __future__ import annotations

from system.common.v1 import common_pb2
from system.gateway.v1 import gateway_pb2

__all__ = ["render_card", "render_response"]

_STATUS = {
    common_pb2.RESULT_STATUS_FAILED: "failed",
    common_pb2.RESULT_STATUS_PARTIALLY_SUCCEEDED: "partly done",
}


def render_card(card: common_pb2.Card) -> str:
    lines = [f"┌─ {card.title}"]
    lines += [f"│ {line.text}" for line in card.lines]
    if card.buttons:
        numbered = "  ".join(f"[{i}] {b.label}" for i, b in enumerate(card.buttons, 1))
        lines.append(f"│ {numbered}")
    lines.append("└─")
    return "\n".join(lines)


def render_result(result: common_pb2.AgentResult) -> str:
    text = render_card(result.card) if result.HasField("card") else result.text
    status = _STATUS.get(result.status)
    if status and result.failure.key:
        text += f"\n({status}: {result.failure.key})"
    return text


def render_response(response: gateway_pb2.PlayerResponse) -> str:
    """A PlayerResponse as text."""
    kind = response.WhichOneof("body")
    if kind == "reply":
        return render_result(response.reply.result)
    if kind == "notice":
        return render_result(response.notice.result)
    if kind == "state":
        s = response.state
        return (
            f"state: {'busy' if s.busy else 'idle'}, history {'on' if s.history_enabled else 'off'}, "
            f"external services {'on' if s.external_enabled else 'off'}"
        )
    if kind == "history":
        if not response.history.entries:
            return "(no history)"
        names = {
            common_pb2.HISTORY_ROLE_PLAYER: "you",
            common_pb2.HISTORY_ROLE_ASSISTANT: "assistant",
        }
        return "\n".join(
            f"{names.get(e.role, '?')}: {e.text.splitlines()[0] if e.text else ''}"
            for e in response.history.entries
        )
    if kind == "open":
        return f"(open view {gateway_pb2.Navigation.Name(response.open.navigation)})"
    if kind == "binding":
        return f"(binding {gateway_pb2.BindingChange.Name(response.binding.change)})"
    return "(empty response)"
