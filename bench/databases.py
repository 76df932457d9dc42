"""Throwaway databases for benchmarks: a SQLite file in a folder, or a fresh PostgreSQL
database on BENCH_POSTGRES_DSN (else TEST_POSTGRES_DSN, else the local server), dropped after."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

__all__ = ["DEFAULT_DSN", "database"]

DEFAULT_DSN = "postgresql://127.0.0.1:5432/test"


@contextmanager
def database(backend: str, folder: Path, prefix: str = "bench") -> Iterator[str]:
    """The URL of an empty database for `backend` (`sqlite` or `postgres`)."""
    if backend == "sqlite":
        yield f"sqlite:///{folder / f'{prefix}.db'}"
        return
    dsn = os.environ.get("BENCH_POSTGRES_DSN") or os.environ.get("TEST_POSTGRES_DSN") or DEFAULT_DSN
    admin_url = make_url(dsn).set(drivername="postgresql+psycopg")
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield admin_url.set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
