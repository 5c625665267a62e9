"""A throwaway PostgreSQL cluster: for the project's own tests and scripts, and
for users who want a real PostgreSQL in their tests.

    from ironflow.testing import ThrowawayPostgres

    with ThrowawayPostgres() as pg:          # initdb + pg_ctl start, ≈0.7 s
        url = pg.new_database()              # postgresql://postgres@127.0.0.1:PORT/t_…
        ...                                  # open_store(url), a node's --db, …
    # stopped, its directory removed

It needs the PostgreSQL server binaries (``initdb``, ``pg_ctl``): Debian's
``/usr/lib/postgresql/<version>/bin`` (newest version first) or ``PATH``. As
root they are run as the ``postgres`` user (``runuser``), since PostgreSQL
refuses to run as root. The cluster trusts every local connection and, by default, runs
with ``fsync=off``: for tests only, never for data you want to keep.
``ThrowawayPostgres(durable=True)`` keeps PostgreSQL's default durability
(``fsync`` and ``synchronous_commit`` on): the setting for benchmarks.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from types import TracebackType

__all__ = ["ThrowawayPostgres"]

# Debian/Ubuntu install each server version's binaries here, not on PATH.
PG_BIN_GLOB = "/usr/lib/postgresql/*/bin"
# Short, under /tmp: the server's Unix socket lives in this dir (paths ≤ 107 bytes).
TEMP_DIR, TEMP_PREFIX = "/tmp", "pgt."
# The superuser initdb creates; every connection is trusted, so no password.
SUPERUSER = "postgres"
# OS user that runs initdb/postgres when we are root (they refuse to run as root).
OS_USER = "postgres"
# Server settings: TCP on loopback only; enough connections for several nodes'
# pools plus parallel tests.
SERVER_OPTIONS = "-c listen_addresses=127.0.0.1 -c max_connections=200"
# Added unless ``durable``: no fsync (throwaway data, much faster).
NO_FSYNC_OPTIONS = "-c fsync=off"
# Seconds pg_ctl waits for the server to accept connections.
START_TIMEOUT_S = 30
# What to tell a user whose machine lacks the server binaries.
INSTALL_HINT = "apt-get install postgresql-15, after apt-get update"


class ThrowawayPostgres:
    """A private PostgreSQL cluster in a temp dir, on a free loopback port.

    ``start()`` returns the server URL without a database part
    (``postgresql://postgres@127.0.0.1:PORT``); ``new_database()`` creates an
    empty database on it and returns that database's URL; ``stop()`` stops
    the server and removes its directory. Also a context manager.

    ``base_dir`` (set by ``start()``) is the temp dir holding the data, the
    server log and the socket: a caller with its own clean-up-on-signal list
    may register it there.

    ``url``: an existing server (``postgresql://user@host:port``) to use
    instead of starting one, e.g. from an environment variable in CI;
    ``start()`` then only returns it, ``stop()`` leaves it alone and
    ``new_database()`` creates its databases there.

    ``durable``: keep PostgreSQL's default ``fsync``/``synchronous_commit``
    (benchmarks) instead of the tests' ``fsync=off``. ``server_options``: more
    ``-c name=value`` settings for the server (e.g. a preloaded extension).
    """

    def __init__(
        self, url: str | None = None, *, durable: bool = False, server_options: str = ""
    ) -> None:
        self.durable = durable
        self.server_options = server_options
        self.base_dir = ""
        self.url = (url or "").rstrip("/")
        self._pg_ctl = ""
        self._started = False

    # ── lifecycle ────────────────────────────────────────────────────────────

    def start(self) -> str:
        """initdb and start the cluster; returns its URL (no database part).

        Raises ``RuntimeError`` when the server binaries are missing or the
        server fails to start (then nothing is left behind).
        """
        if self.url:
            return self.url  # an existing server, or already started
        if self.base_dir:
            raise RuntimeError("a stopped ThrowawayPostgres cannot be started again")
        bin_dir = _find_bin_dir()
        self.base_dir = tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=TEMP_DIR)
        try:
            if os.geteuid() == 0:
                shutil.chown(self.base_dir, OS_USER, OS_USER)
            data = f"{self.base_dir}/data"
            port = _free_port()
            _run([str(bin_dir / "initdb"), "-D", data, "-U", SUPERUSER, "-A", "trust",
                  "-E", "UTF8", "--no-sync"])
            self._pg_ctl = str(bin_dir / "pg_ctl")
            self._started = True
            log = Path(self.base_dir, "log")
            _run([self._pg_ctl, "-D", data, "-l", str(log), "-w", "-t", str(START_TIMEOUT_S),
                  "start", "-o", f"-p {port} -k {self.base_dir} {self._options()}"], log=log)
        except BaseException:
            self.stop()
            raise
        self.url = f"postgresql://{SUPERUSER}@127.0.0.1:{port}"
        return self.url

    def _options(self) -> str:
        durability = "" if self.durable else NO_FSYNC_OPTIONS
        return " ".join(o for o in (SERVER_OPTIONS, durability, self.server_options) if o)

    def stop(self) -> None:
        """Stop the server (fast shutdown) and remove its directory. Idempotent."""
        if self._started:
            self._started = False
            subprocess.run(_as_os_user([self._pg_ctl, "-D", f"{self.base_dir}/data",
                                        "-m", "fast", "-w", "stop"]),
                           cwd="/", capture_output=True)
        if self.base_dir:  # ours (not a server given as ``url``)
            shutil.rmtree(self.base_dir, ignore_errors=True)
            self.url = ""

    def halt(self, mode: str = "immediate") -> None:
        """Stop the server (``pg_ctl -m immediate`` by default: a crash, no
        checkpoint; ``fast`` disconnects clients first) and keep its data and
        port: :meth:`resume` starts it again at the same URL (outage tests)."""
        if not self._started:
            raise RuntimeError("halt() of a server this object did not start")
        _run([self._pg_ctl, "-D", f"{self.base_dir}/data", "-m", mode, "-w", "stop"])

    def resume(self) -> None:
        """Start a server stopped by :meth:`halt` again, on the same port."""
        port = self.url.rsplit(":", 1)[1]
        log = Path(self.base_dir, "log")
        _run([self._pg_ctl, "-D", f"{self.base_dir}/data", "-l", str(log), "-w", "-t",
              str(START_TIMEOUT_S), "start", "-o", f"-p {port} -k {self.base_dir} {self._options()}"],
             log=log)

    def __enter__(self) -> ThrowawayPostgres:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # ── databases ────────────────────────────────────────────────────────────

    def new_database(self, prefix: str = "t") -> str:
        """Create an empty database named ``<prefix>_<random hex>``; returns its URL."""
        import psycopg
        from psycopg import sql

        if not self.url:
            raise RuntimeError("ThrowawayPostgres.new_database() before start()")
        name = f"{prefix}_{os.urandom(6).hex()}"
        with psycopg.connect(f"{self.url}/postgres", autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return f"{self.url}/{name}"


# ── helpers ──────────────────────────────────────────────────────────────────


def _find_bin_dir() -> Path:
    """The folder holding ``initdb``: newest Debian versioned folder, else PATH."""

    def version(d: str) -> tuple[int, ...]:
        name = Path(d).parent.name  # /usr/lib/postgresql/<15 or 9.6>/bin
        return tuple(int(p) for p in name.split(".") if p.isdigit())

    for candidate in sorted(glob.glob(PG_BIN_GLOB), key=version, reverse=True):
        if (Path(candidate) / "initdb").exists():
            return Path(candidate)
    on_path = shutil.which("initdb")
    if on_path:
        return Path(on_path).parent
    raise RuntimeError(
        f"PostgreSQL server binaries not found (no initdb under {PG_BIN_GLOB} or on PATH)."
        f" Install them ({INSTALL_HINT})."
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _as_os_user(args: list[str]) -> list[str]:
    return ["runuser", "-u", OS_USER, "--", *args] if os.geteuid() == 0 else args


def _run(args: list[str], log: Path | None = None) -> None:
    """Run a server binary from ``/`` (the postgres user may not read our cwd).

    On failure raise ``RuntimeError`` with its output and the tail of ``log``
    (the server log, removed with the cluster's directory right after).
    """
    with subprocess.Popen(_as_os_user(args), cwd="/", stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True) as proc:
        try:
            out = proc.communicate()[0].strip()
        except BaseException:  # e.g. Ctrl-C: let it clean up before we remove its dir
            proc.terminate()  # runuser passes SIGTERM on to the binary
            proc.wait()
            raise
    if proc.returncode != 0:
        if log is not None and log.exists():
            out += "\nserver log:\n" + log.read_text(errors="replace").strip()
        raise RuntimeError(f"{Path(args[0]).name} failed (exit {proc.returncode}):\n{out[-3000:]}")
