"""A throw-away PostgreSQL cluster on loopback (initdb + postgres), for tests and benchmarks.

PostgreSQL refuses to run as root, so when started by root the cluster belongs to the
``postgres`` account and lives in its own folder under the system temporary directory (a
pytest folder under /tmp/pytest-of-root is not reachable by that account).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import Self

from gpuhealth.local.process import ManagedProcess, ProcessError, free_port

BINDIR_CANDIDATES = tuple(sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True))


def bindir() -> Path | None:
    """Where ``initdb``, ``postgres`` and ``pg_isready`` are: Debian's versioned folder (newest first),
    else PATH."""
    found = next((d for d in BINDIR_CANDIDATES if (d / "pg_isready").exists()), None)
    if found is None and (on_path := shutil.which("pg_isready")):
        found = Path(on_path).parent
    return found


class LocalPostgres:
    def __init__(self, log_path: Path, port: int | None = None) -> None:
        found = bindir()
        if found is None:
            raise ProcessError("PostgreSQL is not installed (Debian package postgresql)")
        self.bindir = found
        self.port = port or free_port()
        self.log_path = log_path
        self.root = Path(tempfile.mkdtemp(prefix="gpuhealth-pg-"))
        self.data = self.root / "data"
        self._as: list[str] = []
        if os.geteuid() == 0:
            account = pwd.getpwnam("postgres")
            os.chown(self.root, account.pw_uid, account.pw_gid)
            self._as = ["setpriv", f"--reuid={account.pw_uid}", f"--regid={account.pw_gid}", "--clear-groups"]
        try:
            subprocess.run([*self._as, str(self.bindir / "initdb"), "-D", str(self.data), "-U", "gpuhealth",
                            "--auth=trust", "-E", "UTF8", "--no-sync"],
                           check=True, capture_output=True, cwd=self.root)
        except BaseException:  # a failed or interrupted initdb leaves no folder behind
            shutil.rmtree(self.root, ignore_errors=True)
            raise
        self.process: ManagedProcess | None = None

    @property
    def url(self) -> str:
        return f"postgresql://gpuhealth@127.0.0.1:{self.port}/postgres"

    def start(self) -> Self:
        self.process = ManagedProcess(
            "postgres", [*self._as, self.bindir / "postgres", "-D", self.data, "-h", "127.0.0.1",
                         "-p", str(self.port), "-k", self.root, "-c", "max_connections=200"],
            self.log_path, cwd=self.root).start()
        self.process.wait_ready(self._accepting, timeout=60)
        return self

    def _accepting(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                pass
        except OSError:
            return False
        done = subprocess.run([str(self.bindir / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port)],
                              capture_output=True, check=False)
        return done.returncode == 0

    def stop(self) -> None:
        """Fast shutdown (SIGINT): sessions are cut, as clients see when the server goes away."""
        proc = self.process.proc if self.process is not None else None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
        if self.process is not None:
            self.process.stop(grace=10)

    def restart(self) -> None:
        self.stop()
        self.start()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)
