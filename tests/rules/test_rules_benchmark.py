"""``bench/rules.py``, the scale benchmark of the rules, on a tiny fleet: it reports the CPU of the
groups asked for, and says plainly, without a traceback, when the fleet's targets do not all come up."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import yaml
from rules_promtool import GENERATED

from gpuhealth.local.process import wait_until

BENCH = Path(__file__).resolve().parents[2] / "bench" / "rules.py"


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(BENCH), "--nodes", "2", *args], capture_output=True,
                          text=True, timeout=300, stdin=subprocess.DEVNULL)


@pytest.mark.slow
def test_cpu_is_measured_for_the_groups_asked_for():
    pattern = "temperature-drift|evidence-temperature-baseline"
    run = _bench("--minutes", "0.2", "--repeats", "2", "--idle-seconds", "1", "--groups", pattern)
    assert run.returncode == 0, run.stdout + run.stderr
    evidence = yaml.safe_load((GENERATED / "gpuhealth" / "evidence.yml").read_text())
    wanted = [g["name"] for g in evidence["groups"] if re.search(pattern, g["name"])]
    cpu = run.stdout.split("CPU s per evaluation of", 1)[1]
    measured = re.findall(r"^(gpuhealth-\S+)\s+\d+\.\d{3}\s", cpu, re.MULTILINE)
    assert measured == wanted and len(wanted) > 1
    assert re.search(r"background CPU with nothing asked \(1 s\): \d+\.\d{3} CPU s per s", run.stdout)
    assert "median, min and max of 2, interleaved" in run.stdout
    assert "all 2 targets up" in run.stdout
    assert re.search(r"recorded series: \d+ = [\d.]+ per GPU", run.stdout)
    assert re.search(r"groups at 1 s or more \(target < 1 s each\): ", run.stdout)


@pytest.mark.slow
def test_history_gives_the_thermal_groups_full_windows():
    """Two days of the 10-minute samples and hourly daily means, written as blocks before Prometheus
    starts, are read by it (a daily mean needs half a day of samples: none without history), and the
    drift record reads them."""
    run = _bench("--minutes", "1.2", "--repeats", "1", "--idle-seconds", "1", "--history", "2",
                 "--groups", "temperature-drift-0$|cooling")
    assert run.returncode == 0, run.stdout + run.stderr
    assert re.search(r"history: 2 days of \S+peer_deviation_sampled, \S+peer_deviation_daily for 16 GPUs, "
                     r"5,376 samples written", run.stdout), run.stdout
    for record in ("sampled", "daily"):
        assert re.search(rf":peer_deviation_{record}\s+16$", run.stdout, re.MULTILINE), run.stdout
    assert re.search(r":peer_deviation_drift\s+\d+$", run.stdout, re.MULTILINE), run.stdout
    cooling = re.search(r"^gpuhealth-definitive-cooling(-\d+)?\s+\d+\.\d{3}\s", run.stdout, re.MULTILINE)
    assert cooling, run.stdout


def test_negative_history_is_a_usage_error():
    run = _bench("--history", "-1")
    assert run.returncode == 2 and "--history: days of history, 0 or more" in run.stderr


@pytest.mark.slow
def test_targets_that_do_not_come_up_are_a_clear_error():
    run = _bench("--start-timeout", "0")
    assert run.returncode == 2
    assert "error: only 0 of 2 synthetic nodes scraped within 0s" in run.stderr
    assert "Traceback" not in run.stdout + run.stderr


def test_a_bad_group_pattern_is_a_usage_error():
    run = _bench("--groups", "(")
    assert run.returncode == 2 and "--groups: not a regular expression" in run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_benchmark_says_so_in_one_line_and_stops_prometheus(tmp_path, signum):
    output = tmp_path / "bench.out"
    with output.open("wb") as sink:
        bench = subprocess.Popen([sys.executable, str(BENCH), "--nodes", "2", "--minutes", "10"], stdout=sink,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_until(lambda: "all 2 targets up" in output.read_text() or bench.poll() is not None,
                   timeout=240, interval=0.5, what="the benchmark running its fleet")
        started = psutil.Process(bench.pid).children(recursive=True)
        assert any(p.name() == "prometheus" for p in started), [p.cmdline() for p in started]
        bench.send_signal(signum)
        assert bench.wait(timeout=120) == 130
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    wait_until(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in started),
               timeout=30, what="Prometheus stopped")
    text = output.read_text()
    assert "Traceback" not in text
    assert text.rstrip().endswith("interrupted: Prometheus and the synthetic fleet are stopped")
