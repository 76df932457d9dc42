"""The knowledge base managed in game (issue 18): `/system knowledge-add FILE [player]`
(添加知识), `/system knowledge [player]` (知识库) and `/system knowledge-remove ENTRY [player]`
(删除知识) end to end through the gateway, router, engine and storage, in zh and en, with the
refusal for an ordinary player; and knowledge search preferring entries in the asking player's
language, in the store and through `/question`."""

from __future__ import annotations

import pathlib

import pytest
from sqlalchemy.orm import Session, sessionmaker
from system.common.v1 import common_pb2

from engine_service.knowledge_tools import knowledge_language
from services.runtime.errors import InvalidArgument
from storage_service.knowledge import KnowledgeStore
from tests.inprocess import running_chain

SUCCEEDED = common_pb2.RESULT_STATUS_SUCCEEDED
INVALID = "system.error.invalid_input"


def card_lines(result: common_pb2.AgentResult) -> list[str]:
    return [line.text for line in result.card.lines]


@pytest.mark.parametrize("use_index", [None, False])
def test_search_puts_the_players_language_first_then_the_best(
    sessions: sessionmaker[Session], use_index: bool | None
) -> None:
    store = KnowledgeStore(sessions, use_index=use_index)
    # The English entry matches "spawn shop" better; the Chinese one names it once.
    store.put("", "rules-en", "Spawn rules", "The spawn shop sells bread. Spawn is safe.", "en")
    store.put("", "rules-zh", "出生点规则", "出生点附近禁止破坏。spawn 附近有商店。", "zh")
    store.put("", "other-en", "Mining", "Dig deep for diamonds.", "en")

    def ids(language: str) -> list[str]:
        return [h.entry.entry_id for h in store.search("", "spawn shop", language=language)]

    assert ids("") == ["rules-en", "rules-zh"]  # no preference: best first
    assert ids("en") == ["rules-en", "rules-zh"]
    assert ids("zh") == ["rules-zh", "rules-en"]  # the weaker match, in the player's language
    with pytest.raises(InvalidArgument, match="language must be zh, en or empty, got 'fr'"):
        store.search("", "spawn", language="fr")


def test_a_players_language_code_becomes_a_knowledge_language() -> None:
    assert [knowledge_language(c) for c in ("zh", "zh_CN", "en-US", "EN", "fr", "")] == [
        "zh",
        "zh",
        "en",
        "en",
        "",
        "",
    ]


async def test_admins_add_list_and_remove_knowledge_in_game_and_players_cannot(
    tmp_path: pathlib.Path,
) -> None:
    folder = tmp_path / "knowledge"
    folder.mkdir()
    (folder / "rules.md").write_text(
        "# Server rules\nNo griefing near spawn. Build at least 100 blocks away.\n",
        encoding="utf-8",
    )
    (folder / "笔记.txt").write_text("史蒂夫的秘密基地在沙漠神殿下面。\n", encoding="utf-8")
    (folder / "secret.json").write_text("{}", encoding="utf-8")
    (folder / "huge.txt").write_text("word " * 5000, encoding="utf-8")  # 25 000 characters
    (tmp_path / "outside.md").write_text("# Outside\nNot in the folder.\n", encoding="utf-8")
    async with running_chain(
        tmp_path, credentials=True, engine_settings={"knowledge_dir": str(folder)}
    ) as chain:
        client = await chain.client()
        await client.join("op", "Op", "en_us", permission_level=3)
        await client.join("zhop", "Zhop", "zh_cn", permission_level=4)
        await client.join("steve", "Steve", "zh_cn")
        await client.join("alex", "Alex", "en_us")

        # An ordinary player has none of the commands, and adds nothing.
        for text in ("/system knowledge-add rules.md", "/system knowledge", "/system 删除知识 x"):
            refused = (await client.chat("alex", text)).reply.result
            assert refused.failure.key == "system.error.unknown_command", text
        helped = card_lines((await client.chat("alex", "/help")).reply.result)
        assert not any(line.startswith("/knowledge") for line in helped)
        assert any(line.startswith("/question") for line in helped)
        admins = card_lines((await client.chat("op", "/help")).reply.result)
        assert any(line.startswith("/knowledge-add ") for line in admins)
        nothing = (await client.chat("alex", "/question griefing")).reply.result
        assert not any("Server rules" in line for line in card_lines(nothing))

        added = (await client.chat("op", "/system knowledge-add rules.md")).reply.result
        assert added.status == SUCCEEDED and added.card.title == "Knowledge added"
        assert card_lines(added) == ["rules (en) in the shared knowledge: Server rules"]
        again = (await client.chat("op", "/system knowledge-add rules.md")).reply.result
        assert again.card.title == "Knowledge replaced"
        private = (await client.chat("zhop", "/system 添加知识 笔记.txt steve")).reply.result
        assert private.status == SUCCEEDED and private.card.title == "已添加知识"
        assert card_lines(private) == ["笔记（zh）已存入steve 的私人知识库：笔记"]

        shared = (await client.chat("op", "/system knowledge")).reply.result
        assert shared.card.title == "Knowledge entries: the shared knowledge"
        assert "rules (en) Server rules" in card_lines(shared)
        assert not any("笔记" in line for line in card_lines(shared))
        steves = (await client.chat("zhop", "/system 知识库 steve")).reply.result
        assert steves.card.title == "知识条目：steve 的私人知识库"
        assert card_lines(steves) == ["笔记（zh）笔记"]

        # What was added is what /question reads: the shared entry for everyone, the private
        # one for its owner alone.
        found = (await client.chat("alex", "/question griefing near spawn")).reply.result
        assert any(
            line.startswith("[1] Server rules (shared, rules.md)") for line in card_lines(found)
        )
        mine = (await client.chat("steve", "/question 秘密基地在哪里")).reply.result
        assert any("笔记.txt" in line for line in card_lines(mine)), card_lines(mine)
        theirs = (await client.chat("alex", "/question 秘密基地在哪里")).reply.result
        assert not any("笔记.txt" in line for line in card_lines(theirs))

        # Refusals that say what to do; nothing outside the folder is ever read.
        for text, expected in (
            ("/system knowledge-add ../outside.md", "by its file name alone"),
            ("/system knowledge-add secret.json", "Markdown or plain-text file"),
            ("/system knowledge-add missing.md", "files there: huge.txt, rules.md, 笔记.txt"),
            ("/system knowledge-add huge.txt", "the limit is 20000"),
            ("/system knowledge-add rules.md steve extra", "Usage: /system knowledge-add"),
            ("/system knowledge-add rules.md a/b", "is not a player id"),
        ):
            bad = (await client.chat("op", text)).reply.result
            assert bad.failure.key == INVALID, text
            assert expected in bad.failure.message, (text, bad.failure.message)

        removed = (await client.chat("op", "/system knowledge-remove rules")).reply.result
        assert removed.status == SUCCEEDED and removed.card.title == "Knowledge removed"
        assert card_lines(removed) == ["rules removed from the shared knowledge"]
        twice = (await client.chat("op", "/system knowledge-remove rules")).reply.result
        assert (
            twice.failure.key == INVALID and "no knowledge entry 'rules'" in twice.failure.message
        )
        gone = (await client.chat("op", "/system knowledge")).reply.result
        assert "rules (en) Server rules" not in card_lines(gone)
        cleared = (await client.chat("zhop", "/system 删除知识 笔记 steve")).reply.result
        assert card_lines(cleared) == ["已从steve 的私人知识库删除 笔记"]


async def test_question_answers_from_the_entry_in_the_players_language_first(
    tmp_path: pathlib.Path,
) -> None:
    folder = tmp_path / "knowledge"
    folder.mkdir()
    (folder / "rules.md").write_text(
        "# Spawn rules\nThe spawn is safe: no griefing near spawn.\n", encoding="utf-8"
    )
    (folder / "规则.md").write_text(
        "# 出生点规则\n出生点（spawn）附近禁止破坏。\n", encoding="utf-8"
    )
    async with running_chain(tmp_path, engine_settings={"knowledge_dir": str(folder)}) as chain:
        client = await chain.steve_and_alex()  # steve plays in zh, alex in en
        await client.join("op", "Op", "en_us", permission_level=3)
        for name in ("rules.md", "规则.md"):
            done = (await client.chat("op", f"/system knowledge-add {name}")).reply.result
            assert done.status == SUCCEEDED, card_lines(done)

        def sources(result: common_pb2.AgentResult) -> list[str]:
            return [line for line in card_lines(result) if line.startswith("[")]

        zh = sources((await client.chat("steve", "/question spawn griefing")).reply.result)
        en = sources((await client.chat("alex", "/question spawn griefing")).reply.result)
        assert zh[0].startswith("[1] 出生点规则 (") and "规则.md" in zh[0], zh
        assert en[0].startswith("[1] Spawn rules (") and "rules.md" in en[0], en
