"""Router tests: exact command matching over the engine's real catalogue, the pipeline's input
checks, the catalogue cache, and the router servicer in-process in front of a real engine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from google.protobuf import json_format
from hypothesis import given, settings
from hypothesis import strategies as st
from system.common.v1 import catalog_pb2, common_pb2
from system.engine.v1 import engine_pb2
from system.router.v1 import router_pb2, router_pb2_grpc

from engine_service.app import build_registry
from engine_service.app import create_app as create_engine
from engine_service.config import EngineConfig
from router_service.app import RouterApp
from router_service.app import create_app as create_router
from router_service.buttons import ButtonMatcher, load_phrasings
from router_service.cache import IntentCache
from router_service.catalog import CatalogCache
from router_service.commands import CommandIndex, CommandMatch, UnknownCommand
from router_service.config import RouterConfig
from router_service.diagnostics import RouterDiagnostics
from router_service.model_routing import ModelChoice
from router_service.router import Router
from router_service.semantic import Mode, SemanticConfig
from router_service.semantic.extractors import list_pick
from services.runtime.errors import InvalidArgument, PermissionDenied, Unavailable

HOST = {"port": 0, "metrics_port": -1, "drain_seconds": 0, "grace_seconds": 1}
UNUSED = "127.0.0.1:1"  # nothing listens on port 1: connections are refused at once


def _descriptor(
    module_id: str,
    aliases: tuple[str, ...],
    kind: int = catalog_pb2.ARGUMENT_KIND_UNSPECIFIED,
    argument: str = "",
    **fields: Any,
) -> catalog_pb2.ModuleDescriptor:
    return catalog_pb2.ModuleDescriptor(
        module_id=module_id,
        description=catalog_pb2.LocalizedText(text={"en": module_id}),
        input_schema='{"type": "object"}',
        commands=[
            catalog_pb2.CommandDeclaration(
                aliases=list(aliases),
                argument_kind=kind,
                argument_name=argument,
                argument_field=argument,
            )
        ],
        **fields,
    )


EXTRA = [
    _descriptor(
        "test:search", ("search", "搜索"), catalog_pb2.ARGUMENT_KIND_REQUIRED_TEXT, "query"
    ),
    _descriptor("test:note", ("note",), catalog_pb2.ARGUMENT_KIND_OPTIONAL_TEXT, "text"),
    _descriptor("test:ban", ("ban",), min_permission_level=2),
    _descriptor("ftbquests:quests", ("quests", "任务"), owner_feature="ftbquests"),
]


# The question modules' commands (/question, /search, /reason) are left out: `test:search`
# stands in for /search here with a shape these tests pin down.
_QUESTION_MODULES = ("system:question", "system:search", "system:reasoning")
# The real quest modules are left out too: `ftbquests:quests` stands in for them here.
_QUEST_MODULES = ("system:quests", "system:quest_detail", "system:quest_claim")


def _catalog() -> list[catalog_pb2.ModuleDescriptor]:
    core = [
        d
        for d in build_registry(EngineConfig()).descriptors(None)
        if d.module_id not in (*_QUESTION_MODULES, *_QUEST_MODULES)
    ]
    return [*core, *EXTRA]


INDEX = CommandIndex(_catalog(), "gen-1")


def _player(
    level: int = 0, features: tuple[str, ...] = (), player_id: str = "p-1"
) -> common_pb2.PlayerContext:
    return common_pb2.PlayerContext(
        server_id="s", player_id=player_id, language="en", permission_level=level, features=features
    )


PLAYER = _player()


def _match(text: str, player: common_pb2.PlayerContext = PLAYER) -> CommandMatch:
    result = INDEX.match(text, player)
    assert isinstance(result, CommandMatch), f"{text!r} gave {result!r}"
    return result


def _input(match: CommandMatch) -> dict[str, Any]:
    return json_format.MessageToDict(match.action.input)


def _invalid(text: str, player: common_pb2.PlayerContext = PLAYER) -> str:
    with pytest.raises(InvalidArgument) as info:
        INDEX.match(text, player)
    return info.value.message


# --- CommandIndex ----------------------------------------------------------------------------


def test_index_is_built_from_the_real_catalogue() -> None:
    assert INDEX.generation == "gen-1"
    # help ×3, history ×3, inventory ×3, profile ×4, item ×3, mail ×5, mailclaim ×2, shop ×4,
    # buy ×2, pay ×3, signin ×3, search ×2, note, ban, quests ×2, routing ×2, reload ×2,
    # usage ×2, grant ×2, revoke ×2, reset ×2, search-on ×2, search-off ×2, settings ×2, chat ×2,
    # spend ×2, knowledge-add ×2, knowledge ×2, knowledge-remove ×2
    assert (
        len(INDEX)
        == 6
        + 2
        + 3
        + 3
        + 3
        + 4
        + 3
        + 5
        + 2
        + 4
        + 2
        + 3
        + 3
        + 2
        + 1
        + 1
        + 2
        + 2
        + 2
        + 2
        + 2
        + 2
        + 2
        + 2
        + 2
        + 2
        + 2
    )


@pytest.mark.parametrize(
    "text",
    [
        "帮助",
        "help",
        "HELP",
        "Help",
        "?",
        "/help",
        "/Help",
        "/HELP",
        "/帮助",
        "/?",
        "/system help",
        "/SYSTEM help",
        "/system /help",
        "/system 帮助",
        "  help  ",
        "\thelp\n",
        "  /help  ",
    ],
)
def test_help_aliases_reach_system_help_with_empty_input(text: str) -> None:
    match = _match(text)
    assert match.action.module_id == "system:help"
    assert _input(match) == {}


@pytest.mark.parametrize(
    ("text", "topic"),
    [
        ("/help history", "history"),
        ("/help HiStOrY", "HiStOrY"),
        ("/HELP History", "History"),
        ("/帮助 历史", "历史"),
        ("/帮助 钻石 怎么  找", "钻石 怎么  找"),  # inner spacing kept as typed
        ("/system help history", "history"),
        ("/help    history   ", "history"),
        ("/帮助\u3000历史", "历史"),  # the full-width space of CJK input methods separates too
    ],
)
def test_explicit_argument_is_kept_as_typed(text: str, topic: str) -> None:
    match = _match(text)
    assert match.action.module_id == "system:help"
    assert _input(match) == {"topic": topic}


@pytest.mark.parametrize(
    "text",
    [
        "help me find diamonds",
        "帮助 我 找钻石",
        "history please",
        "search diamonds",
        "note buy bread",
        "where are the diamonds",
        "helpme",
        "nonsense",
    ],
)
def test_plain_text_that_is_not_exactly_a_command_goes_on(text: str) -> None:
    assert INDEX.match(text, PLAYER) is None


@pytest.mark.parametrize(
    ("text", "query"),
    [
        ("查询物品 钻石", "钻石"),
        ("查询物品 minecraft:diamond", "minecraft:diamond"),
        ("物品\u3000Iron Ingot", "Iron Ingot"),  # the argument kept as typed
        ("  查询物品   钻石块  ", "钻石块"),
    ],
)
def test_slash_less_chinese_alias_with_an_argument_is_the_command(text: str, query: str) -> None:
    """Issue 15: `查询物品 钻石` reaches system:item as `/item 钻石` does."""
    match = _match(text)
    assert match == _match(f"/item {query}")
    assert match.action.module_id == "system:item"
    assert _input(match) == {"query": query}
    assert _input(_match("搜索 钻石矿")) == {"query": "钻石矿"}


@pytest.mark.parametrize(
    "text",
    [
        "item frames are cool",  # a Latin alias starts ordinary sentences
        "item minecraft:diamond",
        "search for a village",
        "查询物品",  # the whole text, but the argument is required
        "查询物品钻石",  # no separator: not the alias followed by an argument
        "帮助 我 找钻石",  # an optional argument: a sentence
        "领取邮件 3",  # a write still needs its slash or a button
    ],
)
def test_slash_less_alias_does_not_capture_sentences_or_writes(text: str) -> None:
    assert INDEX.match(text, PLAYER) is None


def test_history_aliases() -> None:
    for text in ("history", "HISTORY", "历史", "对话记录", "/history", "/system 对话记录"):
        match = _match(text)
        assert match.action.module_id == "system:history"
        assert _input(match) == {}


@pytest.mark.parametrize(
    ("text", "name"),
    [
        ("/nonsense", "nonsense"),
        ("/NonSense now", "NonSense"),
        ("/system nonsense", "nonsense"),
        ("/", ""),
        ("/ help", ""),
        ("//help", "/help"),
        ("/helpme", "helpme"),
    ],
)
def test_unknown_slash_command_is_reported_not_routed(text: str, name: str) -> None:
    assert INDEX.match(text, PLAYER) == UnknownCommand(name)


@pytest.mark.parametrize("text", ["/system", "/SYSTEM", "  /system   ", "/system\u3000"])
def test_system_prefix_alone_is_an_input_error(text: str) -> None:
    assert "/system needs an instruction" in _invalid(text)


@pytest.mark.parametrize("text", ["/history extra", "/system history extra", "/历史 全部"])
def test_literal_with_argument_is_an_input_error_with_usage(text: str) -> None:
    message = _invalid(text)
    assert "takes no argument" in message
    assert "write /" in message


def test_literal_usage_names_the_alias_typed() -> None:
    assert _invalid("/HISTORY extra") == "/HISTORY takes no argument; write /HISTORY"


def test_command_messages_and_usage_are_in_the_players_language() -> None:
    chinese = common_pb2.PlayerContext(server_id="s", player_id="p-zh", language="zh")
    assert _invalid("/history extra", chinese) == "/history 不带参数；请写 /history"
    assert _invalid("/system", chinese) == "/system 后面需要一条指令，例如 /system help"
    labelled = catalog_pb2.CommandDeclaration(
        aliases=["buy"],
        argument_kind=catalog_pb2.ARGUMENT_KIND_REQUIRED_TEXT,
        argument_name="item [count]",
        argument_field="item",
        argument_label=catalog_pb2.LocalizedText(text={"zh": "物品 [数量]"}),
    )
    index = CommandIndex(
        [
            catalog_pb2.ModuleDescriptor(
                module_id="system:shop_buy",
                description=catalog_pb2.LocalizedText(text={"en": "buy"}),
                input_schema='{"type": "object"}',
                commands=[labelled],
            )
        ],
        "gen-labels",
    )
    for player, expected in (
        (chinese, "/buy 需要参数；请写 /buy <物品 [数量]>"),
        (PLAYER, "/buy needs an argument; write /buy <item [count]>"),  # no `en` label: the name
    ):
        with pytest.raises(InvalidArgument) as info:
            index.match("/buy", player)
        assert info.value.message == expected


@pytest.mark.parametrize("text", ["/search", "/SEARCH  ", "/system search", "/搜索"])
def test_required_argument_missing_is_an_input_error_with_usage(text: str) -> None:
    message = _invalid(text)
    assert "needs an argument" in message
    assert "<query>" in message


def test_required_argument_missing_in_plain_text_goes_on() -> None:
    assert INDEX.match("search", PLAYER) is None
    assert INDEX.match("搜索", PLAYER) is None


def test_required_and_optional_arguments() -> None:
    match = _match("/search Diamond Ore")
    assert match.action.module_id == "test:search"
    assert _input(match) == {"query": "Diamond Ore"}
    assert _input(_match("/搜索 钻石矿")) == {"query": "钻石矿"}
    assert _input(_match("/note")) == {}
    assert _input(_match("note")) == {}
    assert _input(_match("/note Buy bread, 3×")) == {"text": "Buy bread, 3×"}


def test_module_above_the_players_permission_behaves_as_unknown() -> None:
    assert INDEX.match("/ban", _player(level=0)) == UnknownCommand("ban")
    assert INDEX.match("/ban", _player(level=1)) == UnknownCommand("ban")
    assert INDEX.match("ban", _player(level=0)) is None
    assert _match("/ban", _player(level=2)).action.module_id == "test:ban"
    assert _match("BAN", _player(level=4)).action.module_id == "test:ban"


def test_module_of_a_missing_feature_behaves_as_unknown() -> None:
    assert INDEX.match("/quests", _player()) == UnknownCommand("quests")
    assert INDEX.match("/任务", _player(features=("other",))) == UnknownCommand("任务")
    assert INDEX.match("quests", _player()) is None
    assert INDEX.match("任务", _player()) is None
    with_feature = _player(features=("ftbquests",))
    assert _match("/quests", with_feature).action.module_id == "ftbquests:quests"
    assert _match("任务", with_feature).action.module_id == "ftbquests:quests"


def test_unavailable_module_with_bad_argument_is_still_unknown_not_an_input_error() -> None:
    # An input error would reveal that the command exists.
    assert INDEX.match("/ban now", _player(level=0)) == UnknownCommand("ban")


_WORDS = st.sampled_from(
    [
        "help",
        "HELP",
        "帮助",
        "?",
        "history",
        "历史",
        "search",
        "搜索",
        "note",
        "ban",
        "quests",
        "任务",
        "system",
        "nonsense",
        "",
    ]
)
_TEXT = st.one_of(
    st.text(max_size=60),
    st.builds(
        lambda slash, system, word, sep, rest: f"{slash}{system}{word}{sep}{rest}",
        st.sampled_from(["", "/", "//", " /", "／"]),
        st.sampled_from(["", "system ", "/system ", "SYSTEM\u3000"]),
        _WORDS,
        st.sampled_from(["", " ", "  ", "\t", "\u3000"]),
        st.text(max_size=20),
    ),
)
_PLAYERS = st.builds(
    lambda level, features: _player(level=level, features=tuple(features)),
    st.integers(min_value=0, max_value=4),
    st.lists(st.sampled_from(["ftbquests", "other"]), max_size=2),
)


@settings(max_examples=400, deadline=None)
@given(text=_TEXT, player=_PLAYERS)
def test_match_returns_a_decision_or_an_input_error_for_any_text(
    text: str, player: common_pb2.PlayerContext
) -> None:
    try:
        result = INDEX.match(text, player)
    except InvalidArgument as exc:
        assert text.strip().startswith("/"), "only explicit commands are input errors"
        assert exc.message
        return
    assert result is None or isinstance(result, CommandMatch | UnknownCommand)
    if isinstance(result, UnknownCommand):
        assert text.strip().startswith("/"), "plain text never is an unknown command"
    if isinstance(result, CommandMatch):
        by_id = {m.module_id: m for m in _catalog()}
        module = by_id[result.action.module_id]
        assert player.permission_level >= module.min_permission_level
        assert module.owner_feature in ("", "system:core", *player.features)
        for value in _input(result).values():
            assert value and value in text  # the argument is a substring of what was typed


# --- CatalogCache ----------------------------------------------------------------------------


class FakeEngine:
    """Test double of the engine stub: answers GetCatalog from a script of responses/errors."""

    def __init__(self, *script: engine_pb2.GetCatalogResponse | Exception) -> None:
        self.script = list(script)
        self.calls: list[float | None] = []

    async def GetCatalog(self, request: engine_pb2.GetCatalogRequest, timeout: float | None = None):  # noqa: N802
        self.calls.append(timeout)
        step = self.script.pop(0)
        if isinstance(step, Exception):
            raise step
        return step


def _response(generation: str, modules: list[catalog_pb2.ModuleDescriptor] | None = None):
    return engine_pb2.GetCatalogResponse(generation=generation, modules=modules or _catalog())


def _semantic(**overrides: Any) -> SemanticConfig:
    return SemanticConfig(**overrides)


async def test_cache_without_any_catalogue_is_unavailable() -> None:
    cache = CatalogCache(FakeEngine(ConnectionError("refused")), 30, _semantic())  # type: ignore[arg-type]
    with pytest.raises(Unavailable) as info:
        await cache.get()
    assert "catalogue could not be read" in info.value.message
    assert "refused" in info.value.message


async def test_cache_reads_once_then_serves_until_refresh_is_due() -> None:
    engine = FakeEngine(_response("g1"))
    cache = CatalogCache(engine, 30, _semantic())  # type: ignore[arg-type]
    first = await cache.get()
    assert first.generation == "g1"
    assert await cache.get() is first
    assert len(engine.calls) == 1
    assert engine.calls[0] is not None  # always a bounded call


async def test_cache_keeps_the_old_catalogue_when_a_refresh_fails() -> None:
    engine = FakeEngine(
        _response("g1"),
        ConnectionError("engine down"),
        _response("g1"),
        _response("g2", EXTRA),
    )
    cache = CatalogCache(engine, 0, _semantic())  # type: ignore[arg-type]  # refresh every time
    first = await cache.get()
    assert (await cache.get()) is first  # refresh failed: still serving g1
    assert (await cache.get()) is first  # same generation: nothing is rebuilt
    second = await cache.get()
    assert second.generation == "g2"
    assert len(second.commands) == len(CommandIndex(EXTRA, "x"))
    assert len(engine.calls) == 4


async def test_cache_retries_after_a_first_failure() -> None:
    cache = CatalogCache(FakeEngine(ConnectionError("x"), _response("g1")), 30, _semantic())  # type: ignore[arg-type]
    with pytest.raises(Unavailable):
        await cache.get()
    assert (await cache.get()).generation == "g1"


# --- Router ----------------------------------------------------------------------------------


class FakeModel:
    """Test double of ModelRouter (the router's seam to the model gateway): scripted choices."""

    def __init__(self, *choices: ModelChoice | None) -> None:
        self.choices = list(choices)
        self.asked: list[str] = []

    async def choose(self, player: Any, text: str, modules: Any) -> ModelChoice | None:
        self.asked.append(text)
        return self.choices.pop(0) if self.choices else None


def _registry_response() -> engine_pb2.GetCatalogResponse:
    registry = build_registry(EngineConfig())
    return engine_pb2.GetCatalogResponse(
        generation=registry.generation,
        modules=registry.descriptors(None),
        reject_profiles=registry.reject_profiles(),
    )


def _router(model: FakeModel | None = None, **semantic: Any) -> Router:
    cache = CatalogCache(FakeEngine(_registry_response()), 30, _semantic(**semantic))  # type: ignore[arg-type]
    return Router(cache, IntentCache(), ButtonMatcher(load_phrasings()), RouterDiagnostics(), model)  # type: ignore[arg-type]


def _route(
    text: str, player: common_pb2.PlayerContext = PLAYER, **extra: Any
) -> router_pb2.RouteRequest:
    return router_pb2.RouteRequest(player=player, text=text, **extra)


async def test_an_unknown_command_is_named_in_the_players_language() -> None:
    chinese = common_pb2.PlayerContext(server_id="s", player_id="p-zh", language="zh")
    decision = await _router().route(_route("/nonsense", chinese))
    assert decision.no_route_reason == router_pb2.NO_ROUTE_REASON_UNKNOWN_COMMAND
    assert decision.detail == "/nonsense 不是指令；输入 /help 查看全部指令"
    english = await _router().route(_route("/nonsense"))
    assert english.detail == "/nonsense is not a command; /help lists the commands"


@pytest.mark.parametrize("text", ["", "   ", "\n\t"])
async def test_route_refuses_empty_text(text: str) -> None:
    with pytest.raises(InvalidArgument, match="text is empty"):
        await _router().route(_route(text))


async def test_route_refuses_text_over_max_characters_naming_the_limit() -> None:
    router = _router(max_characters=20)
    await router.route(_route("帮" * 20))  # exactly the limit is fine (characters, not bytes)
    with pytest.raises(InvalidArgument) as info:
        await router.route(_route("x" * 21))
    assert "at most 20" in info.value.message and "21 characters" in info.value.message


async def test_route_requires_a_player_id() -> None:
    with pytest.raises(InvalidArgument, match="player_id"):
        await _router().route(_route("help", _player(player_id="")))


async def test_commands_and_unknown_commands_come_first() -> None:
    router = _router()
    command = await router.route(_route("/help history"))
    assert command.source == router_pb2.DECISION_SOURCE_COMMAND
    unknown = await router.route(_route("/nonsense"))
    assert unknown.no_route_reason == router_pb2.NO_ROUTE_REASON_UNKNOWN_COMMAND


async def test_a_confident_paraphrase_routes_locally_and_reports_what_it_saw() -> None:
    decision = await _router().route(_route("show me the commands"))
    assert decision.source == router_pb2.DECISION_SOURCE_LOCAL
    assert decision.action.module_id == "system:help"
    assert decision.local.gate_failed == ""
    assert decision.local.candidates[0].module_id == "system:help"


async def test_a_text_is_matched_in_its_own_language_not_the_clients() -> None:
    """A Chinese client's player typing English is matched against the English examples."""
    chinese = common_pb2.PlayerContext(server_id="s", player_id="p-zh", language="zh")
    for text in ("recent conversation", "what did we talk about"):
        decision = await _router().route(_route(text, chinese))
        assert decision.source == router_pb2.DECISION_SOURCE_LOCAL, text
        assert decision.action.module_id == "system:history"


async def test_guarded_text_never_routes_locally_and_names_the_gate() -> None:
    decision = await _router().route(_route("don't show me the commands"))
    assert decision.source != router_pb2.DECISION_SOURCE_LOCAL
    assert decision.local.gate_failed.startswith("guard:")


async def test_shadow_mode_counts_but_never_routes_locally() -> None:
    router = _router(mode=Mode.SHADOW)
    decision = await router.route(_route("show me the commands"))
    assert decision.source != router_pb2.DECISION_SOURCE_LOCAL
    assert router.diagnostics.counts()["SHADOW_DIRECT"] == 1


async def test_a_number_picks_from_the_current_list() -> None:
    items = [common_pb2.ModuleAction(module_id=m) for m in ("system:help", "system:history")]
    decision = await _router().route(_route("查看 2", current_list=items))
    assert decision.source == router_pb2.DECISION_SOURCE_BUTTON
    assert decision.action.module_id == "system:history"
    beyond = await _router().route(_route("查看 3", current_list=items))
    assert beyond.source != router_pb2.DECISION_SOURCE_BUTTON
    # `/view 2` picks too; a slash command no module declares is unknown, number or not.
    viewed = await _router().route(_route("/view 2", current_list=items))
    assert viewed.action.module_id == "system:history"
    unknown = await _router().route(_route("/quest 1", current_list=items))
    assert unknown.source == router_pb2.DECISION_SOURCE_NONE
    assert unknown.no_route_reason == router_pb2.NO_ROUTE_REASON_UNKNOWN_COMMAND


@pytest.mark.parametrize(
    ("text", "index"),
    [
        ("2", 2),
        ("查看 2", 2),
        ("/查看 2", 2),
        ("第二个", 2),
        ("我要第二个吧", 2),
        ("看看3号", 3),
        ("the second one", 2),
        ("pick the 2nd", 2),
        ("show me 3", 3),
        ("#3", 3),
        ("3 please", 3),
        # A text that says more than a number asks for something of its own.
        ("buy 3 bread", None),
        ("give me 5 diamonds", None),
        ("show quest 2", None),
        ("pay alex 10", None),
        ("买 3 个面包", None),
        ("第2页", None),  # a page, not an entry
        ("what is 2 plus 2", None),
    ],
)
def test_only_a_text_that_only_picks_picks_from_the_list(text: str, index: int | None) -> None:
    assert list_pick(text) == index


async def test_a_request_with_a_number_is_not_a_pick_from_the_shown_list() -> None:
    """`buy 3 bread` while the shop's list is shown buys bread; it does not open entry 3."""
    items = [common_pb2.ModuleAction(module_id=f"test:m{i}") for i in range(1, 11)]
    for text in ("buy 3 bread", "give me 5 diamonds"):
        decision = await _router().route(_route(text, current_list=items))
        assert decision.source != router_pb2.DECISION_SOURCE_BUTTON, text


async def test_a_notification_button_can_be_pressed_by_its_label() -> None:
    button = router_pb2.NotificationButton(
        action=common_pb2.ModuleAction(module_id="system:history"),
        label_key="x.open",
        label="打开记录",
    )
    decision = await _router().route(_route("打开记录", notification_buttons=[button]))
    assert decision.source == router_pb2.DECISION_SOURCE_BUTTON
    assert decision.action.module_id == "system:history"
    assert decision.notification_button == 1
    # A button that runs no module (a settings toggle) comes back by its position alone.
    toggle = router_pb2.NotificationButton(label="关闭对话记录")
    decision = await _router().route(_route("关闭对话记录", notification_buttons=[button, toggle]))
    assert decision.source == router_pb2.DECISION_SOURCE_BUTTON
    assert (decision.action.module_id, decision.notification_button) == ("", 2)
    # A number from the current list is no notification button.
    picked = await _router().route(
        _route("2", current_list=[common_pb2.ModuleAction(), button.action])
    )
    assert (picked.action.module_id, picked.notification_button) == ("system:history", 0)


async def test_model_choice_is_cached_per_player_after_success() -> None:
    model = FakeModel(ModelChoice("system:history", {}), ModelChoice("system:history", {}))
    router = _router(model)
    text = "remind me what we said"
    first = await router.route(_route(text, external_enabled=True))
    assert first.source == router_pb2.DECISION_SOURCE_MODEL and first.cache_token
    cached, reason = await router.record_outcome(
        router_pb2.RecordOutcomeRequest(
            player=PLAYER, text=text, action=first.action, cache_token=first.cache_token
        )
    )
    assert cached, reason
    again = await router.route(_route(text, external_enabled=True))
    assert again.source == router_pb2.DECISION_SOURCE_CACHE
    assert again.action.module_id == "system:history"
    other = await router.route(
        _route(text, _player(player_id="someone-else"), external_enabled=True)
    )
    assert other.source == router_pb2.DECISION_SOURCE_MODEL  # players never share entries
    router.clear_player(PLAYER.player_id, router_pb2.CLEAR_REASON_MEMORY_CLEARED, PLAYER.server_id)
    cleared = await router.route(_route(text, external_enabled=True))
    assert cleared.source != router_pb2.DECISION_SOURCE_CACHE


async def test_no_model_call_when_the_player_turned_external_ai_off() -> None:
    model = FakeModel(ModelChoice("system:history", {}))
    decision = await _router(model).route(_route("remind me what we said", external_enabled=False))
    assert model.asked == []
    assert decision.source in (
        router_pb2.DECISION_SOURCE_LOCAL_FALLBACK,
        router_pb2.DECISION_SOURCE_NONE,
    )


async def test_low_confidence_without_a_model_offers_read_only_choices() -> None:
    decision = await _router().route(_route("um what now"))
    assert decision.source == router_pb2.DECISION_SOURCE_LOCAL_FALLBACK
    assert {c.module_id for c in decision.candidates} <= {
        "system:help",
        "system:history",
        "system:inventory",
        "system:profile",
        "system:inbox",
    }


async def test_diagnostics_are_for_admins_and_hold_no_text() -> None:
    router = _router()
    await router.route(_route("show me the commands"))
    with pytest.raises(PermissionDenied, match=r"permission level 3\+"):
        router.check_admin(PLAYER, "system:routing")
    router.check_admin(_player(level=4), "system:routing")
    snapshot = router.diagnostics_snapshot()
    assert snapshot["decisions"]["LOCAL"] == 1
    assert "show me the commands" not in repr(snapshot)


async def test_reload_applies_mode_at_once() -> None:
    router = _router()
    assert (
        await router.route(_route("show me the commands"))
    ).source == router_pb2.DECISION_SOURCE_LOCAL
    changes = router.reload(_semantic(mode=Mode.OFF))
    assert any("mode" in line for line in changes)
    assert (
        await router.route(_route("show me the commands"))
    ).source != router_pb2.DECISION_SOURCE_LOCAL


# --- The router servicer in-process, in front of a real engine -------------------------------


async def _start_router(engine_target: str, **config: Any) -> RouterApp:
    app = await create_router(RouterConfig(**HOST, engine_target=engine_target, **config))
    await app.host.start()
    return app


@pytest.fixture
async def router_stub() -> AsyncIterator[router_pb2_grpc.RouterServiceStub]:
    engine = await create_engine(EngineConfig(**HOST, storage_target=UNUSED))
    await engine.host.start()
    router = await _start_router(engine.host.target)
    channel = grpc.aio.insecure_channel(router.host.target)
    try:
        yield router_pb2_grpc.RouterServiceStub(channel)
    finally:
        await channel.close()
        await router.host.stop()
        await router.aclose()
        await engine.host.stop()
        await engine.aclose()


def _request(text: str, player: common_pb2.PlayerContext = PLAYER) -> router_pb2.RouteRequest:
    return router_pb2.RouteRequest(player=player, text=text)


async def test_service_routes_commands(router_stub: router_pb2_grpc.RouterServiceStub) -> None:
    response = await router_stub.Route(_request("帮助"), timeout=5)
    assert response.source == router_pb2.DECISION_SOURCE_COMMAND
    assert response.action.module_id == "system:help"
    assert json_format.MessageToDict(response.action.input) == {}

    response = await router_stub.Route(_request("/system help 历史"), timeout=5)
    assert response.source == router_pb2.DECISION_SOURCE_COMMAND
    assert json_format.MessageToDict(response.action.input) == {"topic": "历史"}


async def test_service_unknown_command_and_no_match(
    router_stub: router_pb2_grpc.RouterServiceStub,
) -> None:
    unknown = await router_stub.Route(_request("/nonsense"), timeout=5)
    assert unknown.source == router_pb2.DECISION_SOURCE_NONE
    assert unknown.no_route_reason == router_pb2.NO_ROUTE_REASON_UNKNOWN_COMMAND
    assert not unknown.HasField("action")
    plain = await router_stub.Route(_request("how do I tame a wolf"), timeout=5)
    assert plain.source in (
        router_pb2.DECISION_SOURCE_NONE,
        router_pb2.DECISION_SOURCE_LOCAL_FALLBACK,
    )


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("/system", "/system needs"),
        ("/history all", "takes no argument"),
        ("", "text is empty"),
        ("x" * 241, "at most 240"),
    ],
)
async def test_service_input_errors_are_invalid_argument(
    router_stub: router_pb2_grpc.RouterServiceStub, text: str, words: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await router_stub.Route(_request(text), timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in (info.value.details() or "")


async def test_service_without_player_is_invalid_argument(
    router_stub: router_pb2_grpc.RouterServiceStub,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await router_stub.Route(router_pb2.RouteRequest(text="help"), timeout=5)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_service_with_unreachable_engine_is_unavailable() -> None:
    router = await _start_router(UNUSED)
    channel = grpc.aio.insecure_channel(router.host.target)
    try:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Route(_request("help"), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "catalogue could not be read" in (info.value.details() or "")
    finally:
        await channel.close()
        await router.host.stop()
        await router.aclose()


def test_a_choice_is_labelled_by_its_description_in_the_players_language() -> None:
    from router_service.router import choice_label

    shop = build_registry(EngineConfig()).descriptor("system:shop")
    assert choice_label(shop, "zh") == "逛商城"
    assert choice_label(shop, "en") == "The server shop"
    assert choice_label(shop, "fr") == "The server shop"  # English for other languages
    long = catalog_pb2.ModuleDescriptor(module_id="test:long")
    long.description.text["en"] = (
        "Look up every single item that the whole server knows about today"
    )
    assert choice_label(long, "en") == "Look up every single item that the whole server…"
    assert choice_label(None, "en") == ""


def test_a_choice_with_an_argument_says_it_on_its_label() -> None:
    """What pressing the choice looks up: the name or list number read from the text."""
    from router_service.router import with_argument

    assert with_argument("逛商城", {"query": "铁锭"}, "zh") == "逛商城：铁锭"
    assert with_argument("The server shop", {"query": "iron ingot"}, "en") == (
        "The server shop: iron ingot"
    )
    assert with_argument("查看任务详情", {"index": 2}, "zh") == "查看任务详情：第 2 个"
    assert with_argument("One quest's details", {"index": 2}, "en") == "One quest's details: #2"
    long = "a" * 30
    assert with_argument("Shop", {"query": long}, "en") == f"Shop: {'a' * 24}…"
    # No argument, several, or one that is no name or number: the label alone.
    assert with_argument("Shop", {}, "en") == "Shop"
    assert with_argument("Shop", {"a": "x", "b": "y"}, "en") == "Shop"
    assert with_argument("Shop", {"flag": True}, "en") == "Shop"
    assert with_argument("", {"query": "x"}, "en") == ""


@pytest.mark.parametrize(
    ("text", "asked"),
    [
        ("what are the server rules", True),
        ("what's the rule on pvp", True),
        ("pvp allowed?", True),
        ("服务器规则是什么", True),
        ("可以开挂吗", True),
        ("主城在哪里", True),
        ("hi", False),
        ("whatever", False),
        ("open the shop", False),
        ("打开商店", False),
    ],
)
def test_a_question_is_told_by_its_words_or_mark(text: str, asked: bool) -> None:
    from router_service.router import asks

    assert asks(text) is asked


async def test_without_a_model_a_question_is_offered_the_knowledge_search() -> None:
    """The card's last choice is the module that answers questions in the player's words
    (`question_field`), the whole text as the question; other texts get none."""
    asked = await _router().route(_route("what are the server rules"))
    assert asked.source == router_pb2.DECISION_SOURCE_LOCAL_FALLBACK
    last = asked.candidates[-1]
    assert last.module_id == "system:question"
    assert json_format.MessageToDict(last.input) == {"question": "what are the server rules"}
    assert asked.candidate_labels[-1] == (
        "Answer a question from the knowledge base: what are the server rule…"
    )
    chinese = common_pb2.PlayerContext(server_id="s", player_id="p-zh", language="zh")
    zh = await _router().route(_route("服务器规则是什么", chinese))
    assert zh.candidate_labels[-1] == "从资料库回答问题：服务器规则是什么"
    for text in ("hi", "stuff things items"):
        plain = await _router().route(_route(text))
        assert "system:question" not in {c.module_id for c in plain.candidates}, text


def test_a_text_that_is_only_a_buttons_words_is_told_by_its_phrasing_key() -> None:
    matcher = ButtonMatcher(load_phrasings())
    assert matcher.phrasing_key("确认", "zh_cn") == "confirm"
    assert matcher.phrasing_key("Claim it!", "en_us") == "claim"
    assert matcher.phrasing_key("next page", "en") == "next"
    assert matcher.phrasing_key("claim my reward now", "en") is None
    assert matcher.phrasing_key("确认", "en") is None  # the player's language's words only
    assert matcher.phrasing_key("  ", "en") is None


async def test_a_buttons_words_with_no_such_button_in_view_say_so_instead_of_choices() -> None:
    """No model: `确认` or `claim it` with no card in view that has the button get a line
    saying to open that card, not a selection card of unrelated modules; `buy` alone still
    gets its command suggested."""
    chinese = common_pb2.PlayerContext(server_id="s", player_id="p-zh", language="zh")
    confirm = await _router().route(_route("确认", chinese))
    assert confirm.source == router_pb2.DECISION_SOURCE_NONE
    assert confirm.no_route_reason == router_pb2.NO_ROUTE_REASON_NO_BUTTON
    assert confirm.detail.startswith("现在看着的卡片上没有“确认”按钮")
    claim = await _router().route(_route("claim it"))
    assert claim.no_route_reason == router_pb2.NO_ROUTE_REASON_NO_BUTTON
    assert claim.detail.startswith("No card you are looking at has a button for “claim it”")
    buy = await _router().route(_route("buy"))
    assert buy.source == router_pb2.DECISION_SOURCE_LOCAL_FALLBACK
    assert [h.usage for h in buy.command_hints] == ["/buy <item [count]>"]
    # With the button in view the words press it, as before.
    button = router_pb2.NotificationButton(
        action=common_pb2.ModuleAction(module_id="system:history"), label_key="claim", label="X"
    )
    pressed = await _router().route(_route("claim it", notification_buttons=[button]))
    assert pressed.source == router_pb2.DECISION_SOURCE_BUTTON
