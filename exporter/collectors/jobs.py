"""Which Slurm job uses which GPU, from the cgroup (or environment) of each GPU compute process.

Lets an alert on a GPU name the job to requeue. Needs each GPU's compute processes, which the ``gpu``
collector records in the shared inventory, so it runs after that collector.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

from gpuhealth.exporter.collector import GPU_PROCESSES, Context, register
from gpuhealth.exporter.metrics import Families, Family
from gpuhealth.exporter.procfs_file import read_procfs

_CGROUP_JOB = re.compile(r"/job_(\d+)(?:/|$)")
# Slurm's job ids are decimal; the environment is the process owner's to set, so nothing else is read.
_JOB_ID = re.compile(r"[0-9]{1,12}")
# exec takes 6 MiB of arguments and environment at most (3/4 of the kernel's _STK_LIM)
PROCESS_FILE_BYTES = 8 << 20


def slurm_job_of(procfs: Path, pid: int) -> str | None:
    """The Slurm job id of ``pid``: its cgroup path (``.../job_<id>/...``), else ``SLURM_JOB_ID``."""
    try:
        # a delegated cgroup may be named with any bytes by the process owner
        cgroup = read_procfs(procfs / str(pid) / "cgroup", PROCESS_FILE_BYTES)
    except OSError:  # the process ended, or it is in another pid namespace: try its environment
        cgroup = ""
    if match := _CGROUP_JOB.search(cgroup):
        return match.group(1)
    try:
        environ = read_procfs(procfs / str(pid) / "environ", PROCESS_FILE_BYTES).split("\0")
    except OSError:
        return None
    for entry in environ:
        if entry.startswith("SLURM_JOB_ID="):
            value = entry.split("=", 1)[1]
            return value if _JOB_ID.fullmatch(value) else None
    return None


@register("jobs", "Slurm job attribution of GPU compute processes", needs=[GPU_PROCESSES])
class JobsCollector:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def collect(self) -> Iterator[Family]:
        f = Families()
        for index, pids in sorted(self.ctx.inventory.processes.items()):
            jobs = {job for pid in pids if (job := slurm_job_of(self.ctx.procfs, pid))}
            for job in sorted(jobs):
                f.add("gpuhealth_gpu_job_info", 1, [str(index), job])
        yield from f
