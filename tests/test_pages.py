"""The list calls' page tokens (storage_service.pages): a token carries only its own list's
key, and anything else is refused as a person can act on it."""

from __future__ import annotations

import base64

import pytest

from services.runtime.errors import InvalidArgument
from storage_service.pages import PageTokens

TASKS, HISTORY, KNOWLEDGE = PageTokens("t"), PageTokens("h"), PageTokens("k")


def _raw(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode()


def test_a_token_gives_back_its_key() -> None:
    assert TASKS.decode_number(TASKS.encode(42)) == 42
    assert KNOWLEDGE.decode(KNOWLEDGE.encode("notes/é 1")) == "notes/é 1"


@pytest.mark.parametrize(
    ("tokens", "token"),
    [
        (HISTORY, TASKS.encode(42)),  # another list's token
        (KNOWLEDGE, HISTORY.encode(7)),
        (TASKS, "garbage!"),  # not base64 of text
        (TASKS, _raw("t")),  # a kind and no key
        (TASKS, _raw("t0")),  # no row is numbered 0
        (TASKS, _raw("t" + "9" * 30)),  # past BIGINT: would reach the driver
        (TASKS, _raw("t-5")),
        (TASKS, _raw("t١٢")),  # digits, but not ASCII ones
        (TASKS, _raw("t" + "9" * 5000)),  # past int()'s digit limit
    ],
)
def test_anything_else_is_refused_as_malformed(tokens: PageTokens, token: str) -> None:
    decode = tokens.decode if tokens is KNOWLEDGE else tokens.decode_number
    with pytest.raises(InvalidArgument, match="page_token is malformed"):
        decode(token)
