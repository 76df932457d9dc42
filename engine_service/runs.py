"""The interactive runs in progress: one per player across replicas, duplicates, cancel.

A player has at most one interactive run at a time. On this replica an in-memory map keeps it
so (checked and set without awaiting, so no lock is needed); across replicas the run holds the
player's storage lease, owned by this replica and renewed while the run lasts.

A run that needs the lease (one that may write or reads the history:
`ModuleSpec.needs_player_lease`) is two storage calls (a `RunJournal`, JournalService in
production): `begin` takes the lease and reads what the run reads first (preferences, the
history tail its module declares), and `finish`, sent after the reply, stores the exchange in
history and gives the lease back in one transaction. Any other run is one call, the finish,
which only stores the exchange. A player's finishes go out one after the other, in the order
of the runs. So another replica can begin a run of the player only once this one's
exchange is stored, and this replica begins the player's next leased run only once its
`finish` has landed (the same owner could otherwise take its own lease again before the history
write).

- A request identical to the player's run in progress (same fingerprint: player, module,
  input and request text) is a duplicate: it waits for that run and gets its result.
- Any other request of the player while a run is in progress is BUSY (ResourceExhausted),
  here at once, on another replica once the lease has stayed held for `busy_wait`.
- Storage that cannot be reached for the lease is Unavailable: nothing runs (fail closed).
- `cancel` stops a run: its module task is cancelled and the run ends CANCELLED.

No gRPC here.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NamedTuple, Protocol

from system.common.v1 import common_pb2

from services.runtime import tracing
from services.runtime.context import current_request_id, request_scope
from services.runtime.errors import ResourceExhausted

__all__ = [
    "HistoryStore",
    "LocalRuns",
    "PlayerRuns",
    "Run",
    "RunJournal",
    "RunStart",
    "fingerprint",
]

log = logging.getLogger("system.engine")


class RunStart(NamedTuple):
    """What a run begins with: the lease it holds (its fencing token, 0 for none, and its name
    as storage gave it), whether the player keeps history, and the history tail asked for
    (None when none was asked for)."""

    token: int
    lease: str = ""
    history_enabled: bool = True
    history: Sequence[common_pb2.HistoryEntry] | None = None


class RunJournal(Protocol):
    """The storage side of interactive runs. `begin` raises ResourceExhausted while another
    owner holds the player's lease and Unavailable when storage cannot be asked."""

    async def begin(
        self, player_id: str, owner: str, lease_seconds: int, history_entries: int
    ) -> RunStart: ...

    async def renew(self, lease: str, owner: str, token: int, lease_seconds: int) -> None: ...

    async def finish(
        self, player_id: str, owner: str, token: int, entries: list[common_pb2.HistoryEntry]
    ) -> None: ...


class HistoryStore(Protocol):
    """A player's history: where a run reads pages beyond the tail it began with."""

    async def append_history(
        self, player_id: str, entries: list[common_pb2.HistoryEntry]
    ) -> None: ...

    async def list_history(
        self, player_id: str, page_size: int
    ) -> list[common_pb2.HistoryEntry]: ...


class LocalRuns:
    """A RunJournal for one engine alone, with no storage lease: the history goes to a
    HistoryStore (an engine embedded in a test or a tool, never a replica of a stack)."""

    def __init__(self, history: HistoryStore) -> None:
        self._history = history

    async def begin(
        self, player_id: str, owner: str, lease_seconds: int, history_entries: int
    ) -> RunStart:
        return RunStart(0)  # no tail: the run reads the history it needs when it needs it

    async def renew(self, lease: str, owner: str, token: int, lease_seconds: int) -> None:
        return None

    async def finish(
        self, player_id: str, owner: str, token: int, entries: list[common_pb2.HistoryEntry]
    ) -> None:
        if entries:
            await self._history.append_history(player_id, entries)


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
    # The exchange the run's finish stores in history (none for a cancelled run).
    entries: list[common_pb2.HistoryEntry] = dataclasses.field(default_factory=list)


def _detached(coro: Awaitable[Any]) -> asyncio.Task[Any]:
    """A task outside the request's context (its deadline must not cut lease upkeep or the
    finish short), still in the request's trace."""
    return asyncio.get_running_loop().create_task(coro, context=tracing.detached_context())  # type: ignore[arg-type]


class PlayerRuns:
    """The runs in progress on this replica, one per player.

    Args:
        journal: begins and finishes runs in storage.
        owner: this replica's lease owner (`<name>#<incarnation>`).
        lease_seconds: how long the player's lease lasts unless renewed.
        busy_wait: how long a run asks again for a lease another replica holds.
        finish_timeout: longest a run's finish (its history write) may take.
    """

    def __init__(
        self,
        journal: RunJournal,
        owner: str,
        lease_seconds: int,
        busy_wait: float = 0.5,
        finish_timeout: float = 2.0,
    ) -> None:
        self.journal = journal
        self.owner = owner
        self.lease_seconds = lease_seconds
        self.busy_wait = busy_wait
        self.finish_timeout = finish_timeout
        self._runs: dict[str, Run] = {}
        # Per player, the finish of their latest run while it travels (see _finished).
        self._finishing: dict[str, asyncio.Task[None]] = {}

    def running(self, player_id: str) -> Run | None:
        return self._runs.get(player_id)

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
        self,
        run: Run,
        history_entries: int,
        body: Callable[[RunStart], Awaitable[common_pb2.AgentResult]],
        leased: bool = True,
    ) -> common_pb2.AgentResult:
        """Begins the run in storage (the lease, and `history_entries` of history), runs
        `body` with what it began with while the lease is renewed, then finishes it in the
        background with `run.entries` (set by the body). Raises what `begin` raises; nothing
        runs then. Not `leased`: no begin and no lease (token 0); the finish only stores the
        exchange."""
        if not leased:
            # Reads nothing the previous run wrote: it need not wait for that finish (its own
            # finish does, below, so the history keeps the order of the exchanges).
            start = RunStart(0)
            keeper = None
        else:
            await self._finished(run.player_id)
            start = await self._begin(run.player_id, history_entries)
            keeper = _detached(self._keep(run, start))
        try:
            return await body(start)
        finally:
            if keeper is not None:
                keeper.cancel()
                with contextlib.suppress(BaseException):
                    await keeper
            # After the reply: the player's slot here frees at once, and the player's next
            # run waits for this finish before it begins (_finished).
            previous = self._finishing.get(run.player_id)
            self._finishing[run.player_id] = _detached(
                self._finish(
                    run.player_id, start.token, run.entries, current_request_id(), previous
                )
            )

    async def flush(self) -> None:
        """Waits for every finish in flight (at shutdown: exchanges already answered reach
        history, and another replica can take the players at once)."""
        while self._finishing:
            await asyncio.wait(list(self._finishing.values()))

    async def settle(self, player_id: str) -> bool:
        """Returns once every exchange of the player already answered is in history on any
        replica (begins and finishes an empty run), or False when a run of the player is in
        progress here, or still elsewhere after `busy_wait`. Raises Unavailable without
        storage."""
        if player_id in self._runs:
            return False
        await self._finished(player_id)
        try:
            start = await self._begin(player_id, 0)
        except ResourceExhausted:
            return False
        await self._finish(player_id, start.token, [])
        return True

    async def _finished(self, player_id: str) -> None:
        """Waits for the finish of the player's previous run on this replica, if in flight
        (bounded by finish_timeout; it never raises)."""
        finishing = self._finishing.get(player_id)
        if finishing is not None:
            await asyncio.wait([finishing])

    async def _finish(
        self,
        player_id: str,
        token: int,
        entries: list[common_pb2.HistoryEntry],
        request_id: str = "",
        after: asyncio.Task[None] | None = None,
    ) -> None:
        if after is not None:
            await asyncio.wait([after])  # the player's previous finish first (never raises)
        # The run's request id (its logs follow it into storage), without its deadline.
        with request_scope(request_id or None):
            await self._finish_in_scope(player_id, token, entries)

    async def _finish_in_scope(
        self, player_id: str, token: int, entries: list[common_pb2.HistoryEntry]
    ) -> None:
        try:
            await asyncio.wait_for(
                self.journal.finish(player_id, self.owner, token, entries), self.finish_timeout
            )
        except Exception as exc:  # noqa: BLE001 - the result is out; the lease expires alone
            log.warning("the run of player %s could not be finished in storage: %s", player_id, exc)
        finally:
            task = asyncio.current_task()
            if self._finishing.get(player_id) is task:
                del self._finishing[player_id]

    async def _begin(self, player_id: str, history_entries: int) -> RunStart:
        """Begins a run, asking again for up to `busy_wait` seconds while another replica
        holds the lease: a replica gives it back just after its reply (once the exchange is in
        history), so a player's next request that lands on another replica right away waits
        those milliseconds instead of being refused. A run really in progress elsewhere is
        BUSY after `busy_wait`."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.busy_wait
        delay = 0.005
        while True:
            try:
                return await self.journal.begin(
                    player_id, self.owner, self.lease_seconds, history_entries
                )
            except ResourceExhausted:
                if loop.time() + delay > give_up:
                    raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.1)

    async def _keep(self, run: Run, start: RunStart) -> None:
        """Renews the lease every third of its length; a lease that cannot be renewed stops
        the run (another replica may take the player once it expires)."""
        while True:
            await asyncio.sleep(self.lease_seconds / 3)
            try:
                await self.journal.renew(start.lease, self.owner, start.token, self.lease_seconds)
            except Exception as exc:  # noqa: BLE001 - any failure means the lease may be gone
                log.warning("the lease of player %s was lost: %s", run.player_id, exc)
                run.lost_lease = True
                if run.job is not None:
                    run.job.cancel()
                return
