"""The external checks of ``gpuhealth-validate``: DCGM's diagnostic and a site's own command.

Both run as an argv list (no shell parses anything), in their own process group with a deadline:
a diagnostic stuck in a hung driver is killed with everything it started, and the verdict still
comes back. Their output is kept for the verdict's detail, never mixed into its JSON.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass

from gpuhealth.exporter.validate_checks import Check

log = logging.getLogger(__name__)

OUTPUT_TAIL_CHARS = 400
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
        """The last non-empty output line, shortened: enough to say why it failed."""
        lines = [line.strip() for line in self.output.splitlines() if line.strip()]
        return lines[-1][-OUTPUT_TAIL_CHARS:] if lines else ""


def run_command(argv: Sequence[str], timeout: float) -> Outcome:
    """Run ``argv`` with a deadline; its whole process group is killed when the deadline passes."""
    started = time.monotonic()
    try:
        proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
    except OSError as exc:
        return Outcome(None, "", 0.0, f"cannot run {argv[0]}: {exc.strerror or exc}")
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):  # the group already ended
            os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        log.warning("command killed at its deadline argv0=%s timeout=%gs", argv[0], timeout)
        return Outcome(None, out.decode(errors="replace"), time.monotonic() - started,
                       f"no result within {timeout:g} s (killed)", timed_out=True)
    return Outcome(proc.returncode, out.decode(errors="replace"), time.monotonic() - started)


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
