"""The digest of a gateway replica's players, which the gateway and the storage service both
compute (system.storage.v1.PresenceService.RenewReplica): when they differ, the replica sends
its whole list once (SyncPlayers) instead of every renewal carrying it."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

__all__ = ["players_digest"]


def players_digest(player_ids: Iterable[str]) -> str:
    """Lowercase hex SHA-256 of the scoped player ids, sorted, each followed by a newline."""
    digest = hashlib.sha256()
    for player_id in sorted(set(player_ids)):
        digest.update(player_id.encode())
        digest.update(b"\n")
    return digest.hexdigest()
