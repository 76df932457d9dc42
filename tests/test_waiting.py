"""The tests' waiting helpers (tests/waiting.py): they return as soon as a condition holds, fail
with what was waited for, and a negative check fails as soon as its condition breaks."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.waiting import holds_for, wait_until, wait_until_sync


async def test_wait_until_returns_the_first_true_value() -> None:
    calls: list[int] = []

    def third() -> str | None:
        calls.append(1)
        return "found" if len(calls) == 3 else None

    assert await wait_until(third, interval=0.001) == "found"
    assert len(calls) == 3


async def test_wait_until_awaits_an_async_condition() -> None:
    ready = asyncio.Event()
    asyncio.get_running_loop().call_later(0.02, ready.set)

    async def is_ready() -> bool:
        return ready.is_set()

    await wait_until(is_ready)
    assert ready.is_set()


async def test_wait_until_fails_naming_what_it_waited_for() -> None:
    started = time.monotonic()
    state = {"queued": 2}
    with pytest.raises(AssertionError) as caught:
        await wait_until(
            lambda: state["queued"] == 3,
            timeout=0.05,
            what=lambda: f"three queued, {state['queued']} are",
        )
    assert str(caught.value) == "not met within 0.05 s: three queued, 2 are"
    assert time.monotonic() - started < 1


async def test_an_undescribed_wait_names_its_condition() -> None:
    with pytest.raises(AssertionError, match=r"lambda: 1 \+ 1 == 3"):
        await wait_until(lambda: 1 + 1 == 3, timeout=0)


async def test_a_condition_may_fail_the_wait_at_once() -> None:
    def exited() -> bool:
        raise AssertionError("the process exited")

    started = time.monotonic()
    with pytest.raises(AssertionError, match="the process exited"):
        await wait_until(exited, timeout=5)
    assert time.monotonic() - started < 1


async def test_holds_for_fails_as_soon_as_the_condition_breaks() -> None:
    broken = asyncio.Event()
    asyncio.get_running_loop().call_later(0.02, broken.set)
    started = time.monotonic()
    with pytest.raises(AssertionError, match="stopped holding after .* s: nothing sent"):
        await holds_for(lambda: not broken.is_set(), 5, what="nothing sent")
    assert time.monotonic() - started < 1
    await holds_for(lambda: True, 0.02)  # and returns after its time when it holds


def test_wait_until_sync() -> None:
    deadline = time.monotonic() + 0.02
    assert wait_until_sync(lambda: time.monotonic() >= deadline) is True
    with pytest.raises(AssertionError, match="not met within 0 s: never"):
        wait_until_sync(lambda: False, timeout=0, what="never")

    async def condition() -> bool:
        return True

    with pytest.raises(TypeError):
        wait_until_sync(condition)  # type: ignore[arg-type]
