"""The demo's training job: steps, checkpoints at a fixed interval, resumes from the newest one.

It stands in for a real training loop wherever the local Slurm cluster runs one (the demo, the
end-to-end tests), so that what recovery saves can be measured: a checkpoint signal (``scancel
--signal=USR1 --batch JOB``) writes a checkpoint at the next step boundary and logs it, and a
requeued run starts again from the newest checkpoint, so the work lost is the steps since then.
SIGTERM (Slurm's requeue or cancel) ends the run without a checkpoint, as a hard failure would.

Checkpoints are ``step-<step>.json`` files, written to a temporary name and renamed, so a run killed
mid-write never leaves a torn newest checkpoint; the oldest beyond ``--keep`` are removed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

PROG = "gpuhealth-training-job"
PATTERN = "step-*.json"


@dataclass(frozen=True)
class Checkpoint:
    step: int
    written_at: float  # Unix time
    reason: str        # interval, signal or final
    path: Path


def checkpoint_dir(base: Path, job_id: str | None = None) -> Path:
    """Where a job keeps its checkpoints: one folder per Slurm job, the same after a requeue."""
    return base / "checkpoints" / f"job-{job_id or os.environ.get('SLURM_JOB_ID') or 'local'}"


def checkpoints(folder: Path) -> list[Checkpoint]:
    """Every readable checkpoint, oldest step first; unreadable or foreign files are skipped."""
    found = []
    for path in folder.glob(PATTERN):
        try:
            data = json.loads(path.read_text())
            found.append(Checkpoint(int(data["step"]), float(data["written_at"]), str(data["reason"]), path))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return sorted(found, key=lambda checkpoint: checkpoint.step)


def newest_checkpoint(folder: Path) -> Checkpoint | None:
    found = checkpoints(folder)
    return found[-1] if found else None


def write_checkpoint(folder: Path, step: int, reason: str, keep: int) -> Checkpoint:
    """Write atomically (temporary file, fsync, rename), then drop the oldest beyond ``keep``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step-{step:010d}.json"
    tmp = folder / f".{path.name}.tmp"
    written_at = time.time()
    with tmp.open("w") as fh:
        json.dump({"step": step, "written_at": written_at, "reason": reason}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    tmp.replace(path)
    for old in checkpoints(folder)[:-keep]:
        old.path.unlink(missing_ok=True)
    return Checkpoint(step, written_at, reason, path)


def log(event: str, **fields: object) -> None:
    """One key=value line on stdout: the Slurm job's output file."""
    text = " ".join(f"{key}={value}" for key, value in fields.items())
    print(f"ts={time.time():.3f} job={PROG} event={event} {text}".rstrip(), flush=True)


def logged(output: Path, event: str, **fields: str) -> list[float]:
    """When the job logged ``event`` with these ``fields`` (``log``'s lines in its output file), in
    order; none if the file is missing."""
    try:
        lines = output.read_text().splitlines()
    except OSError:
        return []
    wanted = {"event": event, **fields}
    found = []
    for line in lines:
        pairs = dict(word.split("=", 1) for word in line.split() if "=" in word)
        if "ts" in pairs and all(pairs.get(key) == value for key, value in wanted.items()):
            found.append(float(pairs["ts"]))
    return found


def signal_number(name: str) -> signal.Signals:
    try:
        return signal.Signals[name.upper() if name.upper().startswith("SIG") else f"SIG{name.upper()}"]
    except KeyError:
        raise argparse.ArgumentTypeError(f"unknown signal {name!r} (e.g. USR1, USR2)") from None


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return int(text)


class TrainingJob:
    """The loop, and what its signal handlers need to know about it."""

    def __init__(self, folder: Path, interval: float, step_seconds: float, steps: int, keep: int) -> None:
        self.folder, self.interval, self.step_seconds = folder, interval, step_seconds
        self.steps, self.keep = steps, keep
        self.step = self.saved_step = 0
        self.requested: float | None = None  # Unix time of a pending checkpoint signal

    def request_checkpoint(self, signum: int, frame: FrameType | None = None) -> None:
        """Signal handler: only note the request; the loop writes it at the next step boundary."""
        self.requested = time.time()

    def terminate(self, signum: int, frame: FrameType | None = None) -> None:
        """SIGTERM: end without a checkpoint; the steps since the last one are lost."""
        log("terminated", signal=signal.Signals(signum).name, step=self.step,
            lost_steps=self.step - self.saved_step)
        sys.exit(128 + signum)

    def _save(self, reason: str) -> Checkpoint:
        saved = write_checkpoint(self.folder, self.step, reason, self.keep)
        self.saved_step = self.step
        return saved

    def run(self) -> int:
        resumed = newest_checkpoint(self.folder)
        self.step = self.saved_step = resumed.step if resumed else 0
        if resumed:
            log("resume", step=self.step, checkpoint=resumed.path, written_at=f"{resumed.written_at:.3f}")
        else:
            log("start", step=0, checkpoint_dir=self.folder)
        last = time.monotonic()
        while self.steps == 0 or self.step < self.steps:
            time.sleep(self.step_seconds)  # one training step
            self.step += 1
            if self.requested is not None:
                asked, self.requested = self.requested, None
                saved = self._save("signal")
                log("checkpoint", reason="signal", step=self.step, path=saved.path,
                    after_signal_seconds=f"{saved.written_at - asked:.3f}")
                last = time.monotonic()
            elif time.monotonic() - last >= self.interval:
                saved = self._save("interval")
                log("checkpoint", reason="interval", step=self.step, path=saved.path)
                last = time.monotonic()
        saved = self._save("final")
        log("done", step=self.step, path=saved.path)
        return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="A stand-in training job: counts steps, checkpoints every --interval seconds and "
                    "at once on --signal, and resumes from its newest checkpoint when started again "
                    "(after a Slurm requeue).")
    add = parser.add_argument
    add("--checkpoint-dir", type=Path, metavar="DIR",
        help="where checkpoints go (default: checkpoints/job-$SLURM_JOB_ID in the working folder)")
    add("--interval", type=_positive, default=30.0, metavar="SECONDS",
        help="checkpoint interval (default 30)")
    add("--step-seconds", type=_positive, default=0.2, metavar="SECONDS",
        help="length of one training step: a signalled checkpoint is written within one step "
             "(default 0.2)")
    add("--steps", type=_count, default=0, metavar="N", help="steps to train in all, resumed ones included "
        "(0: until cancelled)")
    add("--signal", type=signal_number, default="USR1", metavar="NAME",
        help="signal that asks for a checkpoint now (default USR1)")
    add("--keep", type=_count, default=3, metavar="N", help="checkpoints kept, at least 1 (default 3)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.keep < 1:
        parser.error("--keep must be at least 1: the newest checkpoint is what a requeue resumes from")
    if args.signal in (signal.SIGTERM, signal.SIGKILL, signal.SIGSTOP):
        parser.error(f"--signal {args.signal.name} cannot ask for a checkpoint: SIGTERM ends the run, "
                     "SIGKILL and SIGSTOP cannot be caught")
    folder = args.checkpoint_dir or checkpoint_dir(Path.cwd())
    job = TrainingJob(folder, args.interval, args.step_seconds, args.steps, args.keep)
    signal.signal(args.signal, job.request_checkpoint)
    signal.signal(signal.SIGTERM, job.terminate)
    try:
        return job.run()
    except OSError as exc:
        print(f"{PROG}: cannot write checkpoints in {folder}: {exc.strerror or exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
