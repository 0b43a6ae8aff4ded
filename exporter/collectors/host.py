"""Host figures that move when a GPU hangs in a collective or storage stalls.

Read straight from procfs under ``--path.procfs`` (the files psutil reads on Linux), so tests run
against fixture trees: CPU time, memory, load, interrupts, context switches, runnable processes,
paging, disk and network I/O.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

from gpuhealth.exporter.collector import Context, register
from gpuhealth.exporter.metrics import Families, Family
from gpuhealth.exporter.procfs_file import read_procfs

CPU_MODES = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
SECTOR_BYTES = 512  # /proc/diskstats counts 512-byte sectors whatever the device's sector size
# Whole disks only, as node_exporter does by default: partitions would count the same bytes twice.
IGNORED_DISKS = re.compile(r"^(ram|loop|fd|(h|s|v|xv)d[a-z]+\d+|nvme\d+n\d+p\d+|mmcblk\d+p\d+|sr)\d*")
IGNORED_INTERFACES = ("lo",)



def _fields(path: Path, wanted: dict[str, int]) -> dict[str, list[str]]:
    """Key (first word of a line) -> its first ``wanted[key]`` values, for the wanted keys only: on a
    large node ``/proc/stat`` has a line per CPU and an ``intr`` line of thousands of counters."""
    found = {}
    for line in read_procfs(path).splitlines():
        key, _, rest = line.partition(" ")
        key = key.rstrip(":")
        if key in wanted:
            found[key] = rest.split(None, wanted[key])[:wanted[key]]
    return found


@register("host", "CPU, memory, load, interrupts, paging, disk and network I/O from procfs")
class HostCollector:
    def __init__(self, ctx: Context) -> None:
        self.procfs = ctx.procfs
        self.clock_ticks = os.sysconf("SC_CLK_TCK")

    def collect(self) -> Iterator[Family]:
        f = Families()
        stat = _fields(self.procfs / "stat", {"cpu": len(CPU_MODES), "intr": 1, "ctxt": 1,
                                              "procs_running": 1})
        for mode, ticks in zip(CPU_MODES, stat["cpu"], strict=False):
            f.add("gpuhealth_host_cpu_seconds_total", int(ticks) / self.clock_ticks, [mode])
        meminfo = _fields(self.procfs / "meminfo", {"MemTotal": 1, "MemAvailable": 1})
        f.add("gpuhealth_host_memory_total_bytes", int(meminfo["MemTotal"][0]) * 1024)
        f.add("gpuhealth_host_memory_available_bytes", int(meminfo["MemAvailable"][0]) * 1024)
        f.add("gpuhealth_host_load1", float(read_procfs(self.procfs / "loadavg").split()[0]))
        f.add("gpuhealth_host_interrupts_total", int(stat["intr"][0]))
        f.add("gpuhealth_host_context_switches_total", int(stat["ctxt"][0]))
        f.add("gpuhealth_host_procs_running", int(stat["procs_running"][0]))
        vmstat = _fields(self.procfs / "vmstat", {"pgpgout": 1, "pswpout": 1})
        f.add("gpuhealth_host_page_outs_total", int(vmstat["pgpgout"][0]))
        f.add("gpuhealth_host_swap_outs_total", int(vmstat["pswpout"][0]))
        for line in read_procfs(self.procfs / "diskstats").splitlines():
            parts = line.split()
            if len(parts) < 10 or IGNORED_DISKS.match(parts[2]):
                continue
            f.add("gpuhealth_host_disk_read_bytes_total", int(parts[5]) * SECTOR_BYTES, [parts[2]])
            f.add("gpuhealth_host_disk_written_bytes_total", int(parts[9]) * SECTOR_BYTES, [parts[2]])
        for line in read_procfs(self.procfs / "net/dev").splitlines()[2:]:
            name, _, counters = line.partition(":")
            values = counters.split()
            if name.strip() in IGNORED_INTERFACES or len(values) < 9:
                continue
            f.add("gpuhealth_host_network_receive_bytes_total", int(values[0]), [name.strip()])
            f.add("gpuhealth_host_network_transmit_bytes_total", int(values[8]), [name.strip()])
        yield from f
