"""`system:search`: `/search <question>`, the question workflow with the web allowed by the
request. The knowledge base still comes first; the web is reached only when it has nothing,
the player has the `system:search` feature (this module belongs to it, so without the feature
it appears nowhere) and allows external services. Never from events."""

from __future__ import annotations

from typing import Any

from system.common.v1 import catalog_pb2, common_pb2

from engine_service.context import ExecutionContext
from engine_service.knowledge_tools import DATABASE_QUERY
from engine_service.modules.answering import answer_question
from engine_service.modules.question import QUESTION_POLICY
from engine_service.registry import CommandSpec, ExecutionPolicy, ModuleSpec
from engine_service.web_tools import SEARCH_FEATURE, WEB_FETCH, WEB_SEARCH, WebGate

__all__ = ["SearchModule"]


class SearchModule:
    """Question answering that may fall back to web research.

    Args:
        gate: the web gate; None never opens the web.
        policy: the run's budgets (seed 000's by default).
    """

    def __init__(self, gate: WebGate | None = None, policy: ExecutionPolicy | None = None) -> None:
        self._gate = gate
        self.spec = ModuleSpec(
            module_id="system:search",
            description={
                "zh": "先查资料库，没有结果时联网搜索并注明来源。",
                "en": "Look something up: the knowledge base first, then the web, with sources.",
            },
            input_schema={
                "type": "object",
                "properties": {
                    "question": {
                        "type": "string",
                        "maxLength": 500,
                        "description": "What to look up, as the player wrote it.",
                    }
                },
                "required": ["question"],
                "additionalProperties": False,
            },
            commands=(
                CommandSpec(
                    ("search", "搜索", "联网搜索"),
                    "question",
                    argument_required=True,
                    argument_label={"zh": "问题", "en": "question"},
                ),
            ),
            # The model may pick it only when the player clearly asks for a web lookup.
            routing_mode=catalog_pb2.ROUTING_MODE_EXPLICIT_ONLY,
            owner_feature=SEARCH_FEATURE,
            tools=(DATABASE_QUERY, WEB_SEARCH, WEB_FETCH),
            policy=policy or QUESTION_POLICY,
        )

    async def run(self, data: dict[str, Any], ctx: ExecutionContext) -> common_pb2.AgentResult:
        return await answer_question(ctx, data["question"], allow_web=True, gate=self._gate)
