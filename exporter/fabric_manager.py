"""Whether the NVSwitch fabric manager runs, asked of systemd, else read from its pid file.

Without the fabric manager, GPUs of an NVSwitch node cannot use NVLink (CUDA reports them
uninitialised). ``systemctl show`` tells a unit that is not installed (``LoadState=not-found``) from
one that is stopped, which ``systemctl is-active`` cannot (both print ``inactive``): a host without
the fabric manager publishes nothing rather than 0. The call runs on its own worker thread under a
deadline, so a hung systemd never holds up the sampling loop; the answer is used when it arrives.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

from gpuhealth.exporter.fabric_settings import FabricSettings
from gpuhealth.exporter.guard import GuardedWorker
from gpuhealth.exporter.sysfs_fabric import ReadErrors
from gpuhealth.exporter.validate_commands import run_command

log = logging.getLogger(__name__)

ASK_EVERY_SECONDS = 30.0  # the fabric manager rarely changes state; a process start costs milliseconds
DEADLINE_SECONDS = 5.0
ACTIVE_STATES = ("active", "reloading")


def parse_show(text: str) -> tuple[str, str]:
    """(LoadState, ActiveState) from ``systemctl show --property=LoadState,ActiveState``."""
    values = dict(line.partition("=")[::2] for line in text.splitlines())
    return values.get("LoadState", ""), values.get("ActiveState", "")


class FabricManagerProbe:
    """``poll()`` -> True (active), False (installed but not active), None (no fabric manager here)."""

    def __init__(self, settings: FabricSettings, procfs: Path, clock: Callable[[], float],
                 deadline: float = DEADLINE_SECONDS) -> None:
        self.settings = settings
        self.deadline = deadline
        self.procfs = procfs
        self.clock = clock
        self.up: bool | None = None
        self.errors: ReadErrors = ReadErrors()  # filled on the worker, read on the sampling thread
        self._worker: GuardedWorker | None = None
        self._pending: Future[bool | None] | None = None
        self._asked: float | None = None

    def poll(self) -> bool | None:
        if self._pending is not None and self._pending.done():
            try:
                self.up = self._pending.result()
            except Exception:  # the probe reads files and runs a program: never a reason to fail
                log.exception("fabric manager probe failed")
                self.errors["", "io"] += 1
            self._pending = None
        if self._pending is None and (self._asked is None or self.clock() - self._asked >= ASK_EVERY_SECONDS):
            if self._worker is None:
                self._worker = GuardedWorker("fabric-manager")
            self._asked = self.clock()
            self._pending = self._worker.submit(self.probe)
        return self.up

    def probe(self) -> bool | None:
        """One answer: systemd's where it knows the unit, else the pid file."""
        if self.settings.systemctl:
            argv = [*self.settings.systemctl, "show", "--property=LoadState,ActiveState",
                    self.settings.manager_unit]
            done = run_command(argv, self.deadline)  # its process group is killed at the deadline
            if done.timed_out:
                self.errors["", "timeout"] += 1
                return self.up  # keep the last answer
            if done.exit_code == 0:  # else no systemctl, or no systemd (a container): the pid file says
                load, active = parse_show(done.output)
                if load == "loaded":
                    return active in ACTIVE_STATES
        return self._from_pid_file()

    def _from_pid_file(self) -> bool | None:
        path = self.settings.manager_pid_file
        if path is None:
            return None
        try:
            pid = path.read_text().strip()
        except FileNotFoundError:
            return None
        except OSError:
            self.errors["", "permission"] += 1
            return None
        if not pid.isdigit():
            self.errors["", "malformed"] += 1
            return None
        return (self.procfs / pid).is_dir()
