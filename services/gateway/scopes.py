"""Players belong to game servers (decision 0012).

A game server names its players by its own ids (a Minecraft UUID, say). Two servers may use
the same id for different people, and one server must never reach another's players, so the
gateway never hands a game server's id to another service as is: every PlayerContext it sends
downstream carries a *scoped* id, `<scope>/<player id>`, where the scope is the server's id or,
for a server the operator put in a network, the network's name. Storage, engine and router key
everything on that id (history, preferences, leases, tasks, intent caches) and need no change;
the gateway maps it back to the game server's own id on every frame it writes to one.

Scope names are 1..27 of `A-Z a-z 0-9 _ . -` (checked at start, `GatewayConfig.player_scopes`),
so the first `/` ends the scope and a 36-character UUID always fits storage's 64 characters;
a game server's player ids may hold any printable character, up to what is left of the 64.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["MAX_SCOPED_ID", "SEPARATOR", "PlayerScopes", "split"]

SEPARATOR = "/"
MAX_SCOPED_ID = 64
"""Storage's bound on a player id, which a scoped id must keep."""


def split(scoped_id: str) -> tuple[str, str] | None:
    """(scope, the game server's player id), or None for an id the gateway did not make."""
    scope, sep, player_id = scoped_id.partition(SEPARATOR)
    if not sep or not scope or not player_id:
        return None
    return scope, player_id


class PlayerScopes:
    """The scope of each game server's players.

    Args:
        scopes: server id → its network's name, or its own id for a server in no network.
    """

    def __init__(self, scopes: Mapping[str, str]) -> None:
        self._scopes = dict(scopes)

    def scope_of(self, server_id: str) -> str:
        """The scope of the server's players ("" for a server this gateway does not know)."""
        return self._scopes.get(server_id, "")

    def scoped(self, server_id: str, player_id: str) -> str:
        """The id other services know the server's player by."""
        return f"{self._scopes[server_id]}{SEPARATOR}{player_id}"

    def max_player_id(self, server_id: str) -> int:
        """The longest player id the server may use (what its scope leaves of 64)."""
        return MAX_SCOPED_ID - len(self._scopes[server_id]) - len(SEPARATOR)
