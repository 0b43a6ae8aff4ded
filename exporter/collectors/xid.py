"""XID events from NVML's event set and the kernel log, plus NVSwitch SXIDs and PCIe AER errors.

Counters never lose repeated events, unlike a last-XID gauge. Both sources are drained without
blocking at every sampling run; unparseable kernel lines are counted, never fatal.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterator
from pathlib import Path

from gpuhealth.exporter.collector import GPU_IDENTITIES, Context, register
from gpuhealth.exporter.dedup import XidDeduplicator
from gpuhealth.exporter.guard import DeadlineExceeded, GuardedWorker
from gpuhealth.exporter.kmsg import Event, KmsgFollower, parse_line
from gpuhealth.exporter.metrics import KMSG_RESULTS, Families, Family
from gpuhealth.exporter.recovery import load_recovery, save_recovery
from gpuhealth.exporter.sysfs_attribute import read_attribute
from gpuhealth.exporter.xid_events import MAX_EVENTS_PER_RUN, NvmlXidEvents

log = logging.getLogger(__name__)

MAX_EVENT_SERIES = 1024  # per event family from the kernel log: far above a real node's devices x codes


def _boot_id(procfs: Path) -> str:
    try:
        return read_attribute(procfs / "sys/kernel/random/boot_id")
    except OSError:
        return ""


@register("xid", "XID events (NVML and kernel log), NVSwitch SXIDs, PCIe AER errors", needs=[GPU_IDENTITIES])
class XidCollector:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.dedup = XidDeduplicator()
        self.boot_id = _boot_id(ctx.procfs)
        self.follower: KmsgFollower | None = None
        if ctx.kmsg_path is not None:
            state = ctx.state_dir / "kmsg.seq" if ctx.state_dir else None
            self.follower = KmsgFollower(ctx.kmsg_path, state, self.boot_id)
        self.recovery_file = ctx.state_dir / "recovery_action" if ctx.state_dir else None
        ctx.inventory.logged_recovery.update(load_recovery(self.recovery_file, self.boot_id))
        self.events = NvmlXidEvents(ctx.nvml, ctx.clock) if ctx.nvml is not None else None
        self.nvml_worker = GuardedWorker("nvml-events")
        # Event counters appear at their first event, not at 0 for every GPU and known code: 20 XIDs
        # x 16,384 GPUs of zeros would be most of a fleet's series, and every XID rule would read them
        # all. The rules and dashboards count a series that appears as its first event.
        self.xids: collections.Counter[tuple[str, ...]] = collections.Counter()    # (gpu, xid)
        self.sxids: collections.Counter[tuple[str, ...]] = collections.Counter()   # (device, sxid, severity)
        self.aer: collections.Counter[tuple[str, ...]] = collections.Counter()     # pci_bus_id, severity, gpu
        self.fallen: collections.Counter[str] = collections.Counter()              # gpu
        self.lines = collections.Counter(dict.fromkeys(KMSG_RESULTS, 0))
        self._notice_pci = ""  # the GPU of a fallen-off-the-bus notice whose first line was just read

    def collect(self) -> Iterator[Family]:
        """No NVML failure may stop the kernel log's XIDs, SXIDs and AER errors from counting."""
        session, source = self.ctx.session, self.events
        if source is not None and session is not None and session.up:  # the inventory step ensures it
            count = self.ctx.inventory.count
            try:
                events = GuardedWorker.result(
                    self.nvml_worker.submit(lambda: source.drain(session.generation, count)),
                    self.ctx.nvml_timeout_seconds)
            except DeadlineExceeded:  # a hung driver: try again next run, count nothing twice
                log.warning("NVML event drain timed out")
                events = []
            except Exception:  # anything else from the binding: the kernel log below still counts
                log.exception("NVML event drain failed")
                events = []
            for gpu, xid in events:
                self._count_xid("nvml", gpu, xid)
        kmsg_error = None
        if self.follower is not None:
            try:
                self._drain_kmsg()
            except OSError as exc:  # e.g. no permission on /dev/kmsg: NVML events still count
                kmsg_error = exc
        yield from self._families()
        if kmsg_error is not None:
            raise kmsg_error

    def _count_xid(self, source: str, gpu: str, xid: int) -> None:
        if self.dedup.is_new(source, gpu, xid, self.ctx.clock()):
            self.xids[(gpu, str(xid))] += 1

    def _drain_kmsg(self) -> None:
        assert self.follower is not None
        inventory = self.ctx.inventory
        for line in self.follower.read_lines(MAX_EVENTS_PER_RUN):
            event = parse_line(line)
            series = self._series(event)
            if series is not None and len(series[0]) >= MAX_EVENT_SERIES and series[1] not in series[0]:
                self.lines["over_limit"] += 1  # odd addresses and codes (forged or garbled) grow nothing
                continue
            self.lines[event.kind] += 1
            if event.kind == "xid":
                gpu = inventory.gpu_for_pci(event.pci_bus_id)
                self._count_xid("kmsg", gpu, event.code)
                if event.action and inventory.logged_recovery.get(gpu) != event.action:
                    inventory.logged_recovery[gpu] = event.action
                    log.warning("gpu recovery action gpu=%s action=%s", gpu, event.action)
                    save_recovery(self.recovery_file, self.boot_id, inventory.logged_recovery)
            elif series is not None:
                series[0][series[1]] += 1
            elif event.kind == "fallen_off_bus":
                self.fallen[inventory.gpu_for_pci(event.pci_bus_id or self._notice_pci)] += 1
            # A text log (journalctl, dmesg, syslog) prints the driver's three-line notice as lines:
            # the GPU is named on the first, "fallen off the bus" comes on the third.
            if event.kind == "ignored" and event.pci_bus_id:
                self._notice_pci = event.pci_bus_id
            elif event.kind != "ignored":
                self._notice_pci = ""
        self.follower.save_state()

    def _series(self, event: Event) -> tuple[collections.Counter[tuple[str, ...]], tuple[str, ...]] | None:
        """The counter family and label values an event counts in, for the kinds whose labels come
        from the line itself (device addresses, codes); None for the others."""
        if event.kind == "xid":
            return self.xids, (self.ctx.inventory.gpu_for_pci(event.pci_bus_id), str(event.code))
        if event.kind == "sxid":
            return self.sxids, (event.device, str(event.code), event.severity)
        if event.kind == "aer":
            gpu = self.ctx.inventory.gpu_for_pci(event.pci_bus_id)
            return self.aer, (event.pci_bus_id, event.severity, "" if gpu == "unknown" else gpu)
        return None

    def _families(self) -> Iterator[Family]:
        f = Families()
        for labels, count in sorted(self.xids.items(), key=lambda kv: (kv[0][0], int(kv[0][1]))):
            f.add("gpuhealth_xid_events_total", count, labels)
        for gpu, count in sorted(self.fallen.items()):
            f.add("gpuhealth_gpu_fallen_off_bus_total", count, [gpu])
        if self.events is not None:
            for index, registered in sorted(self.events.registered.items()):
                f.add("gpuhealth_xid_nvml_registered", int(registered), [str(index)])
            for error, count in sorted(self.events.wait_errors.items()):
                f.add("gpuhealth_xid_nvml_wait_errors_total", count, [error])
        for labels, count in sorted(self.sxids.items()):
            f.add("gpuhealth_sxid_events_total", count, labels)
        for labels, count in sorted(self.aer.items()):
            f.add("gpuhealth_pcie_aer_errors_total", count, labels)
        if self.follower is not None:
            for result in KMSG_RESULTS:
                f.add("gpuhealth_kmsg_lines_total", self.lines[result], [result])
        yield from f

    def close(self) -> None:
        if self.follower is not None:
            self.follower.close()
