"""Site helper processes that outlive a killed webhook: recorded while they run, killed on restart.

Each helper runs in its own process group (so a timeout can kill its whole tree). A webhook killed
with SIGKILL cannot kill them, and the restarted webhook would run the interrupted step again beside
the old run. So every helper's group is recorded (a file named for the group id, holding the
leader's start time) before the webhook waits on it, and at start-up every recorded group still
alive is killed and waited for, before any step is resumed.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import uuid
from pathlib import Path

log = logging.getLogger(__name__)

REAP_TIMEOUT_SECONDS = 10.0
SLOT_PREFIX = "reserved-"
SLOT_BYTES = 32  # room for a start time in clock ticks


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat fields after the command name (field 3 onwards), or None if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def start_time(pid: int) -> str | None:
    fields = _stat(pid)
    return fields[19] if fields else None  # field 22: start time in clock ticks since boot


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes whose process group is ``pgid``."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields and fields[0] != "Z" and fields[2] == str(pgid):
                members.append(int(entry.name))
    return members


class HelperRegistry:
    """The process groups of running helpers, as files in ``directory`` (on the journal's disk)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    def reserve(self) -> Path:
        """A record written (and fsync'd) before the helper starts; ``OSError`` (a full disk) means the
        helper must not start, since what it then did could not be known after a crash."""
        slot = self.directory / f"{SLOT_PREFIX}{uuid.uuid4().hex}"
        with open(slot, "w") as out:
            out.write(" " * SLOT_BYTES)
            out.flush()
            os.fsync(out.fileno())
        return slot

    def started(self, slot: Path, pid: int) -> None:
        """Fill in a reserved record for a helper that leads its own process group: written in place
        and renamed, so it needs no new space."""
        with open(slot, "r+") as out:
            out.write((start_time(pid) or "").ljust(SLOT_BYTES)[:SLOT_BYTES])
            out.flush()
            os.fsync(out.fileno())
        os.replace(slot, self.directory / str(pid))

    def release(self, slot: Path) -> None:
        slot.unlink(missing_ok=True)

    def finished(self, pid: int) -> None:
        (self.directory / str(pid)).unlink(missing_ok=True)

    def reap(self) -> int:
        """Kill every recorded group that still has live members and wait until they are gone; how many
        groups were killed. A group whose leader's pid now belongs to another process is not ours."""
        killed = 0
        for path in sorted(self.directory.iterdir()):
            if path.name.startswith(SLOT_PREFIX):
                path.unlink()  # never filled in: its helper never started (or died with the webhook)
                continue
            if not path.name.isdigit():
                continue
            pgid = int(path.name)
            recorded = path.read_text().strip()
            leader = start_time(pgid)
            if leader is not None and recorded and leader != recorded:
                path.unlink()  # the pid was reused: the old group is long gone
                continue
            if group_members(pgid):
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                else:
                    killed += 1
                    log.warning("event=helper_killed pgid=%d (left running by a previous webhook)", pgid)
                self._wait_gone(pgid)
            path.unlink()
        return killed

    @staticmethod
    def _wait_gone(pgid: int) -> None:
        deadline = time.monotonic() + REAP_TIMEOUT_SECONDS
        while group_members(pgid):
            if time.monotonic() > deadline:
                raise RuntimeError(f"helper process group {pgid} survives SIGKILL; refusing to resume "
                                   "steps beside it")
            time.sleep(0.02)


class TracksHelpers:
    """For a backend that runs site programs: ``track_helpers`` is called once at start-up, before
    the worker, and the programs are then run with ``helpers=self.helpers``."""

    helpers: HelperRegistry | None = None

    def track_helpers(self, directory: Path) -> int:
        """Record running helpers in ``directory`` from now on, after killing (and waiting for) any a
        previous webhook left running there; how many groups were killed."""
        self.helpers = HelperRegistry(directory)
        return self.helpers.reap()
