"""The demo's training job on its own: a checkpoint signal writes a checkpoint at once, a restart
resumes from the newest checkpoint, SIGTERM loses the steps since the last one; then under real
Slurm, signalled with scancel and requeued."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuhealth.local.process import wait_until
from gpuhealth.local.slurm import SlurmCluster
from gpuhealth.local.training_job import checkpoints, newest_checkpoint

JOB = [sys.executable, "-m", "gpuhealth.local.training_job"]


def start(folder: Path, log: Path, *args: str) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen([*JOB, "--checkpoint-dir", str(folder), *args], stdout=out,
                                stderr=subprocess.STDOUT)


def events(log: Path, event: str) -> list[dict[str, str]]:
    """The job's key=value log lines of one event."""
    found = []
    for line in log.read_text().splitlines():
        fields = dict(part.split("=", 1) for part in line.split() if "=" in part)
        if fields.get("event") == event:
            found.append(fields)
    return found


def test_a_signal_writes_a_checkpoint_newer_than_the_signal_at_once(tmp_path: Path) -> None:
    folder, log = tmp_path / "ckpt", tmp_path / "job.out"
    job = start(folder, log, "--interval", "3600", "--step-seconds", "0.05")
    try:
        wait_until(lambda: bool(events(log, "start")), 30, what="the job to start")
        signalled = time.time()
        job.send_signal(signal.SIGUSR1)
        wait_until(lambda: newest_checkpoint(folder) is not None, 30, what="the signalled checkpoint")
        saved = newest_checkpoint(folder)
        assert saved is not None and saved.reason == "signal"
        assert saved.written_at >= signalled and saved.path.stat().st_mtime >= signalled
        wait_until(lambda: bool(events(log, "checkpoint")), 30, what="the checkpoint to be logged")
        (logged,) = events(log, "checkpoint")
        assert logged["reason"] == "signal" and int(logged["step"]) == saved.step
        assert 0 <= float(logged["after_signal_seconds"]) < 5
    finally:
        job.kill()
        job.wait()


def test_a_restart_resumes_from_the_newest_checkpoint_and_sigterm_loses_what_followed(tmp_path: Path) -> None:
    folder, log = tmp_path / "ckpt", tmp_path / "job.out"
    folder.mkdir()
    (folder / "step-9999999999.json").write_text("{torn")  # a foreign or torn file is not a checkpoint
    job = start(folder, log, "--interval", "0.3", "--step-seconds", "0.02", "--keep", "2")
    try:
        wait_until(lambda: len(events(log, "checkpoint")) >= 3, 60, what="three interval checkpoints")
        job.send_signal(signal.SIGTERM)
        assert job.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        job.kill()
    (terminated,) = events(log, "terminated")
    saved = newest_checkpoint(folder)
    assert saved is not None and saved.reason == "interval"
    assert [c.reason for c in checkpoints(folder)] == ["interval", "interval"]  # --keep 2
    assert int(terminated["step"]) - int(terminated["lost_steps"]) == saved.step
    assert int(terminated["step"]) >= saved.step

    done = subprocess.run([*JOB, "--checkpoint-dir", str(folder), "--steps", str(saved.step + 5),
                           "--step-seconds", "0.01"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert f"event=resume step={saved.step} checkpoint={saved.path}" in lines[0]
    assert f"event=done step={saved.step + 5}" in lines[-1]
    newest = newest_checkpoint(folder)
    assert newest is not None and newest.reason == "final"


@pytest.mark.parametrize(("args", "message"), [
    (["--signal", "TERM"], "cannot ask for a checkpoint"),
    (["--signal", "NOPE"], "unknown signal"),
    (["--keep", "0"], "--keep must be at least 1"),
    (["--interval", "0"], "expected a positive number"),
    (["--steps", "-3"], "expected a whole number"),
])
def test_usage_errors_are_clear(tmp_path: Path, args: list[str], message: str) -> None:
    result = subprocess.run([*JOB, "--checkpoint-dir", str(tmp_path), *args], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_under_slurm_scancel_signal_checkpoints_and_a_requeue_resumes(tmp_path: Path) -> None:
    with SlurmCluster(tmp_path / "slurm", nodes=2) as cluster:
        job_id = cluster.submit_training_job(nodes=1, seconds=600, checkpoint_interval=3600,
                                             step_seconds=0.05)
        output = cluster.workdir / f"job-{job_id}.out"
        wait_until(lambda: output.exists() and bool(events(output, "start")), 60, what="the job to start")
        signalled = time.time()
        cluster.run("scancel", "--signal=USR1", "--batch", job_id)
        folder = cluster.checkpoint_dir(job_id)
        wait_until(lambda: newest_checkpoint(folder) is not None, 30, what="the signalled checkpoint")
        saved = newest_checkpoint(folder)
        assert saved is not None and saved.reason == "signal" and saved.written_at >= signalled

        cluster.scontrol("requeue", job_id)
        cluster.wait_job(job_id, lambda job: job.state == "PENDING", what="the requeue")
        cluster.scontrol("update", f"JobId={job_id}", "StartTime=now")  # skip Slurm's requeue delay here
        wait_until(lambda: bool(events(output, "resume")), 60, what="the requeued job to resume")
        (resumed,) = events(output, "resume")
        assert int(resumed["step"]) == saved.step and resumed["checkpoint"] == str(saved.path)
