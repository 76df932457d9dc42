"""The lease meter: daily budgets kept by the storage service, drawn on through leases so most
calls make no storage round trip.

A call's worst case is held on this replica's lease for its player (see `lease.py`). When
the player has no lease, or it has too little left, is retired or of another day, one
reservation in storage takes a new block: the call's worst case, which must fit, plus up to
`LeasePolicy.tokens` / `web_searches` more as far as the player's and the global limits leave
room. Storage checks that atomically (ReserveUsage), so leases on any number of replicas never
hold more than the budgets together, and a call is only ever served from budget held for it.

A background task writes each lease's use to storage in batches (a settle with `keep_open`,
the rest staying held), about every `refresh_seconds`, all leases' settles in one
SettleUsageBatch call; the same settle renews the lease in storage and re-reads the player's
external-services preference. A lease stops
serving calls when:

- storage says the player turned external services off (within one refresh), or its last
  contact with storage is older than `stale_after` (then a call first renews it itself,
  which re-reads the preference, or gets UNAVAILABLE when storage does not answer): so a
  player who turns external services off is refused everywhere within `stale_after`;
- it would expire in storage before the call could end (renewed first, as above);
- it is idle for `idle_seconds`, its day has passed, or the gateway shuts down: then its use
  is written and the rest released.

A replica that dies leaves its leases to expire in storage after `ttl_seconds` without
renewal; the next reservation there releases them. Every settle carries a sequence number
per lease and is resent as it is until storage acknowledges it, so a retry is applied once.

A call that could outlast a lease's TTL gets a reservation of its own (as does every call with
`tokens` and `web_searches` both 0: leases off).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import datetime as dt
import logging
import math
import time
import uuid
import weakref
from collections.abc import Callable

from services.model_gateway.lease import Amount, Lease, Verdict
from services.model_gateway.metering import BudgetExhausted, Hold, Used
from services.model_gateway.usage_store import Settle, UsageStore
from services.runtime.errors import Unavailable

__all__ = ["LeaseMeter", "LeasePolicy"]

log = logging.getLogger("system.model")

# A lease must outlive the end of every call drawing on it by this much, so the call's use is
# written before storage could release what covers it.
CALL_MARGIN_SECONDS = 2.0
# A call's own reservation outlives the call by this much: only a dead replica's expire.
OWN_HOLD_MARGIN_SECONDS = 30
MAX_TTL_SECONDS = 3600
# A lease stops serving calls when its last contact with storage is this many refreshes old.
STALE_REFRESHES = 3


@dataclasses.dataclass(frozen=True)
class LeasePolicy:
    """How big leases are and how they are kept. See ModelConfig's `lease_*` settings."""

    tokens: int = 16_384
    """Tokens a lease asks for (besides a call's worst case, when that is larger)."""
    web_searches: int = 4
    """Web searches a lease asks for."""
    cost_micros: int = 0
    """Money (micros) a lease asks for: what its tokens may cost at the dearest model."""
    refresh_seconds: float = 1.0
    """How often a lease's use is written and the lease renewed and re-checked."""
    idle_seconds: float = 10.0
    """A lease no call used for this long is closed and its rest released."""
    ttl_seconds: int = 60
    """Storage releases a lease not renewed for this long (its replica died)."""

    @property
    def enabled(self) -> bool:
        return self.tokens > 0 or self.web_searches > 0

    @property
    def stale_after(self) -> float:
        """Longest a lease serves calls without a contact with storage: the bound on how
        late a preference change is honoured."""
        return STALE_REFRESHES * self.refresh_seconds


def _utc_today() -> dt.date:
    return dt.datetime.now(dt.UTC).date()


class LeaseMeter:
    """Meter (see metering.py) on budget leases.

    Args:
        store: the storage service's usage calls; owned (closed by `aclose`).
        policy: lease sizes and times.
        clock: monotonic seconds; a parameter so tests can move time.
        today: the current UTC day.
    """

    def __init__(
        self,
        store: UsageStore,
        policy: LeasePolicy,
        *,
        clock: Callable[[], float] = time.monotonic,
        today: Callable[[], dt.date] = _utc_today,
    ) -> None:
        self._store = store
        self._policy = policy
        self._clock = clock
        self._today = today
        self._current: dict[str, Lease] = {}  # the lease new calls of a player draw on
        self._open: dict[str, Lease] = {}  # every lease not closed yet, by reservation id
        # One lease taken at a time per player; a lock lives as long as someone holds it.
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    # -- the Meter interface -----------------------------------------------------------------

    async def reserve(
        self,
        player_id: str,
        *,
        tokens: int = 0,
        web_searches: int = 0,
        cost_micros: int = 0,
        level: int | None = None,
        hold_seconds: float,
    ) -> Hold:
        """Holds the call's worst case on the player's lease (taking one when needed). A
        lease is checked in storage against the limits of one rank (by permission `level`):
        a call of another rank takes a new one; `level` None draws on any.

        Raises:
            BudgetExhausted: a budget has no room for it; nothing was sent (the reason names
                which).
            ExternalServicesOff: the player turned external services off.
            Unavailable: storage did not answer when it had to; nothing was sent.
        """
        if self._closing:
            raise Unavailable("the model gateway is shutting down; nothing was sent")
        self._start()
        need = Amount(tokens, web_searches, cost_micros)
        rank = None if level is None else self._store.rank_of(level)
        call_seconds = hold_seconds + CALL_MARGIN_SECONDS
        if not self._policy.enabled or call_seconds > self._policy.ttl_seconds:
            ttl = min(MAX_TTL_SECONDS, math.ceil(hold_seconds) + OWN_HOLD_MARGIN_SECONDS)
            own = await self._acquire(player_id, need, Amount(), ttl, level, dedicated=True)
            own.take(need, self._clock())
            return Hold(player_id, tokens, web_searches, own, cost_micros)
        lease = self._current.get(player_id)
        if lease is not None and self._check(lease, need, call_seconds, rank) is Verdict.OK:
            lease.take(need, self._clock())  # the common case: no storage trip
        else:
            lease = await self._lease_for(player_id, need, call_seconds, rank, level)
        return Hold(player_id, tokens, web_searches, lease, cost_micros)

    def settle_later(self, hold: Hold, used: Used) -> None:
        lease = hold.lease
        if not isinstance(lease, Lease):
            return
        lease.finish(Amount(hold.tokens, hold.web_searches, hold.cost_micros), used, self._clock())
        if lease.closing:
            self._wake.set()  # close it now rather than at the next refresh

    async def drain(self) -> None:
        """Writes every lease's use so far (and closes the retired ones no call uses)."""
        while work := [lease for lease in self._open.values() if lease.has_work()]:
            await asyncio.gather(*(self._sync(lease) for lease in work))

    async def aclose(self) -> None:
        """Writes what is left and releases every lease's rest (shutdown)."""
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for lease in list(self._current.values()):
            self._retire(lease)
        try:
            await asyncio.gather(
                *(self._sync_quietly(lease) for lease in list(self._open.values()))
            )
        finally:
            await self._store.aclose()

    # -- taking leases ---------------------------------------------------------------------------

    def _check(
        self, lease: Lease, need: Amount, call_seconds: float, rank: str | None = None
    ) -> Verdict:
        return lease.check(
            need,
            now=self._clock(),
            today=self._today(),
            call_seconds=call_seconds,
            stale_after=self._policy.stale_after,
            rank=rank,
        )

    async def _lease_for(
        self, player_id: str, need: Amount, call_seconds: float, rank: str | None, level: int | None
    ) -> Lease:
        """The player's lease with `need` taken from it: the current one renewed, or a new one."""
        lock = self._locks.get(player_id)
        if lock is None:
            lock = self._locks[player_id] = asyncio.Lock()
        async with lock:
            lease = self._current.get(player_id)
            if lease is not None:
                verdict = self._check(lease, need, call_seconds, rank)
                if verdict is Verdict.STALE:
                    # Renewing re-reads the preference: on the call's path only when the
                    # background refresh fell behind.
                    await self._sync(lease)
                    verdict = self._check(lease, need, call_seconds, rank)
                if verdict is Verdict.OK:
                    lease.take(need, self._clock())
                    return lease
                self._retire(lease)
            block = Amount(self._policy.tokens, self._policy.web_searches, self._policy.cost_micros)
            extra = block - need
            lease = await self._acquire(player_id, need, extra, self._policy.ttl_seconds, level)
            self._current[player_id] = lease
            lease.take(need, self._clock())
            return lease

    async def _acquire(
        self,
        player_id: str,
        need: Amount,
        extra: Amount,
        ttl: int,
        level: int | None,
        *,
        dedicated: bool = False,
    ) -> Lease:
        try:
            return await self._reserve(player_id, need, extra, ttl, level, dedicated)
        except BudgetExhausted:
            # This replica's retired leases of the player may hold the room asked for.
            if not await self._give_back(player_id):
                raise
            return await self._reserve(player_id, need, extra, ttl, level, dedicated)

    async def _reserve(
        self,
        player_id: str,
        need: Amount,
        extra: Amount,
        ttl: int,
        level: int | None,
        dedicated: bool,
    ) -> Lease:
        reservation_id = uuid.uuid4().hex
        sent = self._clock()
        grant = await self._store.reserve(reservation_id, player_id, need, extra, ttl, level)
        lease = Lease(
            reservation_id,
            player_id,
            grant.day,
            grant.held,
            contacted=sent,
            ttl_seconds=ttl,
            dedicated=dedicated,
            rank=grant.rank,
        )
        self._open[reservation_id] = lease
        if not grant.held.covers(need):  # only a repeated reservation id could do this
            self._retire(lease)
            raise Unavailable("the budget reservation came back smaller than asked; try again")
        return lease

    async def _give_back(self, player_id: str) -> bool:
        """Writes and shrinks (or closes) the player's retired leases; whether any had room
        to give back."""
        spare = [
            lease
            for lease in self._open.values()
            if lease.player_id == player_id and lease.retired and lease.free != Amount()
        ]
        results = await asyncio.gather(
            *(self._sync(lease) for lease in spare), return_exceptions=True
        )
        return any(result is None for result in results)

    def _retire(self, lease: Lease) -> None:
        lease.retired = True
        if self._current.get(lease.player_id) is lease:
            del self._current[lease.player_id]
        if lease.closing:
            self._wake.set()

    # -- writing use -----------------------------------------------------------------------------

    async def _sync(self, lease: Lease) -> None:
        """Sends the lease's pending settle(s): its use, a renewal, or its close.

        Raises:
            Unavailable: storage did not answer; the batch is resent next time.
        """
        async with lease.sync_lock:
            while not lease.closed:
                batch, resent = lease.next_batch()
                sent = self._clock()
                answer = await self._store.settle(
                    lease.reservation_id, lease.player_id, batch, lease.ttl_seconds
                )
                lease.acknowledge(batch, answer, sent)
                if not resent:
                    break
        if lease.closing:  # storage retired it just now: close it soon
            self._wake.set()
        self._after_sync(lease)

    async def _write(self, leases: list[Lease]) -> None:
        """Sends the leases' pending settles in one SettleUsageBatch; a lease whose settle a
        call is sending right now is left to it. Failures are logged: the batches are resent
        as they are next time."""
        mine = [lease for lease in leases if not lease.sync_lock.locked()]
        for lease in mine:
            await lease.sync_lock.acquire()  # free, so this does not wait
        try:
            batches = [lease.next_batch()[0] for lease in mine]
            sent = self._clock()
            answers = await self._store.settle_many(
                [
                    Settle(lease.reservation_id, lease.player_id, batch, lease.ttl_seconds)
                    for lease, batch in zip(mine, batches, strict=True)
                ]
            )
            for lease, batch, answer in zip(mine, batches, answers, strict=True):
                lease.acknowledge(batch, answer, sent)
                if lease.closing:  # a resent batch went first: the close is still to send
                    self._wake.set()
        except Unavailable as exc:
            log.warning(
                "use of %d budget leases not written (%s); sent again at the next refresh, "
                "released by storage after their TTL if never",
                len(mine),
                exc,
            )
        finally:
            for lease in mine:
                lease.sync_lock.release()
        for lease in mine:
            self._after_sync(lease)

    def _after_sync(self, lease: Lease) -> None:
        if lease.closed:
            self._open.pop(lease.reservation_id, None)
        elif lease.retired and self._current.get(lease.player_id) is lease:
            del self._current[lease.player_id]  # storage retired it: no new calls

    async def _sync_quietly(self, lease: Lease) -> None:
        try:
            await self._sync(lease)
        except Unavailable as exc:
            log.warning(
                "budget lease not written (%s); retried at the next refresh, released by "
                "storage after %s s if never",
                exc,
                lease.ttl_seconds,
                extra={"player_id": lease.player_id},
            )

    def _start(self) -> None:
        if self._task is None:
            # A fresh context: no caller's deadline may cut the background writes short.
            self._task = asyncio.get_running_loop().create_task(
                self._run(), context=contextvars.Context()
            )

    async def _run(self) -> None:
        while True:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for drops a cancel that
            # arrives as the wait ends, and the task would outlive its close.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._policy.refresh_seconds):
                    await self._wake.wait()
            self._wake.clear()
            try:
                await self._tick()
            except Exception:  # noqa: BLE001 - the loop must outlive any one bad tick
                log.exception("budget lease refresh failed")

    async def _tick(self) -> None:
        now, today = self._clock(), self._today()
        for lease in list(self._current.values()):
            idle = lease.calls == 0 and now - lease.last_used >= self._policy.idle_seconds
            if idle or lease.day != today:
                self._retire(lease)
        # Refreshed when last contacted before the previous tick: an early wake-up (to close a
        # lease) does not refresh the others again.
        due = [
            lease
            for lease in self._open.values()
            if lease.closing
            or (not lease.retired and now - lease.contacted >= self._policy.refresh_seconds / 2)
        ]
        if due:
            await self._write(due)
