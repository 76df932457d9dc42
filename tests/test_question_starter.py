"""`/question` out of the box (issue 18): a fresh stack's shared knowledge holds the starter
set about the assistant (storage_service/starter_knowledge), so a player's first question
through the gateway is answered from it, with its source, in zh and en; here without a model,
so the findings are shown as found."""

from __future__ import annotations

import pathlib

from system.common.v1 import common_pb2

from tests.inprocess import card_lines, running_chain

SUCCEEDED = common_pb2.RESULT_STATUS_SUCCEEDED


async def test_a_fresh_stack_answers_questions_about_the_assistant(
    tmp_path: pathlib.Path,
) -> None:
    async with running_chain(tmp_path) as chain:
        client = await chain.steve_and_alex()
        answer = await client.chat("alex", "/question how do I buy from the shop")
        assert answer.reply.module_id == "system:question"
        assert answer.reply.result.status == SUCCEEDED, answer.reply.result
        lines = card_lines(answer)
        assert lines[0].endswith("here is what was found."), lines
        sources = [line for line in lines if line.startswith("[")]
        assert sources and all(line.endswith("(shared, system:starter)") for line in sources)
        assert any("] How buying and paying work (" in line for line in sources), lines
        # The Chinese copies of the same entries only repeat them: an English player with
        # English hits reads those alone.
        assert not any("\u4e00" <= ch <= "\u9fff" for line in sources for ch in line), sources
        # Sharing only a common word (get, work) with an entry finds nothing.
        nothing = card_lines(await client.chat("alex", "/question how do torches work"))
        assert nothing[:1] == ["The knowledge base has nothing on this."], nothing

        answer = await client.chat("steve", "/question 怎么关闭对话记录")
        assert answer.reply.result.status == SUCCEEDED, answer.reply.result
        lines = card_lines(answer)
        assert lines[0] == "当前没有可用的模型，以下是资料原文。"
        assert lines[1] == "[1] 助手会保存你的哪些信息 (共享资料, system:starter)"
        assert "关闭对话记录" in lines[2] and "/settings" in lines[2]  # it says where
        # The server itself is no word of an entry: no starter entry is on the server's rules.
        rules = card_lines(await client.chat("alex", "/question what are the server rules"))
        assert rules[:1] == ["The knowledge base has nothing on this."], rules
