"""The demo run as an operator runs it, in a process of its own: started, read up to its baseline, and
stopped with Ctrl-C, leaving no process behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from gpuhealth.local.process import wait_until


def processes_under(path: Path) -> list[str]:
    """Command lines of live processes that mention ``path`` (every daemon's config lives there)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(path) in cmdline:
            found.append(cmdline)
    return found


@contextlib.contextmanager
def demo_at_baseline(workdir: Path, *options: str) -> Iterator[tuple[subprocess.Popen[str], list[str]]]:
    """``gpuhealth demo --headless --workdir WORKDIR OPTIONS``, its output read up to the baseline line;
    the demo and every process under ``workdir`` are gone on leaving."""
    gpuhealth = Path(sys.executable).with_name("gpuhealth")
    with subprocess.Popen([gpuhealth, "demo", *options, "--headless", "--workdir", workdir],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        try:
            lines = []
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append(line)
                if "baseline" in line:
                    break
            yield proc, lines
        finally:
            if proc.poll() is None:
                proc.kill()
    wait_until(lambda: not processes_under(workdir), timeout=10, what="demo processes to exit")


def interrupt(proc: subprocess.Popen[str]) -> None:
    """Ctrl-C: the demo exits 130 having stopped every process it started."""
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=120)  # keep reading: a full pipe would block the demo
    assert proc.returncode == 130, rest
    assert "every demo process has been stopped" in rest
