"""What tests observe of an engine's transactions."""

from __future__ import annotations

from sqlalchemy import Engine, event


def transaction_ends(engine: Engine) -> list[str]:
    """Each transaction's end on `engine` from now on, "commit" or "rollback" (a group whose
    statements written together all held commits at its first try: ["commit"])."""
    ends: list[str] = []
    event.listen(engine, "commit", lambda _conn: ends.append("commit"))
    event.listen(engine, "rollback", lambda _conn: ends.append("rollback"))
    return ends
