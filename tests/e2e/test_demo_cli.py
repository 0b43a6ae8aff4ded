"""`gpuhealth demo` as a user runs it: Ctrl-C in the middle leaves no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gpuhealth.local.process import wait_until

pytestmark = pytest.mark.slow


def _processes_under(path: Path) -> list[str]:
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


def test_ctrl_c_mid_run_stops_every_process(tmp_path):
    workdir = tmp_path / "demo"
    gpuhealth = Path(sys.executable).with_name("gpuhealth")
    with subprocess.Popen([gpuhealth, "demo", "--headless", "--workdir", workdir],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        try:
            lines = []
            for line in proc.stdout:
                lines.append(line)
                if "baseline" in line:
                    break
            assert any("Prometheus" in line for line in lines), "".join(lines)
            assert len(_processes_under(workdir)) >= 5  # slurmctld, slurmd, exporters, Prometheus, ...
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=60) == 130
            assert "every demo process has been stopped" in proc.stdout.read()
        finally:
            if proc.poll() is None:
                proc.kill()
    wait_until(lambda: not _processes_under(workdir), timeout=10, what="demo processes to exit")
