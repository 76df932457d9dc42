"""The interactive runs in progress: one per player across replicas, duplicates, cancel.

A player has at most one interactive run at a time. On this replica an in-memory map keeps it
so (checked and set without awaiting, so no lock is needed); across replicas the run holds the
storage lease `player:<player_id>`, owned by this replica and renewed while the run lasts.

- A request identical to the player's run in progress (same fingerprint: player, module,
  input and request text) is a duplicate: it waits for that run and gets its result.
- Any other request of the player while a run is in progress is BUSY (ResourceExhausted),
  here at once, on another replica once the lease has stayed held for `busy_wait`.
- Storage that cannot be reached for the lease is Unavailable: nothing runs (fail closed).
- `cancel` stops a run: its module task is cancelled and the run ends CANCELLED.

A player this replica ran last time starts their next run while the lease is being taken
(decision 0009): until the lease is held the run may call only read-only, idempotent game
tools; everything else it does (a write, a model call, a history read, its reply) waits for
the lease. The early start stands when storage says the lease's acquisition before this one
was this replica's own last (`previous_token`), so no other replica has run the player
since; otherwise (or when the lease was held) it is thrown away and the run starts again
under the lease. A player this replica does not remember starts once the lease is held.

No gRPC here: leases go through a `PlayerLeases` (the JournalService client in production).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import hashlib
import json
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple, Protocol

from prometheus_client import Counter
from system.common.v1 import common_pb2

from services.runtime.errors import ResourceExhausted

__all__ = ["Lease", "LeaseTaken", "PlayerLeases", "PlayerRuns", "Run", "fingerprint", "lease_name"]

log = logging.getLogger("system.engine")

REMEMBERED_TOKENS = 10_000
"""Players whose last lease token this replica remembers (the most recent ones): a player
beyond them simply gets no early start."""

EARLY_STARTS = Counter(
    "engine_early_starts_total",
    "Interactive runs started while their player's lease was being taken (decision 0009), by "
    "whether the early start stood or was dropped and made again under the lease.",
    ["outcome"],
)

Lease = asyncio.Future[None]
"""Done once the run's player lease is held (see ExecutionContext)."""


class LeaseTaken(NamedTuple):
    """An acquisition: its fencing token, and the token of the acquisition before it (0 when
    the lease was never taken before)."""

    token: int
    previous_token: int


class PlayerLeases(Protocol):
    """Named storage leases. `acquire` raises ResourceExhausted when another owner holds the
    lease and Unavailable when storage cannot be asked."""

    async def acquire(self, name: str, owner: str, ttl_seconds: int) -> LeaseTaken: ...

    async def renew(self, name: str, owner: str, token: int, ttl_seconds: int) -> None: ...

    async def release(self, name: str, owner: str, token: int) -> None: ...


def lease_name(player_id: str) -> str:
    return f"player:{player_id}"


def fingerprint(player_id: str, module_id: str, data: dict[str, Any], text: str) -> str:
    """Identifies a request by what it asks: player, module, input and request text."""
    canonical = json.dumps(
        [player_id, module_id, data, text], sort_keys=True, ensure_ascii=False, default=str
    )
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclasses.dataclass
class Run:
    """One interactive run in progress."""

    player_id: str
    request_id: str
    fingerprint: str
    result: asyncio.Future[common_pb2.AgentResult]
    job: asyncio.Future[Any] | None = None
    cancelled: bool = False
    lost_lease: bool = False
    duplicates: int = 0
    # What must finish before the player's lease is given back (the run's history write).
    written: asyncio.Future[Any] | None = None


async def _drop(early: asyncio.Future[Any]) -> None:
    """Cancels an early start and waits for it to end (whatever it ended with is dropped)."""
    early.cancel()
    await asyncio.wait([early])
    if not early.cancelled():
        early.exception()  # retrieved: an early start's failure is not the run's


def _detached(coro: Awaitable[Any]) -> asyncio.Task[Any]:
    """A task outside the request's context (its deadline must not cut lease upkeep short)."""
    return asyncio.get_running_loop().create_task(coro, context=contextvars.Context())  # type: ignore[arg-type]


class PlayerRuns:
    """The runs in progress on this replica, one per player."""

    def __init__(
        self,
        leases: PlayerLeases | None,
        owner: str,
        lease_seconds: int,
        busy_wait: float = 0.5,
    ) -> None:
        self.leases = leases
        self.owner = owner
        self.lease_seconds = lease_seconds
        self.busy_wait = busy_wait
        self._runs: dict[str, Run] = {}
        self._releasing: set[asyncio.Task[Any]] = set()
        # Per player, how many times this replica has taken the lease (while a release is
        # pending): a release superseded by a newer acquisition is not sent (see _release).
        self._taken: dict[str, int] = {}
        # Per player, the token of this replica's last acquisition (see hold).
        self._last_tokens: OrderedDict[str, int] = OrderedDict()
        # Early starts that stood ("kept") and that were made again ("dropped"), as the
        # EARLY_STARTS metric counts them for the whole process.
        self.early_starts = {"kept": 0, "dropped": 0}

    def running(self, player_id: str) -> Run | None:
        return self._runs.get(player_id)

    def active_players(self) -> list[str]:
        """Players with a run in progress on this replica."""
        return list(self._runs)

    def join_or_start(self, player_id: str, print_: str) -> Run | None:
        """None when the caller starts a new run (call `start` next, without awaiting in
        between); the run in progress when `print_` duplicates it. Raises ResourceExhausted
        (BUSY) when the player has a different run in progress."""
        current = self._runs.get(player_id)
        if current is None:
            return None
        if current.fingerprint == print_ and not current.cancelled:
            return current
        raise ResourceExhausted("another request of this player is in progress; try again shortly")

    def start(self, player_id: str, request_id: str, print_: str) -> Run:
        run = Run(player_id, request_id, print_, asyncio.get_running_loop().create_future())
        self._runs[player_id] = run
        return run

    def finish(self, run: Run) -> None:
        if self._runs.get(run.player_id) is run:
            del self._runs[run.player_id]

    def cancel(self, player_id: str, request_id: str = "") -> bool:
        """Cancels the player's run (only the one with `request_id` when given)."""
        run = self._runs.get(player_id)
        if run is None or (request_id and run.request_id != request_id):
            return False
        run.cancelled = True
        if run.job is not None:
            run.job.cancel()
        return True

    async def hold(
        self, run: Run, body: Callable[[Lease | None], Awaitable[common_pb2.AgentResult]]
    ) -> common_pb2.AgentResult:
        """Runs `body` under the player's storage lease (renewed as it runs, released after).

        For a player this replica took the lease for last time, `body(lease)` starts at once,
        while the lease is being taken: `lease` is done once it is held, and the body waits
        for it before anything but a read-only game tool (see ExecutionContext). When the
        early start cannot stand (the lease was held, or another replica took it since this
        one last did) it is cancelled and `body(None)` runs once the lease is held, as it
        does for a player this replica does not remember. Raises what `acquire` raises; no
        result is given then."""
        if self.leases is None:
            return await body(None)
        name = lease_name(run.player_id)
        known = self._last_tokens.get(run.player_id)
        if known is None:
            # This replica has not run the player lately: another one may be running them
            # now, so nothing starts before the lease is held.
            acquired = await self._acquire(name)
            return await self._held(run, name, acquired.token, body(None))
        lease: Lease = asyncio.get_running_loop().create_future()
        early = asyncio.ensure_future(body(lease))
        try:
            taken: LeaseTaken | None = await self.leases.acquire(
                name, self.owner, self.lease_seconds
            )
        except ResourceExhausted:
            taken = None  # held, perhaps only until its holder's release lands: asked again
        except BaseException:
            await _drop(early)
            raise
        if taken is not None and taken.previous_token == known:
            self._count_early_start("kept")
            lease.set_result(None)
            return await self._held(run, name, taken.token, early)
        self._count_early_start("dropped")
        await _drop(early)
        if taken is None:
            taken = await self._acquire(name, refused=True)
        return await self._held(run, name, taken.token, body(None))

    def _count_early_start(self, outcome: str) -> None:
        self.early_starts[outcome] += 1
        EARLY_STARTS.labels(outcome).inc()

    async def _held(
        self, run: Run, name: str, token: int, body: Awaitable[common_pb2.AgentResult]
    ) -> common_pb2.AgentResult:
        """Awaits `body` with the lease taken as `token` kept, then gives it back."""
        self._remember(run.player_id, token)
        taken = self._taken[run.player_id] = self._taken.get(run.player_id, 0) + 1
        keeper = _detached(self._keep(run, name, token))
        try:
            return await body
        finally:
            keeper.cancel()
            with contextlib.suppress(BaseException):
                await keeper
            # Released in the background (after the run's history write): the player's slot
            # on this replica frees at once, so a request right after this one (say, after a
            # cancel) is not refused while the write and the release travel.
            # A new acquisition by this replica gets a newer token, and storage refuses the old
            # token's late release, so the two can never clash.
            release = _detached(self._release(run.player_id, token, taken, run.written))
            self._releasing.add(release)
            release.add_done_callback(self._releasing.discard)

    async def flush_releases(self) -> None:
        """Waits for the lease releases in flight (at shutdown: another replica can then take
        the players at once instead of after the leases expire)."""
        while self._releasing:
            await asyncio.wait(list(self._releasing))

    async def settle(self, player_id: str) -> bool:
        """Takes the player's lease and gives it back at once: returns once no run of the
        player holds it on any replica (each keeps it until its exchange is in history), or
        False when one still does after `busy_wait`. Raises Unavailable without storage."""
        if player_id in self._runs:
            return False
        if self.leases is None:
            return True
        name = lease_name(player_id)
        try:
            taken = await self._acquire(name)
        except ResourceExhausted:
            return False
        self._remember(player_id, taken.token)
        await self._release_now(name, taken.token)
        return True

    def _remember(self, player_id: str, token: int) -> None:
        """Notes this replica's latest token for the player (the most recent players only)."""
        self._last_tokens[player_id] = token
        self._last_tokens.move_to_end(player_id)
        if len(self._last_tokens) > REMEMBERED_TOKENS:
            self._last_tokens.popitem(last=False)

    async def _release_now(self, name: str, token: int) -> None:
        assert self.leases is not None
        try:
            await self.leases.release(name, self.owner, token)
        except Exception as exc:  # noqa: BLE001 - the lease expires on its own
            log.warning("player lease %s was not released: %s", name, exc)

    async def _acquire(self, name: str, refused: bool = False) -> LeaseTaken:
        """Takes the player's lease, asking again for up to `busy_wait` seconds while another
        replica holds it: a replica gives the lease back just after its reply (once the
        exchange is in history), so a player's next request that lands on another replica
        right away waits those milliseconds instead of being refused. A run really in
        progress elsewhere is BUSY after `busy_wait`. `refused`: the caller has just asked
        once and been refused, so the first ask here waits first."""
        assert self.leases is not None
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.busy_wait
        delay = 0.005
        while True:
            if refused:
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.1)
            try:
                return await self.leases.acquire(name, self.owner, self.lease_seconds)
            except ResourceExhausted:
                if loop.time() + delay > give_up:
                    raise
            refused = True

    async def _keep(self, run: Run, name: str, token: int) -> None:
        """Renews the lease every third of its length; a lease that cannot be renewed stops
        the run (another replica may take the player once it expires)."""
        assert self.leases is not None
        while True:
            await asyncio.sleep(self.lease_seconds / 3)
            try:
                await self.leases.renew(name, self.owner, token, self.lease_seconds)
            except Exception as exc:  # noqa: BLE001 - any failure means the lease may be gone
                log.warning("player lease %s was lost: %s", name, exc)
                run.lost_lease = True
                if run.job is not None:
                    run.job.cancel()
                return

    async def _release(
        self, player_id: str, token: int, taken: int, after: asyncio.Future[Any] | None
    ) -> None:
        assert self.leases is not None
        if after is not None:
            # Until the run's history write is stored, no other replica may start a run of
            # this player that could read the history without it.
            await asyncio.wait([after])
        if self._taken.get(player_id) != taken:
            # This replica took the lease again meanwhile (the player's next request): storage
            # would refuse the older token's release anyway, and sending it would only wait on
            # the lease row the newer acquisition holds. The newer run releases it.
            return
        del self._taken[player_id]
        await self._release_now(lease_name(player_id), token)
