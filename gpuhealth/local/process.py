"""A supervised child process: its own session, a log file, readiness waiting, and certain teardown."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Self

log = logging.getLogger(__name__)


class ProcessError(RuntimeError):
    """A daemon failed to start or become ready; the message carries the tail of its log."""


def _port_slice() -> range:
    """The ports ``free_port`` hands out in this process: below the kernel's ephemeral range (where
    every outgoing connection and every ``bind(0)`` takes its port, so a client socket or another
    process's probe never lands there) and, under pytest-xdist, this worker's own share of them."""
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    low, high = 10000, ephemeral_low
    if high - low < 1000:  # a site that widened the ephemeral range: nothing is left below it
        return range(0)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0) % max(workers, 1)
    share = (high - low) // max(workers, 1)
    return range(low + share * worker, low + share * (worker + 1))


_SLICE = _port_slice()
_cursor = itertools.count(os.getpid())  # two processes outside pytest start far apart


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that is free on ``host`` right now and unlikely to be taken before the
    daemon it is meant for binds it: ports come from ``_port_slice`` in turn, never twice in a row."""
    for _ in range(len(_SLICE)):
        port = _SLICE[next(_cursor) % len(_SLICE)]
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # no slice, or all of it in use
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.1, what: str = "") -> None:
    """Poll ``predicate`` until it is true; raise ``TimeoutError`` naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what or predicate}")
        time.sleep(interval)


def http_ok(url: str, timeout: float = 1.0) -> bool:
    """True when ``url`` answers 2xx; connection errors count as not ready."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return 200 <= resp.status < 300
    except (urllib.error.URLError, OSError):
        return False


class ManagedProcess:
    """A child in its own process group, so that stopping it also stops anything it spawned."""

    def __init__(self, name: str, argv: Sequence[str | os.PathLike[str]], log_path: Path,
                 env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
        self.name = name
        self.argv = [str(a) for a in argv]
        self.log_path = Path(log_path)
        self.env = env
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Self:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        logfile = self.log_path.open("ab")
        log.info("starting name=%s argv=%s", self.name, " ".join(self.argv))
        try:
            self.proc = subprocess.Popen(
                self.argv, stdout=logfile, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.env, cwd=self.cwd, start_new_session=True,
            )
        except FileNotFoundError as exc:
            raise ProcessError(f"{self.name}: cannot run {self.argv[0]!r}: {exc.strerror}") from None
        finally:
            logfile.close()
        return self

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_ready(self, predicate: Callable[[], bool], timeout: float = 30.0) -> None:
        """Wait for readiness; fail fast, with the log tail, if the process exits first."""
        def ready() -> bool:
            if not self.running:
                raise ProcessError(f"{self.name} exited with {self.proc.returncode if self.proc else '?'}:\n"
                                   f"{self.log_tail()}")
            return predicate()
        try:
            wait_until(ready, timeout, what=f"{self.name} to become ready")
        except TimeoutError as exc:
            raise ProcessError(f"{exc}\n{self.log_tail()}") from None

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM the whole group, then SIGKILL after ``grace`` seconds. Safe to call twice."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # stragglers left in the group

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
