"""`system:question`: answers from the player's private and the shared knowledge first; the web
only as a fallback this run's gate allows (see `answering.py`).

`/question` never reaches the web. The router's model fallback may set `allow_web` when it is
very sure the player asked for an outside lookup; the flag counts only on that route, so a
button, an invoke, a cached or local match, or an event can never set it, and neither can the
text of the question ("I allow you to search the web" is a question like any other).
"""

from __future__ import annotations

from typing import Any

from system.common.v1 import catalog_pb2, common_pb2
from system.engine.v1 import engine_pb2

from engine_service.context import ExecutionContext
from engine_service.knowledge_tools import DATABASE_QUERY
from engine_service.modules.answering import answer_question
from engine_service.registry import CommandSpec, ExecutionPolicy, ModuleSpec
from engine_service.web_tools import WEB_FETCH, WEB_SEARCH, WebGate

__all__ = ["QUESTION_POLICY", "QuestionModule"]

QUESTION_POLICY = ExecutionPolicy(
    rounds=6,
    model_calls=6,
    tool_calls=9,
    steps=20,
    seconds=90.0,
    model_call_seconds=20.0,
)
"""Seed 000's budget of a whole question: knowledge search, re-check and web research share it."""

QUESTION_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "question": {
            "type": "string",
            "maxLength": 500,
            "description": "The player's question, as they wrote it.",
        },
        "allow_web": {
            "type": "boolean",
            "description": (
                "True only when the player clearly and explicitly asked, in this request, to "
                "look the answer up on the internet. Default false."
            ),
        },
    },
    "required": ["question"],
    "additionalProperties": False,
}


class QuestionModule:
    """Database-first question answering.

    Args:
        gate: the web gate; None never opens the web.
        policy: the run's budgets (seed 000's by default).
    """

    def __init__(self, gate: WebGate | None = None, policy: ExecutionPolicy | None = None) -> None:
        self._gate = gate
        self.spec = ModuleSpec(
            module_id="system:question",
            description={
                "zh": "从资料库回答问题（个人资料和共享资料），并列出来源。",
                "en": "Answer a question from the knowledge base (yours and the shared one), "
                "with its sources.",
            },
            input_schema=QUESTION_SCHEMA,
            commands=(
                CommandSpec(
                    ("question", "ask", "问答", "提问"),
                    "question",
                    argument_required=True,
                    argument_label={"zh": "问题", "en": "question"},
                ),
            ),
            routing_mode=catalog_pb2.ROUTING_MODE_HINTS,
            tools=(DATABASE_QUERY,),
            optional_tools=(WEB_SEARCH, WEB_FETCH),
            policy=policy or QUESTION_POLICY,
            # Without a model, a question gets the knowledge search on its selection card.
            question_field="question",
        )

    async def run(self, data: dict[str, Any], ctx: ExecutionContext) -> common_pb2.AgentResult:
        # Only the model route may carry the player's explicit wish for an outside lookup.
        allow_web = bool(data.get("allow_web")) and ctx.source == engine_pb2.ROUTE_SOURCE_MODEL
        return await answer_question(ctx, data["question"], allow_web=allow_web, gate=self._gate)
