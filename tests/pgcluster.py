"""A private, throwaway PostgreSQL cluster for tests that must stop or restart the server.

The shared server named by TEST_POSTGRES_DSN must never be stopped, so fault tests make their
own: `initdb` into a temporary folder (trust authentication, superuser `postgres`), a free TCP
port on 127.0.0.1, the unix socket in the same folder, started and stopped with `pg_ctl`.

    with PgCluster.create() as cluster:      # skips the test when the binaries are missing
        url = cluster.create_database("storage")
        ...
        cluster.restart(down_seconds=1.0)

PostgreSQL refuses to run as root; when the tests run as root, every server command runs as
the `postgres` user (`runuser`), which owns the folder. The binaries come from `PG_BIN` if
set, else `pg_config --bindir`, else `/usr/lib/postgresql/<newest>/bin`, else `PATH`.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import pytest

from services.stack.launcher import free_port

__all__ = ["PgCluster", "find_pg_bin"]

_SUPERUSER = "postgres"


def find_pg_bin() -> Path | None:
    """The folder holding initdb, pg_ctl and postgres, or None."""
    candidates: list[Path] = []
    if os.environ.get("PG_BIN"):
        candidates.append(Path(os.environ["PG_BIN"]))
    pg_config = shutil.which("pg_config")
    if pg_config:
        try:
            out = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, check=True, timeout=10
            )
            candidates.append(Path(out.stdout.strip()))
        except (subprocess.SubprocessError, OSError):
            pass
    versions = sorted(
        Path("/usr/lib/postgresql").glob("*/bin"),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
        reverse=True,
    )
    candidates.extend(versions)
    initdb = shutil.which("initdb")
    if initdb:
        candidates.append(Path(initdb).parent)
    for folder in candidates:
        if all((folder / tool).is_file() for tool in ("initdb", "pg_ctl", "postgres")):
            return folder
    return None


class PgCluster:
    """One private PostgreSQL cluster. Use `create()`; always `cleanup()` (or `with`)."""

    def __init__(self, bin_dir: Path, root: Path, port: int, run_as: str | None) -> None:
        self.bin_dir = bin_dir
        self.root = root
        self.data_dir = root / "data"
        self.socket_dir = root / "sock"
        self.log_file = root / "server.log"
        self.port = port
        self._run_as = run_as

    @classmethod
    def create(cls, *, durable: bool = False) -> PgCluster:
        """initdb and start a cluster. Skips the calling test when PostgreSQL is not installed.

        Args:
            durable: keep fsync on. Off by default: these clusters die with the test, and the
                faults tested here stop the server cleanly, so fsync only costs time.
        """
        bin_dir = find_pg_bin()
        if bin_dir is None:
            pytest.skip(
                "PostgreSQL server binaries (initdb, pg_ctl, postgres) not found; install "
                "postgresql or set PG_BIN to their folder to run the PostgreSQL restart tests"
            )
        run_as: str | None = None
        if os.geteuid() == 0:
            try:
                pwd.getpwnam(_SUPERUSER)
            except KeyError:
                pytest.skip("running as root and there is no `postgres` user to run initdb as")
            if shutil.which("runuser") is None:
                pytest.skip("running as root and `runuser` is missing; cannot drop to postgres")
            run_as = _SUPERUSER
        root = Path(tempfile.mkdtemp(prefix="pgcluster-"))
        cluster = cls(bin_dir, root, free_port(), run_as)
        try:
            cluster.socket_dir.mkdir()
            if run_as:
                entry = pwd.getpwnam(run_as)
                for path in (root, cluster.socket_dir):
                    os.chown(path, entry.pw_uid, entry.pw_gid)
            cluster._run(
                "initdb",
                "-D",
                str(cluster.data_dir),
                "-U",
                _SUPERUSER,
                "--auth=trust",
                "--encoding=UTF8",
                "--locale=C",
                "--no-sync",
            )
            settings = {
                "listen_addresses": "'127.0.0.1'",
                "port": str(cluster.port),
                "unix_socket_directories": f"'{cluster.socket_dir}'",
                "max_connections": "100",
                "fsync": "on" if durable else "off",
                "full_page_writes": "on" if durable else "off",
                "logging_collector": "off",
            }
            with (cluster.data_dir / "postgresql.conf").open("a") as conf:
                conf.write("\n# tests/pgcluster.py\n")
                conf.writelines(f"{key} = {value}\n" for key, value in settings.items())
            cluster.start()
        except BaseException:
            cluster.cleanup()
            raise
        return cluster

    # -- commands ---------------------------------------------------------------------------

    def _run(self, tool: str, *args: str, timeout: float = 60) -> str:
        command = [str(self.bin_dir / tool), *args]
        if self._run_as:
            command = ["runuser", "-u", self._run_as, "--", *command]
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, cwd=self.root
        )
        if result.returncode != 0:
            raise RuntimeError(
                f"{tool} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}\n"
                f"{self.log_tail()}"
            )
        return result.stdout

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no server log)"

    def start(self) -> None:
        """Starts the server and waits until it accepts connections."""
        self._run("pg_ctl", "-D", str(self.data_dir), "-l", str(self.log_file), "-w", "start")

    def stop(self) -> None:
        """Stops the server: `-m fast` ends every session (their clients see AdminShutdown)
        and shuts down cleanly without waiting for them."""
        self._run("pg_ctl", "-D", str(self.data_dir), "-m", "fast", "-w", "stop")

    def restart(self, down_seconds: float = 0.0) -> None:
        """Stops (fast), stays down `down_seconds` so clients meet a refused connection, starts."""
        self.stop()
        if down_seconds:
            time.sleep(down_seconds)
        self.start()

    def is_running(self) -> bool:
        pid_file = self.data_dir / "postmaster.pid"
        return pid_file.exists()

    # -- addresses --------------------------------------------------------------------------

    def url(self, database: str = "postgres", driver: str = "postgresql") -> str:
        """SQLAlchemy URL over TCP (`postgresql://` is psycopg 3 for storage_service)."""
        return f"{driver}://{_SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def dsn(self, database: str = "postgres") -> str:
        """libpq connection string for psycopg."""
        return f"host=127.0.0.1 port={self.port} user={_SUPERUSER} dbname={database}"

    def create_database(self, name: str) -> str:
        """Creates a database and returns its URL."""
        import psycopg

        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    # -- teardown ---------------------------------------------------------------------------

    def cleanup(self) -> None:
        """Stops the server (immediate) if it runs and removes the folder. Safe to call twice."""
        if self.is_running():
            with contextlib.suppress(RuntimeError, subprocess.SubprocessError, OSError):
                self._run("pg_ctl", "-D", str(self.data_dir), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> PgCluster:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cleanup()
