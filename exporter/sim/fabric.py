"""The simulated node's fabric: its InfiniBand NICs and NVSwitches, and the faults that move them.

HGX H100/H200 nodes carry one single-port ConnectX-7 (400 Gb/s NDR) per GPU on the GPU's PCIe
switch; the other profiles four. Counters only grow, as in ``gpu.py``: each fault adds the change of
a cumulative curve between two instants, so what the exporter reads does not depend on how often
it reads. ``sysfs_tree.py`` writes this state as the kernel would show it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpuhealth.contract.faults import FABRIC_KINDS
from gpuhealth.exporter.sim import kernel_lines
from gpuhealth.exporter.sim.gpu import Emit, smooth
from gpuhealth.exporter.sim.scenario import Fault

NIC_RATE_GBPS = 400.0      # ConnectX-7, 4X NDR
DOWNGRADED_RATE_GBPS = 200.0  # the rate a degraded NDR link retrains at by default (4X HDR)
FLAPS = 12                 # flaps of ib_link_flap before the port stays down
NVSWITCHES = 4             # HGX H100/H200 baseboard
# (state, physical state) as the IB port reports them
UP = (4, 5)                # ACTIVE, LinkUp
DOWN = (1, 2)              # DOWN, Polling: no peer on the cable


@dataclass
class NicState:
    index: int
    rate_gbps: float = NIC_RATE_GBPS
    counters: dict[str, float] = field(default_factory=dict)  # sysfs counters/ names
    # transient, recomputed every step
    state: tuple[int, int] = UP
    # persistent
    failed: bool = False       # down for good
    trained_gbps: float | None = None  # the rate after a downgrade

    @property
    def device(self) -> str:
        return f"mlx5_{self.index}"

    def add(self, counter: str, amount: float) -> None:
        self.counters[counter] = self.counters.get(counter, 0.0) + amount


class FabricRun:
    """One fabric fault or noise item, stepped over time."""

    def __init__(self, fault: Fault, emit: Emit) -> None:
        self.fault = fault
        self.emit = emit
        self.progress = 0.0
        self.failed = False

    def step(self, t: float, nics: list[NicState]) -> None:
        fault = self.fault
        if t < fault.start:
            return
        p = 1.0 if fault.duration <= 0 else min((t - fault.start) / fault.duration, 1.0)
        targets = nics if fault.kind == "switch_reboot" else \
            [nics[fault.params["nic"]]] if fault.kind != "nvswitch_fatal" else []
        getattr(self, f"_{fault.kind}")(t, targets, p, self.progress)
        if not fault.is_noise and p >= 1.0 and not self.failed:
            self.failed = True
            getattr(self, f"_fail_{fault.kind}")(targets)
        self.progress = p

    def _flap_window(self) -> float:
        """How long one flap keeps the port down: a few seconds, so some scrapes see it."""
        return min(max(0.01 * self.fault.duration, 3.0), 30.0)

    def _ib_link_flap(self, t: float, nics: list[NicState], p: float, p_old: float) -> None:
        """Flaps come more and more often (their count grows as progress cubed)."""
        nic = nics[0]
        for _ in range(int(FLAPS * smooth(p)) - int(FLAPS * smooth(p_old))):
            nic.add("link_downed", 1)
            nic.add("link_error_recovery", 3)
        done = int(FLAPS * smooth(p))
        if done and p < 1.0:
            last = self.fault.start + self.fault.duration * (done / FLAPS) ** (1 / 3)
            if t - last < self._flap_window():
                nic.state = DOWN

    def _ib_symbol_errors(self, t: float, nics: list[NicState], p: float, p_old: float) -> None:
        """The bit error rate worsens: symbol errors, link error recoveries and receive errors rise."""
        grow = smooth(p) - smooth(p_old)
        nics[0].add("symbol_error", 50000 * grow)
        nics[0].add("link_error_recovery", 40 * grow)
        nics[0].add("port_rcv_errors", 2000 * grow)

    def _ib_rate_downgrade(self, t: float, nics: list[NicState], p: float, p_old: float) -> None:
        """A few symbol errors before the link retrains lower."""
        nics[0].add("symbol_error", 200 * (smooth(p) - smooth(p_old)))

    def _nvswitch_fatal(self, t: float, nics: list[NicState], p: float, p_old: float) -> None:
        """Non-fatal SXIDs, ``count`` of them (default 3; 0: the fatal one comes without warning)."""
        count = self.fault.params.get("count", 3)
        for k in range(int(count * p) - int(count * p_old)):
            switch = (int(count * p_old) + k) % NVSWITCHES
            self.emit(0, kernel_lines.sxid_non_fatal(switch, link=8 + 4 * switch), None)

    def _fail_ib_link_flap(self, nics: list[NicState]) -> None:
        nics[0].add("link_downed", 1)
        nics[0].failed = True

    def _fail_ib_symbol_errors(self, nics: list[NicState]) -> None:
        self._fail_ib_link_flap(nics)

    def _fail_ib_rate_downgrade(self, nics: list[NicState]) -> None:
        nics[0].add("link_downed", 1)  # the link went down and retrained lower
        nics[0].trained_gbps = float(self.fault.params.get("rate_gbps", DOWNGRADED_RATE_GBPS))

    def _fail_nvswitch_fatal(self, nics: list[NicState]) -> None:
        self.emit(0, kernel_lines.sxid_fatal(1, link=30), None)

    # noise
    def _ib_boot_flap(self, t: float, nics: list[NicState], p: float, p_old: float) -> None:
        """One flap at the start of the window (the node booting), then stable."""
        if p_old == 0.0 < p:
            nics[0].add("link_downed", 1)
        if t - self.fault.start < min(self._flap_window(), self.fault.duration):
            nics[0].state = DOWN

    def _switch_reboot(self, t: float, nics: list[NicState], p: float, p_old: float) -> None:
        """The leaf switch reboots: every port of the node goes down together, for ``duration``."""
        for nic in nics:
            if p_old == 0.0 < p:
                nic.add("link_downed", 1)
            if p < 1.0:
                nic.state = DOWN


class Fabric:
    """The NICs of one node, advanced with its GPUs to the scenario time ``t``."""

    def __init__(self, nics: int, emit: Emit) -> None:
        self.nics = [NicState(i) for i in range(nics)]
        self.emit = emit
        self.runs: list[FabricRun] = []

    def load(self, faults: tuple[Fault, ...]) -> None:
        """Start (or restart, on reload) the fabric faults; links come back, counters stay."""
        self.runs = [FabricRun(f, self.emit) for f in faults if f.kind in FABRIC_KINDS]
        for nic in self.nics:
            nic.failed, nic.trained_gbps = False, None

    def advance(self, t: float) -> None:
        for nic in self.nics:
            nic.state = UP
        for run in self.runs:
            run.step(t, self.nics)
        for nic in self.nics:  # what a hard failure left, from the step it happened in
            nic.state = DOWN if nic.failed else nic.state
            nic.rate_gbps = nic.trained_gbps or NIC_RATE_GBPS
