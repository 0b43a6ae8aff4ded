"""The external checks of ``gpuhealth-validate``: DCGM's diagnostic and a site's own command.

Both run as an argv list (no shell parses anything), in their own process group with a deadline:
a diagnostic stuck in a hung driver is killed with everything it started, and the verdict still
comes back. Their output is kept for the verdict's detail, never mixed into its JSON.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass

from gpuhealth.exporter.validate_checks import Check

log = logging.getLogger(__name__)

OUTPUT_TAIL_CHARS = 400
OUTPUT_KEPT_BYTES = 64 * 1024  # of a command's output: a diagnostic that prints without end costs no more
EXIT_POLL_SECONDS = 0.2
# dcgmi diag levels: 1 quick (seconds), 2 medium (about 2 min), 3 long (about 30 min), 4 extended
DCGM_DEFAULT_TIMEOUT = {1: 120.0, 2: 600.0, 3: 3600.0, 4: 7200.0}


@dataclass(frozen=True)
class Outcome:
    exit_code: int | None  # None: did not start, or killed at the deadline
    output: str
    seconds: float
    problem: str = ""      # why there is no exit code
    timed_out: bool = False

    @property
    def tail(self) -> str:
        """The last non-empty output line, shortened and with control and escape characters written
        out: enough to say why it failed, and nothing a terminal would act on."""
        lines = [line.strip() for line in self.output.splitlines() if line.strip()]
        last = lines[-1][-OUTPUT_TAIL_CHARS:] if lines else ""
        return last if last.isprintable() else "".join(c if c.isprintable() else ascii(c)[1:-1] for c in last)


def run_command(argv: Sequence[str], timeout: float) -> Outcome:
    """Run ``argv`` with a deadline; its whole process group is killed when the deadline passes.

    Only the last ``OUTPUT_KEPT_BYTES`` of its output are kept, and the result comes when the command
    exits, even if something it started (in a session of its own) still holds its output open."""
    started = time.monotonic()
    try:
        proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
    except OSError as exc:
        return Outcome(None, "", 0.0, f"cannot run {argv[0]}: {exc.strerror or exc}")
    assert proc.stdout is not None
    with proc.stdout:
        kept, exited = _read_until_exit(proc, proc.stdout.fileno(), started + timeout)
    output = kept.decode(errors="replace")
    if not exited:
        with contextlib.suppress(ProcessLookupError):  # the group already ended
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.warning("command killed at its deadline argv0=%s timeout=%gs", argv[0], timeout)
        return Outcome(None, output, time.monotonic() - started, f"no result within {timeout:g} s (killed)",
                       timed_out=True)
    return Outcome(proc.returncode, output, time.monotonic() - started)


def _read_until_exit(proc: subprocess.Popen[bytes], fd: int, deadline: float) -> tuple[bytes, bool]:
    """The output's last ``OUTPUT_KEPT_BYTES`` until the output ends or the process has exited and
    left nothing more to read; whether it exited before ``deadline``."""
    kept = bytearray()
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while (left := deadline - time.monotonic()) > 0:
            if not selector.select(min(left, EXIT_POLL_SECONDS)):
                if proc.poll() is not None:
                    return bytes(kept), True  # exited; a descendant of its own holds the output open
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(max(deadline - time.monotonic(), 0))
                return bytes(kept), proc.returncode is not None
            kept += chunk
            del kept[:-OUTPUT_KEPT_BYTES]
    return bytes(kept), proc.poll() is not None


def _judge(name: str, what: str, outcome: Outcome, value: dict[str, object]) -> Check:
    value = {**value, "exit_code": outcome.exit_code, "seconds": round(outcome.seconds, 3)}
    if outcome.exit_code is None:
        return Check(name, False, f"{what}: {outcome.problem}", value)
    if outcome.exit_code != 0:
        tail = f": {outcome.tail}" if outcome.tail else ""
        return Check(name, False, f"{what} failed (exit {outcome.exit_code}){tail}", value)
    return Check(name, True, f"{what} passed", value)


def check_dcgm(level: int, dcgmi: str | None, timeout: float | None) -> Check:
    """``dcgmi diag -r LEVEL``; not applicable where DCGM is not installed."""
    binary = dcgmi or shutil.which("dcgmi")
    if binary is None:
        return Check("dcgm_diag", None, "dcgmi not installed: DCGM diagnostic skipped", {"level": level})
    outcome = run_command([binary, "diag", "-r", str(level)], timeout or DCGM_DEFAULT_TIMEOUT[level])
    return _judge("dcgm_diag", f"dcgmi diag -r {level}", outcome, {"level": level})


def check_site_command(argv: Sequence[str], timeout: float) -> Check:
    """The site's own test (an NCCL all-reduce, a burn-in): exit 0 passes."""
    outcome = run_command(argv, timeout)
    return _judge("site_command", os.path.basename(argv[0]), outcome, {"argv": list(argv)})
