"""How knowledge text becomes words (storage_service/knowledge.py says how they are indexed):
NFKC and casefold, runs of letters and digits, Han runs segmented by jieba in search mode; a
query's words less the question and function words, each English one with its other number.

Domain code: no gRPC, no database.
"""

from __future__ import annotations

import logging
import re
import threading
import unicodedata
from typing import TYPE_CHECKING

from services.texts import singular

if TYPE_CHECKING:
    import jieba

__all__ = ["MAX_QUERY_TOKENS", "MAX_TOKEN_CHARS", "query_tokens", "tokens", "warm_up"]

MAX_TOKEN_CHARS = 64
"""Longer words are cut: no real word is that long, and PostgreSQL ignores lexemes over 2 KB."""
MAX_QUERY_TOKENS = 32
"""Distinct words a query uses, first come first used."""

_HAN = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_RUN = re.compile(r"[^\W_]+")  # letters and digits, any script
_HAN_PARTS = re.compile(f"([{_HAN}]+)")

# Question and function words, and verbs and quantifiers so common that an entry sharing only
# them with a question says nothing about it (get, make, 获得, 需要), and the server itself,
# which every entry of a server's knowledge base is about (`what are the server rules` found
# the starter entries on `server`). Dropped from queries only:
# OR-combined, they would make almost every entry a hit, and the question module must see
# "nothing local" to consider the web.
_STOPWORD_TEXT = """
    的 了 在 是 我 你 他 她 它 我们 你们 他们 这 那 这个 那个 这些 那些 有 和 与 及 或 或者 就 都
    也 还 吗 呢 吧 啊 呀 哦 嘛 么 什么 怎么 怎么样 怎样 如何 为什么 为何 哪 哪里 哪儿 哪个 哪些 谁 几
    多少 请问 请 一下 可以 能 能不能 会 要 想 得 地 着 过 把 被 给 对 从 到 之 其 该 个 做 弄 搞
    a an the is are was were be been being am do does did of to in on at by for from with about
    as into and or not no but if then so what where when which who whom whose why how can could
    should would will shall may might must i me my you your he she it its we our they them their
    this that these those there here please tell
    get gets got getting make makes made making use uses used using need needs want wants know
    have has had having go goes going find finds found some any much many thing things way ways
    work works worked working
    获得 获取 得到 拿到 找到 使用 用 需要 知道 东西 一些 方法 办法
    server servers 服务器
"""
_STOPWORDS = frozenset(_STOPWORD_TEXT.split())

_jieba_lock = threading.Lock()
_jieba: jieba.Tokenizer | None = None


def _segmenter() -> jieba.Tokenizer:
    """jieba, built once on first use (about a second: it loads its bundled dictionary and may
    cache it in the temp dir). A private Tokenizer: words another component adds to the global
    one in this process must not change how knowledge is indexed."""
    global _jieba
    if _jieba is None:
        with _jieba_lock:
            if _jieba is None:
                import jieba

                jieba.setLogLevel(logging.WARNING)
                segmenter = jieba.Tokenizer()
                segmenter.initialize()
                _jieba = segmenter
    return _jieba


def warm_up() -> None:
    """Loads jieba now rather than on the first request."""
    _segmenter()


def _normalise(text: str) -> str:
    return unicodedata.normalize("NFKC", unicodedata.normalize("NFKC", text).casefold())


def tokens(text: str) -> list[str]:
    """The words of `text`, in order, repeats kept: normalised, Han runs segmented by jieba."""
    words: list[str] = []
    for run in _RUN.findall(_normalise(text)):
        for i, part in enumerate(_HAN_PARTS.split(run)):
            if not part:
                continue
            if i % 2:  # a Han run (split() puts captured parts at odd positions)
                words.extend(w for w in _segmenter().lcut_for_search(part) if w.isalnum())
            else:
                words.append(part)
    return [w[:MAX_TOKEN_CHARS] for w in words]


def query_tokens(query: str) -> list[str]:
    """Distinct words of a query, stopwords dropped unless that leaves none, each English word
    followed by its other number (`diamonds` also asks for `diamond`, `torch` for `torches`),
    at most 32."""
    distinct = list(dict.fromkeys(tokens(query)))
    dropped = [w for w in distinct if w in _STOPWORDS]
    # A stopword's own parts go with it (`服务器` also gives `服务` and `务器`).
    meaningful = [w for w in distinct if w not in _STOPWORDS and not _part_of(w, dropped)]
    if not meaningful:
        return distinct[:MAX_QUERY_TOKENS]
    asked = [form for word in meaningful for form in (word, *_other_number(word))]
    return list(dict.fromkeys(asked))[:MAX_QUERY_TOKENS]


def _part_of(word: str, words: list[str]) -> bool:
    """Whether `word`, Chinese, is a shorter part of one of `words` (search-mode pieces;
    English words are whole: `hose` stays beside `whose`)."""
    if not _HAN_PARTS.fullmatch(word):
        return False
    return any(len(other) > len(word) and word in other for other in words)


_SIBILANT = ("s", "x", "z", "ch", "sh")


def _other_number(word: str) -> tuple[str, ...]:
    """The English singular of a plural word (`services.texts.singular`) and the plural of a
    singular one, by rule (an irregular or wrong form only asks for a word no entry holds).
    Not for Chinese, digits or words of fewer than four letters."""
    if len(word) < 4 or not word.isascii() or not word.isalpha():
        return ()
    one = singular(word)
    if one is not None:
        return (one,)
    if word.endswith("y") and word[-2] not in "aeiou":
        return (word[:-1] + "ies",)
    if word.endswith(_SIBILANT):
        return (word + "es",)
    return (word + "s",)
