"""``bench/webhook.py --journal postgres`` interrupted mid-run (Ctrl-C, or SIGTERM) stops the
PostgreSQL and every webhook it started, and removes their files."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from gpuhealth.local.postgres import bindir
from gpuhealth.local.process import wait_until

pytestmark = [pytest.mark.skipif(bindir() is None, reason="PostgreSQL is not installed"),
              pytest.mark.timeout(300)]

BENCH = Path(__file__).resolve().parents[2] / "bench" / "webhook.py"


def _gone(process: psutil.Process) -> bool:
    try:
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_benchmark_leaves_no_postgres_or_webhook_running(tmp_path, signum):
    output = tmp_path / "bench.out"
    with output.open("wb") as sink:
        argv = [sys.executable, str(BENCH), "--journal", "postgres", "--notifications", "100000"]
        bench = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True)
    try:
        wait_until(lambda: "intake, worker idle" in output.read_text() or bench.poll() is not None,
                   timeout=240, interval=0.5, what="the benchmark sending its load")
        assert bench.poll() is None, output.read_text()
        started = psutil.Process(bench.pid).children(recursive=True)
        commands = [" ".join(p.cmdline()) for p in started]
        postgres = [p for p in started if p.name() == "postgres"]
        webhooks = [c for c in commands if "gpuhealth.webhook.main" in c]
        assert postgres and len(webhooks) == 3, commands
        data = Path(next(m[1] for c in commands if (m := re.search(r"postgres -D (\S+)", c))))
        workdir = Path(next(m[1] for c in commands if (m := re.search(r"--config (\S+)/a/webhook.yaml", c))))
        assert data.exists() and workdir.exists()
        bench.send_signal(signum)
        assert bench.wait(timeout=120) == 130
    finally:
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)
            bench.wait()
    wait_until(lambda: all(_gone(p) for p in started), timeout=30, what="every server of the benchmark gone")
    assert "interrupted: every server it started is stopped" in output.read_text()
    assert not data.exists() and not workdir.exists()
