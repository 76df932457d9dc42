"""The notification-button matcher: labels, phrasings, distinct verbs and every fallback."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from router_service.buttons import (
    ButtonMatcher,
    ButtonReason,
    features,
    load_phrasings,
    validate_phrasings,
)

REWARD_ZH = [
    ("notice:7/claim", "claim", "领取奖励"),
    ("notice:7/buy", "buy", "购买礼包"),
    ("notice:7/details", "details", "详情"),
]
INVITE_EN = [
    ("invite:3/accept", "accept", "Accept"),
    ("invite:3/details", "details", "Details"),
    ("invite:3/dismiss", "dismiss", "Dismiss"),
]


@pytest.fixture(scope="module")
def matcher() -> ButtonMatcher:
    matcher = ButtonMatcher(load_phrasings())
    matcher.warm_up()
    return matcher


def test_bundled_phrasings_cover_both_languages() -> None:
    phrasings = load_phrasings()
    for key in ("confirm", "details", "open", "dismiss", "claim", "buy"):
        assert phrasings[key]["zh"] and phrasings[key]["en"], key


@pytest.mark.parametrize(
    ("text", "lang", "buttons", "action"),
    [
        ("领取奖励", "zh", REWARD_ZH, "notice:7/claim"),
        ("详情", "zh", REWARD_ZH, "notice:7/details"),
        ("Accept", "en", INVITE_EN, "invite:3/accept"),
        ("  DETAILS! ", "en", INVITE_EN, "invite:3/details"),
        ("ｄｅｔａｉｌｓ", "en", INVITE_EN, "invite:3/details"),  # full-width
    ],
)
def test_exact_label(
    matcher: ButtonMatcher, text: str, lang: str, buttons: list, action: str
) -> None:
    result = matcher.match(text, lang, buttons)
    assert (result.action_id, result.reason) == (action, ButtonReason.EXACT)
    assert result.score == 1.0
    assert result.coverage == 1.0


@pytest.mark.parametrize(
    ("text", "lang", "buttons", "action"),
    [
        ("领奖", "zh", REWARD_ZH, "notice:7/claim"),
        ("查看详情", "zh", REWARD_ZH, "notice:7/details"),
        ("买下", "zh", REWARD_ZH, "notice:7/buy"),
        ("帮我领取一下", "zh", REWARD_ZH, "notice:7/claim"),  # politeness is not a topic
        ("show details", "en", INVITE_EN, "invite:3/details"),
        ("accept invite", "en", INVITE_EN, "invite:3/accept"),
        ("got it", "en", INVITE_EN, "invite:3/dismiss"),
        ("please show me the details", "en", INVITE_EN, "invite:3/details"),
    ],
)
def test_phrasings_from_the_file(
    matcher: ButtonMatcher, text: str, lang: str, buttons: list, action: str
) -> None:
    result = matcher.match(text, lang, buttons)
    assert result.action_id == action, result
    assert result.reason in (ButtonReason.EXACT, ButtonReason.MATCHED)
    assert result.score >= 0.9
    assert result.coverage >= 0.9
    assert result.margin >= 0.15


def test_phrasings_follow_the_players_language(matcher: ButtonMatcher) -> None:
    buttons = [("n:1/ok", "confirm", "确认"), ("n:1/no", "cancel", "取消")]
    assert matcher.match("确定", "zh", buttons).action_id == "n:1/ok"
    assert matcher.match("确定", "zh-CN", buttons).action_id == "n:1/ok"
    # English phrasings are not offered to a Chinese notification.
    assert matcher.match("go ahead", "zh", buttons).action_id is None
    assert matcher.match("go ahead", "en", buttons).action_id == "n:1/ok"


def test_near_duplicate_verbs_stay_distinct(matcher: ButtonMatcher) -> None:
    assert matcher.match("领取", "zh", REWARD_ZH).action_id == "notice:7/claim"
    assert matcher.match("购买", "zh", REWARD_ZH).action_id == "notice:7/buy"
    # Mixing one button's verb with the other's object presses neither.
    for text in ("领取礼包", "购买奖励"):
        result = matcher.match(text, "zh", REWARD_ZH)
        assert result.action_id is None, (text, result)
    claim = set(features("领取", str.split))
    buy = set(features("购买", str.split))
    assert claim and buy and not claim & buy


def test_duplicate_labels_fall_back(matcher: ButtonMatcher) -> None:
    buttons = [
        ("n:2/first", "confirm", "确认"),
        ("n:2/second", "confirm", "确认"),
        ("n:2/details", "details", "详情"),
    ]
    for text in ("确认", "确定", "好的"):
        result = matcher.match(text, "zh", buttons)
        assert result.action_id is None
        assert result.reason in (ButtonReason.DUPLICATE_LABEL, ButtonReason.AMBIGUOUS_PHRASING)
    assert matcher.match("详情", "zh", buttons).action_id == "n:2/details"


def test_shared_label_with_different_keys_falls_back(matcher: ButtonMatcher) -> None:
    buttons = [("n:3/a", "accept", "OK"), ("n:3/b", "confirm", "OK")]
    assert matcher.match("OK", "en", buttons).reason is ButtonReason.DUPLICATE_LABEL
    # "accept invite" is accept's phrasing only, but its button reads the same as the other.
    assert matcher.match("accept invite", "en", buttons).reason is ButtonReason.DUPLICATE_LABEL


def test_same_action_on_two_buttons_is_not_ambiguous(matcher: ButtonMatcher) -> None:
    buttons = [("n:4/open", "open", "打开"), ("n:4/open", "open", "打开")]
    assert matcher.match("打开", "zh", buttons).action_id == "n:4/open"


@pytest.mark.parametrize(
    ("text", "lang", "buttons", "reason"),
    [
        ("不要领取", "zh", REWARD_ZH, ButtonReason.NEGATION),
        ("别购买", "zh", REWARD_ZH, ButtonReason.NEGATION),
        ("don't accept", "en", INVITE_EN, ButtonReason.NEGATION),
        ("do not accept", "en", INVITE_EN, ButtonReason.NEGATION),
        ("don\u2019t accept", "en", INVITE_EN, ButtonReason.NEGATION),  # curly apostrophe
        ("如果便宜就购买", "zh", REWARD_ZH, ButtonReason.CONDITION),
        ("领取奖励的话", "zh", REWARD_ZH, ButtonReason.CONDITION),
        ("accept if it is free", "en", INVITE_EN, ButtonReason.CONDITION),
        ("领取奖励了吗", "zh", REWARD_ZH, ButtonReason.QUESTION),
        ("what are the details", "en", INVITE_EN, ButtonReason.QUESTION),
    ],
)
def test_negation_condition_and_questions_fall_back(
    matcher: ButtonMatcher, text: str, lang: str, buttons: list, reason: ButtonReason
) -> None:
    result = matcher.match(text, lang, buttons)
    assert result.action_id is None
    assert result.reason is reason


def test_negation_inside_the_label_itself_is_fine(matcher: ButtonMatcher) -> None:
    buttons = [("n:5/mute", "mute", "不再提醒"), ("n:5/later", "later", "Not now")]
    assert matcher.match("不再提醒", "zh", buttons).action_id == "n:5/mute"
    assert matcher.match("not now", "en", buttons).action_id == "n:5/later"
    assert matcher.match("不要不再提醒", "zh", buttons).action_id is None


@pytest.mark.parametrize(
    ("text", "lang", "buttons"),
    [
        ("领取钻石剑然后删掉存档", "zh", REWARD_ZH),  # unknown topic riding on one verb
        ("今天天气怎么样", "zh", REWARD_ZH),
        ("accept and dismiss", "en", INVITE_EN),  # compound
        ("accept the trade from steve", "en", INVITE_EN),
        ("details 😀", "en", INVITE_EN),
        ("tell me a story", "en", INVITE_EN),
    ],
)
def test_low_scores_and_unknown_topics_fall_back(
    matcher: ButtonMatcher, text: str, lang: str, buttons: list
) -> None:
    result = matcher.match(text, lang, buttons)
    assert result.action_id is None, result
    assert result.reason in (
        ButtonReason.LOW_SCORE,
        ButtonReason.LOW_COVERAGE,
        ButtonReason.LOW_MARGIN,
        ButtonReason.QUESTION,
    )


def test_actions_not_on_the_notification_are_never_returned(matcher: ButtonMatcher) -> None:
    buttons = [("n:6/details", "details", "详情"), ("n:6/dismiss", "dismiss", "忽略")]
    # The file knows how to say "buy" and "claim", but this notification carries neither.
    for text in ("购买", "领取", "买下", "claim it", "确认"):
        assert matcher.match(text, "zh", buttons).action_id is None
    allowed = {action for action, _, _ in buttons}
    for text in ("详情", "查看详情", "忽略", "关掉", "购买详情", "领取并忽略"):
        assert matcher.match(text, "zh", buttons).action_id in allowed | {None}


def test_new_label_keys_match_by_their_text(matcher: ButtonMatcher) -> None:
    buttons = [("n:7/teleport", "system.notice.teleport_home", "传送回家"), *REWARD_ZH]
    assert matcher.match("传送回家", "zh", buttons).action_id == "n:7/teleport"
    buttons_en = [("n:7/teleport", "system.notice.teleport_home", "Teleport home")]
    assert matcher.match("teleport home please", "en", buttons_en).action_id == "n:7/teleport"


def test_edge_inputs(matcher: ButtonMatcher) -> None:
    assert matcher.match("确认", "zh", []).reason is ButtonReason.NO_BUTTONS
    assert matcher.match(" \u3000!?", "zh", REWARD_ZH).reason is ButtonReason.EMPTY_TEXT
    assert matcher.match("请", "zh", REWARD_ZH).action_id is None  # only filler
    assert matcher.match("bad \ud800", "en", INVITE_EN).action_id is None
    assert matcher.match("详情", "xx", REWARD_ZH).action_id == "notice:7/details"  # label only
    punctuation_only = [("n:8/x", "x", "!!!")]
    assert matcher.match("ok", "en", punctuation_only).action_id is None


def test_indexes_are_reused_per_button_set_and_language() -> None:
    calls: list[str] = []

    def segment(text: str) -> list[str]:
        calls.append(text)
        return list(text)

    matcher = ButtonMatcher({"details": {"zh": ["查看详情"]}}, cache_size=2, segment=segment)
    other_notice = [("n:9/details", "details", "详情")]
    matcher.match("详情", "zh", REWARD_ZH)
    calls.clear()
    matcher.match("详情", "zh", [("notice:8/" + a.split("/")[1], k, t) for a, k, t in REWARD_ZH])
    assert "领取奖励" not in calls  # same labels, other action ids: the index is reused
    matcher.match("详情", "en", REWARD_ZH)
    matcher.match("详情", "zh", other_notice)
    calls.clear()
    matcher.match("详情", "zh", REWARD_ZH)
    assert "领取奖励" in calls  # bounded at two: the oldest index was dropped, built again
    assert matcher.match("查看详情", "zh", other_notice).action_id == "n:9/details"


def test_concurrent_matching() -> None:
    matcher = ButtonMatcher(load_phrasings(), segment=list)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for i in range(50):
                buttons = [(f"n:{i % 5}/claim", "claim", "领取奖励"), *INVITE_EN]
                assert matcher.match("领取奖励", "zh", buttons).action_id == f"n:{i % 5}/claim"
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors


def test_thresholds_are_configurable_and_validated() -> None:
    loose = ButtonMatcher(load_phrasings(), min_coverage=0.5, segment=list)
    assert loose.match("accept invite thanks", "en", INVITE_EN).action_id == "invite:3/accept"
    strict = ButtonMatcher(load_phrasings(), segment=list)
    assert strict.match("accept invite thanks", "en", INVITE_EN).action_id is None
    with pytest.raises(ValueError, match="min_coverage"):
        ButtonMatcher({}, min_coverage=0.2)
    with pytest.raises(ValueError, match="min_score"):
        ButtonMatcher({}, min_score=1.5)


def test_phrasings_file_is_validated(tmp_path: Path) -> None:
    bad = tmp_path / "buttons.json"
    bad.write_text(json.dumps({"confirm": {"zh": "确认"}}), encoding="utf-8")
    with pytest.raises(ValueError, match=r"'confirm'\.'zh' must be a list"):
        load_phrasings(bad)
    bad.write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_phrasings(bad)
    with pytest.raises(ValueError, match="must map language codes"):
        validate_phrasings({"confirm": ["确认"]})
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"confirm": {"ZH_cn": ["行"]}}), encoding="utf-8")
    assert load_phrasings(good) == {"confirm": {"zh-cn": ["行"]}}
