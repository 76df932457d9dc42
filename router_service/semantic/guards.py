"""Conservative text guards: a request that negates, sets a condition, refers to something
said before, asks for several things at once, or asks to write (claim, buy, pay, sign in...)
never routes directly, however well it matches; the model (or the player) decides instead.

Both languages' patterns apply to every text, so mixed-script requests are covered. The guards
err on the side of firing: a false alarm costs one model call, a miss may run the wrong module.
Item registry ids are masked first, so `minecraft:oak_sign` or `create:and_gate` never fire.

**A module's own phrasing is not a guard.** A marker that the chosen module's own examples use
in the same company (`declared_markers`: the marker with the token before or after it) does not
fire for that module: `有没有未读的邮件` asks the inbox (its examples say `有没有`), `cancel it`
asks a stop command whose examples say `cancel it please`. The catalogue's author wrote those
words as the way the module is asked. Words that change state but that read requests use too
(`CHANGE`: set, remove, turn on, 删除, 关闭...) are declared only with the word before them, so
`what time is the alarm set for` declares `alarm|set` and `set an alarm` still fires; such a word
followed by an object (`can you set my alarm`: `_OBJECTS`) acts on it, and only an example that
acts too (`could you set an alarm`, declaring `you|set>`) lifts it, not `the alarms you set`
(issue 17, round 12). Claim, buy, pay, sign-in and the other write words (`WRITE`) never are
(seed 004).

**Both languages' lists say the same things** (issue 17, round 9): `stop` is 停止, `again` is
再…一遍, `that one` 那首 / 那条, `log in` 登录, `set` 设置 / 设个 / 定个, `turn off` 关掉, `remove`
删掉 / 去掉. Measured on the development set translated into Chinese
(`corpus/hwu64-zh/`), where Chinese requests lacking them routed `设个闹钟` to the alarm query and
`再跟我说一遍` to the explain module.

**The `and` of `between A and B` is no compound** (`_joins_one_thing`): it joins the two ends of
one thing (`the exchange rate between the dollar and the euro`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection, Iterable, Iterator
from typing import Literal

from router_service.semantic.spelling import inflection_bases
from router_service.semantic.text import ITEM_ID, normalize

__all__ = [
    "CHANGE",
    "GUARDS",
    "Guard",
    "Marker",
    "changes_state",
    "check_guards",
    "declared_markers",
    "directions",
    "fired_guards",
    "negates",
    "opposite",
    "write_words",
]

# English words match whole (no letter or digit on either side, so `it` misses `item`); Chinese
# markers match anywhere, Chinese having no spaces between words.
_EN = r"(?<![a-z0-9])(?:{})(?![a-z0-9])"


def _pattern(en: list[str], zh: list[str]) -> re.Pattern[str]:
    """Both lists hold regular expressions; spaces in English ones match any whitespace."""
    parts = []
    if en:
        parts.append(_EN.format("|".join(w.replace(" ", r"\s+") for w in en)))
    if zh:
        parts.append("|".join(zh))
    return re.compile("|".join(parts))


@dataclasses.dataclass(frozen=True)
class Guard:
    """One guard: its name (`guard:<name>` in a decision) and what makes it fire."""

    name: str
    pattern: re.Pattern[str]
    lift: Literal["never", "either", "left"] = "either"
    """Which of a marker's context forms a module's examples may declare (`declared_markers`):
    `either` (`left|marker` or `marker|right`), `left` only, or `never`."""

    def check(self, text: str) -> str | None:
        """The guard's name when it fires on the normalised `text`, else None."""
        return self.name if self.pattern.search(text) else None


# fmt: off
NEGATION = Guard("negation", _pattern(
    ["not", r"no(?!\s*\.)", "never", "don't", "dont", "doesn't", "doesnt", "didn't", "didnt",
     "won't", "wont", "can't", "cant", "cannot", "isn't", "aren't", "shouldn't", "without",
     "nothing", "none", "neither", "nor", "stop"],
    ["不", r"(?<![类区级性识辨告分特派])别(?!的)", "没", "勿", "莫", "甭", "休想", "无需", "毋",
     "停止", "停下"],
))
CONDITION = Guard("condition", _pattern(
    ["if", "when", "whenever", "unless", "once", "in case", "as soon as", "until", "after",
     "before", "provided", "otherwise"],
    ["如果", "要是", "假如", "假设", "若是", "倘若", "万一", "的话", "除非", "只要", "一旦", "等到",
     "之前", "之后", "以后", "否则", "当(?!前|然)"],
))
REFERENCE = Guard("reference", _pattern(
    ["it", "its", "it's", "that", "this one", "these", "those", "them", "they", "their",
     "the same", "same one", "previous", "the last one", "the other", "one more", "again",
     "above", "him", "her", "his"],
    ["那个", "这个", "那些", "这些", "那件", "这件", "那里", "这里", "它", "他", "她", "刚才", "刚刚",
     "上一个", "上个", "之前那", "同样", "上面", "前面", "那样", "这样", "另一个",
     r"再[^，。,.!?！？\s]{0,4}一(?:遍|次)", "又一", r"那(?:首|条|封|张|本|篇|部|集|位|家)"],
))
COMPOUND = Guard("compound", _pattern(
    ["and", "then", "also", "plus", "as well", "or", "after that", "too", "&"],
    ["然后", "并且", "而且", "再", "还要", "还有(?!多少|几)", "同时", "接着", "以及", "和", "跟", "与", "及",
     "或者", "还是", "顺便", "另外", "、", ";", r"\+"],
))
_WRITE_EN = [
    "claim", "buy", "purchase", "pay", "paid", "payment", "redeem", "sell", "sign in", "sign-in",
    "signin", "check in", "check-in", "checkin", "log in", "login", "execute", "run", "submit",
    "confirm", "accept", "abandon", "trade", "transfer", "spend", "order", "checkout",
    "check out", "recharge", "top up", "give", "send"]
# `what does the shop sell`, `do you sell diamonds`: what a seller sells (a read of the shop),
# not selling; `sell my diamonds`, `can you sell me one` still fire.
_SELL = (
    r"sell(?=\s+(?:me|us)(?![a-z]))"
    r"|(?<!shop\s)(?<!store\s)(?<!market\s)(?<!you\s)(?<!they\s)sell"
)
WRITE = Guard("write", _pattern(
    [_SELL if w == "sell" else w for w in _WRITE_EN],
    ["执行", "领取", "领", "购买", "买", "支付", "付款", "付钱", "签到", "打卡", "兑换", "出售",
     # `卖多少钱`, `怎么卖`, `卖什么`, `在卖`, `卖的东西`: what is sold and for how much (a
     # read of the shop), not selling; `卖给`, `卖掉`, `卖东西` still fire.
     r"(?<!怎么)(?<!在)卖(?!多少|几个|什么|些啥|些什么|啥|的)", "赠送", "送给", "转账", "提交", "确认", "下单", "充值", "交易", "接受", "放弃", "发送", "给我一",
     "送我", "登录", "登陆"],
), lift="never")
# Words that change state, but that a read request may use too (`the alarm set for six`,
# `what's turned on`): a module's examples may declare them with the word before them.
_CHANGE_EN = [
    "delete", "remove", "clear", "reset", "set", "change", "enable", "disable", "turn on",
    "turn off", "equip", "craft me", "collect", "receive", "take", "get me", "grab"]
CHANGE = Guard("write", _pattern(
    _CHANGE_EN,
    ["删除", "清空", "清除", "修改", "更改", "改成", "改为", "设为", "设置", "设定", "开启", "关闭",
     "启用", "禁用", "装备上", "拿", "收下", "提取", "重置", "删掉", "删了", "去掉", "移除", "关掉",
     "关上", r"设(?=个|一个|一下|成|到|好)", r"定(?=个|一个|一下|好)"],
), lift="left")
# fmt: on

# An `and` that joins the two ends of one thing asks for one thing, not two: `between the dollar
# and the euro`, `the time difference between here and there`: a `between` earlier in the same
# clause, at most `_BETWEEN_SPAN` tokens before, no other `and` in between (issue 17, round 5).
_BETWEEN_SPAN = 5
_BETWEEN = re.compile(r"(?<![a-z0-9])between(?![a-z0-9])")
_CLAUSE_END = re.compile(r"[.,;!?，。；！？]")


def _joins_one_thing(prepared: str, found: re.Match[str]) -> bool:
    """Whether the compound marker `found` is the `and` of `between A and B`."""
    if found.group() != "and":
        return False
    before = prepared[: found.start()]
    between = list(_BETWEEN.finditer(before))
    if not between:
        return False
    span = before[between[-1].end() :]
    tokens = _TOKEN.findall(span)
    return (
        0 < len(tokens) <= _BETWEEN_SPAN
        and "and" not in tokens
        and _CLAUSE_END.search(span) is None
    )


def _found(guard: Guard, prepared: str) -> Iterator[re.Match[str]]:
    """`guard`'s markers in `prepared`, an `and` that joins one thing's ends left out."""
    for found in guard.pattern.finditer(prepared):
        if guard is COMPOUND and _joins_one_thing(prepared, found):
            continue
        yield found


GUARDS: tuple[Guard, ...] = (NEGATION, CONDITION, REFERENCE, COMPOUND, WRITE, CHANGE)
"""Every guard, in the order `check_guards` reports them (`WRITE` and `CHANGE` are both
`write`)."""

Marker = tuple[str, str]
"""(guard name, the marker with one neighbouring token, `left|marker` or `marker|right`):
`("reference", "cancel|it")`. A token is a Latin word or one Chinese character; punctuation is
skipped; the text's start or end is the empty token."""

_TOKEN = re.compile(r"[a-z0-9'<>_]+|[^\W\d_a-z]", re.UNICODE)


def _prepare(text: str) -> str:
    return ITEM_ID.sub(" <item> ", normalize(text))


# Words after a change word that make it act on something (`set my alarm`, `remove the
# event`), as opposed to saying what was done (`the alarms you set`).
# fmt: off
_OBJECTS = frozenset([
    "my", "a", "an", "the", "this", "that", "these", "those", "your", "our", "his", "her",
    "their", "all", "some", "it", "them"])
# fmt: on


def _occurrences(prepared: str, checking: bool = False) -> Iterator[tuple[str, tuple[Marker, ...]]]:
    """Every guard marker in `prepared`, in guard order: its guard's name and the context forms
    a module may declare (none for a guard that is never lifted). A change word's form ends in
    `>` where it acts on an object; `checking` a text, one without an object is also lifted by
    that acting form."""
    for guard in GUARDS:
        for found in _found(guard, prepared):
            if guard.lift == "never":
                yield guard.name, ()
                continue
            marker = " ".join(found.group().split())
            before = _TOKEN.findall(prepared[: found.start()])
            left = (guard.name, f"{before[-1] if before else ''}|{marker}")
            following = _TOKEN.search(prepared, found.end())
            after = following.group() if following else ""
            if guard.lift == "left":
                acting = (guard.name, left[1] + ">")
                if after in _OBJECTS:
                    yield guard.name, (acting,)
                else:
                    yield guard.name, (left, acting) if checking else (left,)
                continue
            yield guard.name, (left, (guard.name, f"{marker}|{after}"))


def declared_markers(examples: Iterable[str]) -> frozenset[Marker]:
    """The markers, in their context forms, that `examples` use (write words such as `claim`,
    `buy`, `pay` never): what `check_guards` lets through for the module they belong to."""
    return frozenset(
        form
        for example in examples
        for _, forms in _occurrences(_prepare(example))
        for form in forms
    )


def check_guards(text: str, declared: Collection[Marker] = frozenset()) -> str | None:
    """The name of the first guard that fires on `text`, or None.

    Args:
        text: the player's text.
        declared: the chosen module's `declared_markers`; those markers do not fire.
    """
    prepared = _prepare(text)
    if not declared:
        for guard in GUARDS:
            if next(_found(guard, prepared), None) is not None:
                return guard.name
        return None
    for name, forms in _occurrences(prepared, checking=True):
        if not any(form in declared for form in forms):
            return name
    return None


# Words that undo something, and words that add or make something (issue 17, round 17), beside
# `CHANGE`'s: not guards (`cancel it` is a reference guard's business, `取消打开商店` a
# negation's, `add the numbers` no write), only what `changes_state` reads. Inflected forms
# (`cancelled`, `removed`, `switched off`, `added`) are found by `_lemmas`, not listed.
# fmt: off
_UNDO_EN = ["cancel", "erase", "undo", "switch on", "switch off"]
_UNDO = _pattern(_UNDO_EN, ["取消", "撤销", "删"])
_ADD_EN = ["add", "create", "save"]
_ADD = _pattern(
    _ADD_EN,
    ["添加", "加到", "加进", "加入", "加上", "新建", "创建", "保存", "存成", "存到"],
)
# fmt: on
_STATE = (WRITE.pattern, CHANGE.pattern, _UNDO, _ADD)
# The verbs the write, change, undo and add words start with (`turn` of `turn off`): an
# inflected token (`removed`, `deleting`, `turned`, `cancelled`) is read as its base form
# where that base is one of them.
_VERBS = frozenset(
    w.split()[0] for w in (*_WRITE_EN, *_CHANGE_EN, *_UNDO_EN, *_ADD_EN) if w.split()[0].isalpha()
)
_LATIN = re.compile(r"[a-z]+")


def _base(word: str) -> str:
    """`word` with an English inflection taken off (`spelling.inflection_bases`) where what is
    left is one of `_VERBS`; else `word`."""
    if word in _VERBS:
        return word
    found = inflection_bases(word) & _VERBS
    return min(found) if found else word


def _lemmas(prepared: str) -> str:
    """`prepared` with inflected write, change and undo verbs in their base form."""
    return _LATIN.sub(lambda m: _base(m.group()), prepared)


def changes_state(text: str) -> bool:
    """Whether `text` holds a write or state-changing word, declared or not: `WRITE` (`buy`,
    `claim`), `CHANGE` (`delete`, `set`, `turn off`, `删除`) or an undoing word (`cancel`,
    `取消`), in any inflected form (`erased`, `switched off`)."""
    prepared = _prepare(text)
    if any(p.search(prepared) for p in _STATE):
        return True
    lemmas = _lemmas(prepared)
    return lemmas != prepared and any(p.search(lemmas) for p in _STATE)


def negates(text: str) -> bool:
    """Whether `text` holds a negation marker (`NEGATION`), declared or not."""
    return NEGATION.pattern.search(_prepare(text)) is not None


# Words that name a direction of change, as opposed poles (issue 17, round 7): a module most of
# whose examples say one pole (`volume down`, `decrease the volume`) is asked for that
# direction, and a text saying the other (`turn the volume up`) is its missing sibling's
# request, not its own (`router.DIRECTION_SHARE`). Particles, verbs and comparatives only:
# adjectives of state are said with either direction (`less bright`, `dimmed bright`).
# Inflections are read by rule (`increased`, `dimmed`, `closing`).
# fmt: off
_OPPOSITES_EN = (
    ("up increase raise higher louder boost more max maximum",
     "down decrease lower reduce quieter softer less min minimum"),
    ("brighten brighter lighten", "dim dimmer darken darker"),
    ("on enable activate", "off disable deactivate"),
    ("open", "close shut"),
    ("lock", "unlock"),
    ("mute", "unmute"),
    ("next", "previous"),
    ("warmer hotter heat", "cooler colder"),
    ("add create", "remove delete erase"),
)
# Chinese poles are regular expressions matched anywhere (no spaces between words): `静音`
# (mute) is not the `静音` of `取消静音` or `取消音箱静音` (unmute: `取消` or `解除` up to four
# characters before it), and a text that unmutes does not mute too.
_OPPOSITES_ZH = (
    ("调高 调大 增加 提高 升高 加大 大声 大点 大一点 响一点",
     "调低 调小 减少 降低 减小 小声 小点 小一点 轻一点"),
    ("调亮 变亮 亮一点 更亮", "调暗 变暗 暗一点 更暗"),
    ("打开 开启 启用 开灯", "关闭 关掉 关上 停用 关灯"),
    ("锁上 上锁 锁门", "解锁 开锁"),
    ("^(?!.*(?:取消|解除)[^，。！？,.!?]{0,4}静音).*?静音", "(?:取消|解除)[^，。！？,.!?]{0,4}?静音"),
    ("下一(?:首|个|集|页|章|曲|张|条|封)", "上一(?:首|个|集|页|章|曲|张|条|封)"),
    ("调暖 暖一点 热一点 升温", "调凉 凉一点 冷一点 降温"),
    ("添加 加上 新建 创建", "删除 删掉 去掉 移除"),
)
# fmt: on
_POLES_EN = {
    word: f"en{i}{sign}"
    for i, pair in enumerate(_OPPOSITES_EN)
    for sign, words in zip("+-", pair, strict=True)
    for word in words.split()
}
_POLES_ZH = tuple(
    (re.compile("|".join(words.split())), f"zh{i}{sign}")
    for i, pair in enumerate(_OPPOSITES_ZH)
    for sign, words in zip("+-", pair, strict=True)
)


def _pole_zh(word: str) -> str:
    return next(pole for words, pole in _POLES_ZH if words.fullmatch(word))


# A pole that says another one too (issue 17, round 12): to mute is to turn the volume all the
# way down and to unmute to bring it back (the public sets label `unmute the speaker` a
# volume-up request), so a volume-up module whose mute sibling is missing does not take `mute
# the speaker` (`音箱静音`), and a mute module does not take `turn it up`.
_IMPLIED = {
    _POLES_EN["mute"]: _POLES_EN["down"],
    _POLES_EN["unmute"]: _POLES_EN["up"],
    _pole_zh("静音"): _pole_zh("小声"),
    _pole_zh("取消静音"): _pole_zh("大声"),
}


def directions(text: str) -> frozenset[str]:
    """The poles of the direction words (`_OPPOSITES_EN`, `_OPPOSITES_ZH`) that `text` says,
    each as a name such as `en0+` (`up`, `increase`, `louder`...) and `en0-` (`down`,
    `decrease`...), English words in any inflection (`spelling.inflection_bases`), with the
    poles those imply (`_IMPLIED`: `mute` says `down` too)."""
    prepared = _prepare(text)
    found = {
        _POLES_EN[form]
        for token in _LATIN.findall(prepared)
        for form in (token, *inflection_bases(token))
        if form in _POLES_EN
    }
    found.update(pole for words, pole in _POLES_ZH if words.search(prepared))
    found.update([_IMPLIED[pole] for pole in found if pole in _IMPLIED])
    return frozenset(found)


def opposite(pole: str) -> str:
    """The pole opposed to `pole` (`en0+` for `en0-`)."""
    return pole[:-1] + ("-" if pole.endswith("+") else "+")


def fired_guards(text: str) -> list[str]:
    """Names of every guard that fires on `text` (for diagnostics and tests), each once."""
    prepared = _prepare(text)
    names = [guard.name for guard in GUARDS if next(_found(guard, prepared), None) is not None]
    return list(dict.fromkeys(names))


def write_words(text: str) -> frozenset[str]:
    """The write words `text` says, as written (`买` of `我要买铁镐`, `buy`): the lexicon reads
    them all as one feature, so what tells the change modules a text matches alike apart."""
    return frozenset(found.group() for found in WRITE.pattern.finditer(_prepare(text)))
