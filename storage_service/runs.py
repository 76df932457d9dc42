"""The storage side of an interactive run: one call to begin it, one to finish it.

`begin_run` takes the player's lease and reads what the run needs first (preferences, the
history tail it asked for) in one transaction; `finish_run` appends the run's exchange to the
history and releases the lease in one transaction, so the lease is given back only once the
exchange is stored: a run that begins later, on any replica, reads it. Both are units (a
function of a session doing its work in the session's transaction), so the group committer
runs them beside the journal's other writes; every commit is synchronous.

Domain code: no gRPC here.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable

from sqlalchemy.orm import Session
from system.storage.v1 import journal_pb2

from services.runtime.errors import InvalidArgument
from storage_service.group_commit import Declared
from storage_service.history import ConversationStore
from storage_service.leases import acquire, check_holder, release
from storage_service.ledgers import Writes
from storage_service.validation import check_player_id

__all__ = ["MAX_HISTORY_ENTRIES", "RunStore", "player_lease"]

log = logging.getLogger("system.storage.runs")

MAX_HISTORY_ENTRIES = 100
"""Most history entries a run may read when it begins (ListHistory's largest page)."""


def player_lease(player_id: str) -> str:
    """The name of the lease that keeps one interactive run per player."""
    return f"player:{player_id}"


class RunStore:
    """BeginRun and FinishRun as units of work.

    Args:
        history: the conversation store whose rows and bounds the exchange is written with.
        now: the store's clock (UTC; the journal's, which tests move).
    """

    def __init__(self, history: ConversationStore, now: Callable[[], dt.datetime]) -> None:
        self._history = history
        self._now = now

    def begin_unit(
        self, request: journal_pb2.BeginRunRequest
    ) -> Callable[[Session], journal_pb2.BeginRunResponse]:
        """BeginRun's work for a transaction. The request is checked now: INVALID_ARGUMENT
        before any transaction."""
        check_player_id(request.player_id)
        if request.history_entries > MAX_HISTORY_ENTRIES:
            raise InvalidArgument(
                f"history_entries is {request.history_entries}; at most "
                f"{MAX_HISTORY_ENTRIES} entries may be read when a run begins"
            )
        player_id = request.player_id
        now = self._now()

        def unit(session: Session) -> journal_pb2.BeginRunResponse:
            lease = acquire(
                session, player_lease(player_id), request.owner, request.lease_seconds, now
            )
            response = journal_pb2.BeginRunResponse(
                lease=lease,
                preferences=self._history.preferences_in(session, player_id).message(),
            )
            if request.history_entries:
                response.history.extend(
                    self._history.tail_in(session, player_id, request.history_entries)
                )
            return response

        return Declared(unit, Writes(players=(player_id,)))

    def finish_unit(
        self, request: journal_pb2.FinishRunRequest
    ) -> Callable[[Session], journal_pb2.FinishRunResponse]:
        """FinishRun's work for a transaction. Entries that break the history's bounds are
        dropped here (said in `history_error`), so the lease is released all the same. Token
        0: the run held no lease; only its exchange is stored."""
        check_player_id(request.player_id)
        player_id = request.player_id
        entries = list(request.entries)
        lease = player_lease(player_id)
        if request.token:
            check_holder(lease, request.owner, request.token)
        rows = []
        error = ""
        if entries:
            try:
                rows = self._history.rows(player_id, entries)
            except InvalidArgument as exc:
                error = exc.message
                log.warning("the exchange of player %s was not recorded: %s", player_id, error)
        request_id = entries[-1].request_id if entries else ""

        def unit(session: Session) -> journal_pb2.FinishRunResponse:
            response = journal_pb2.FinishRunResponse(history_error=error)
            if rows and not (
                request_id and self._history.newest_request_id(session, player_id) == request_id
            ):
                recorded, evicted = self._history.append_in(session, player_id, rows)
                response.recorded, response.evicted = recorded, evicted
            if request.token:
                response.released = release(session, lease, request.owner, request.token)
            return response

        return Declared(unit, Writes(players=(player_id,)))
