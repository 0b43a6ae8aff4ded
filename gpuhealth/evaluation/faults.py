"""Faults, one class per kind of the shared vocabulary (``gpuhealth.contract.faults``).

A fault's precursor (``FleetSignals.precursor``: ramp, plateau, steps or bursts, with its strength)
moves only the signals physics ties to it, and each event draws which of them it moves (a failing
PCIe link does not always log AER or downgrade); sudden faults show nothing until the XID. What
every fault shares (the hang, the drain until repair, the XIDs it logs) is in ``FaultEffects``.
"""

from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from gpuhealth.contract.faults import FALLS_OFF_BUS_KINDS, RECOVERY_ACTION_KINDS, RECOVERY_ACTION_XID
from gpuhealth.evaluation.effects import AddXid, Effects, PerLink

if TYPE_CHECKING:
    from gpuhealth.evaluation.nics import NicPorts
    from gpuhealth.evaluation.scenario import Failure
    from gpuhealth.evaluation.signals import FleetSignals


class FaultEffects(Effects):
    """One fault on one GPU: its precursor, then the XIDs it logs and the hard failure."""

    # NVML's error once the GPU no longer answers after the hard failure (None: it still answers)
    lost_error: ClassVar[str | None] = None
    # XID logged from ``first_xid`` until the hard failure (None: the failure's own XID)
    early_xid: ClassVar[int | None] = None

    def __init__(self, signals: FleetSignals, failure: Failure) -> None:
        super().__init__(signals)
        self.event = failure
        self.row = signals.gpu_index(failure.node, failure.gpu)
        self.params = signals.failure_params[failure]

    @property
    def falls_off_bus(self) -> bool:
        return self.kind in FALLS_OFF_BUS_KINDS

    @cached_property
    def level(self) -> np.ndarray:
        """0..1 over the timeline: the precursor, then 1 from the first XID to the hard failure."""
        return self.signals.precursor(self.event)

    def xids(self, add: AddXid) -> None:
        """The XID logged every two minutes from the first one until the GPU dies, then the failure's
        and, where the driver then asks for a GPU reset, XID 154 with it."""
        s, failure = self.signals, self.event
        if failure.first_xid is not None:
            every = max(int(120 / s.timeline.step), 1)
            for k in range(s.at(failure.instant), s.at(failure.failure), every):
                add(self.row, self.early_xid or failure.xid, k, 1.0)
        add(self.row, failure.xid, s.at(failure.failure), 1.0)
        if self.kind in RECOVERY_ACTION_KINDS:
            add(self.row, RECOVERY_ACTION_XID, s.at(failure.failure), 1.0)


class MemoryFault(FaultEffects):
    """Uncorrectable memory errors: corrected errors and remapped rows while the precursor lasts, a
    contained error first when one is logged early, uncorrected errors at the failure."""

    # strong wear runs out of spare rows before the XID: an uncorrectable remap, pending
    wears_out: ClassVar[bool] = False

    def memory_errors(self, hbm: dict[str, np.ndarray], rng: np.random.Generator) -> None:
        s, failure, i, level, params = self.signals, self.event, self.row, self.level, self.params
        minutes = s.timeline.step / 60
        hbm["corrected"][i] += rng.poisson((2 + 40 * failure.strength) * minutes * level)
        # rows whose errors recur get remapped: one to many, some wear hits few rows again
        remaps = params["remaps"] > 0.3
        rows = 1 + 40 * failure.strength * params["remaps"]
        hbm["remapped"][i] += rng.poisson(rows * level / max(level.sum(), 1))
        a, b = s.at(failure.onset), s.at(failure.instant)
        if failure.first_xid is not None and b < s.timeline.count:  # a contained error first
            hbm["uncorrected"][i, b] += 1
            hbm["uncorrectable"][i, b] += 1
            hbm["pending"][i, b : s.at(failure.failure)] = 1
        elif self.wears_out and failure.strength > 0.5 and b - a > 2 and remaps:
            k = a + int((b - a) * 0.9)
            hbm["uncorrectable"][i, k] += 1
            hbm["pending"][i, k:b] = 1
        end = s.at(failure.failure)
        if end < s.timeline.count:
            hbm["uncorrected"][i, end] += 1 + int(failure.strength * 3)
        if failure.xid == 64:
            hbm["failure"][i, s.out_of_service(failure)] = 1


class HbmDegradation(MemoryFault):
    """HBM wear: corrected ECC and remapped rows grow; a contained XID 94 may come first; some stall
    the host before the XID (paging, slow NFS metadata)."""

    kind = "hbm_degradation"
    wears_out = True
    early_xid = 94

    def storage_stress(self, stress: np.ndarray) -> None:
        s, failure = self.signals, self.event
        if self.params["extra"] < 0.3:
            a, b = s.at(failure.instant - 1800), s.at(failure.instant)
            stress[s.node_index(failure.node), a:b] = failure.strength


class SramUncorrectable(MemoryFault):
    """An SRAM uncorrectable error out of the blue (no precursor)."""

    kind = "sram_uncorrectable"


class ThermalRunaway(FaultEffects):
    """The GPU heats up against its peers at the same load, then falls off the bus."""

    kind = "thermal_runaway"
    lost_error = "gpu_is_lost"

    def heat(self, offset: np.ndarray) -> None:
        offset[self.row] += (6 + 12 * self.event.strength) * self.level


class PcieDegradation(FaultEffects):
    """A failing PCIe link replays more and more; some log AER corrected errors, some retrain to a
    lower width or generation late in the decay; then the GPU falls off the bus."""

    kind = "pcie_degradation"
    lost_error = "gpu_is_lost"

    def replays(self, replays: np.ndarray, rng: np.random.Generator) -> None:
        per_step = (1 + 40 * self.event.strength) * self.signals.timeline.step / 60
        replays[self.row] += rng.poisson(per_step * self.level)

    def aer(self, out: dict[int, np.ndarray], rng: np.random.Generator) -> None:
        if self.params["aer"]:
            per_step = (0.2 + 10 * self.event.strength) * self.signals.timeline.step / 60
            out[self.row] = out.get(self.row, 0) + rng.poisson(per_step * self.level)

    def pcie_link(self, width: np.ndarray, generation: np.ndarray) -> None:
        s, failure, params = self.signals, self.event, self.params
        if params["downgrade"] and failure.has_precursor:  # the link retrains lower late in the decay
            a, b = s.at(failure.onset), s.at(failure.instant)
            where = slice(a + int((b - a) * (0.4 + 0.55 * params["extra"])), s.out_of_service(failure).stop)
            if params["generation"]:
                generation[self.row, where] = 4
            else:
                width[self.row, where] = 8


class NvlinkErrors(FaultEffects):
    """CRC errors rise on one link (some stay below any threshold until the end); the link is down
    from the hard failure until the repair."""

    kind = "nvlink_errors"

    def nvlink(self, flits: PerLink, down: PerLink, rng: np.random.Generator) -> None:
        s, failure, params = self.signals, self.event, self.params
        rate = 0.01 + 0.05 * failure.strength if params["quiet"] else 2 + 200 * failure.strength
        key, per_minute = (self.row, int(params["link"])), s.timeline.step / 60
        flits[key] = flits.get(key, 0) + rng.poisson(rate * per_minute * self.level)
        down.setdefault(key, np.zeros(s.timeline.count, dtype=bool))[s.out_of_service(failure)] = True


class GspTimeout(FaultEffects):
    """The GSP stops answering: NVML times out for the GPU; before some, every GPU of the node answers
    NVML slowly."""

    kind = "gsp_timeout"
    lost_error = "timeout"

    def nvml_latency(self, latency: np.ndarray) -> None:
        s, failure = self.signals, self.event
        if self.params["extra"] < 0.4:
            a = s.at(failure.failure - 300 - 600 * failure.strength)
            b = s.at(failure.failure)
            latency[s.node_gpus(s.node_index(failure.node)), a:b] += np.linspace(0.05, 1.5, b - a)


class FellOffBus(FaultEffects):
    """The GPU falls off the bus without warning."""

    kind = "fell_off_bus"
    lost_error = "gpu_is_lost"


class FabricFault(FaultEffects):
    """A fault of the fabric (``nics.py``): its hard signal is no XID but the port or the NVSwitch."""

    def xids(self, add: AddXid) -> None:
        """No XID: the GPU is fine, the fabric around it failed."""

    @property
    def port(self) -> int:
        return self.signals.fabric.port_row(self.event.node, self.event.gpu)


class IbLinkFlap(FabricFault):
    """A failing cable or transceiver: the port flaps more and more often, then stays down."""

    kind = "ib_link_flap"

    def nic_ports(self, ports: NicPorts, rng: np.random.Generator) -> None:
        s, failure = self.signals, self.event
        per_step = (0.5 + 4 * failure.strength) / 3600 * s.timeline.step  # flaps at the precursor's top
        for k in np.flatnonzero(rng.random(s.timeline.count) < per_step * self.level**2):
            ports.flap(self.port, int(k), int(rng.integers(1, 3)))
        ports.flap(self.port, s.at(failure.failure))
        ports.up[self.port, s.out_of_service(failure)] = False


class IbSymbolErrors(FabricFault):
    """The link's bit error rate worsens over hours: symbol errors and link error recoveries rise,
    then the link goes down for good."""

    kind = "ib_symbol_errors"

    def nic_ports(self, ports: NicPorts, rng: np.random.Generator) -> None:
        s, failure = self.signals, self.event
        per_step = (0.5 + 30 * failure.strength) * s.timeline.step / 60 * self.level
        ports.symbol[self.port] += rng.poisson(per_step)
        ports.recovery[self.port] += rng.poisson(per_step / 20)
        ports.flap(self.port, s.at(failure.failure))
        ports.up[self.port, s.out_of_service(failure)] = False


class IbRateDowngrade(FabricFault):
    """The port retrains at a lower rate (a bad lane: half or a quarter of it) and stays there."""

    kind = "ib_rate_downgrade"

    def nic_ports(self, ports: NicPorts, rng: np.random.Generator) -> None:
        s, failure = self.signals, self.event
        ports.flap(self.port, s.at(failure.failure))
        where = s.out_of_service(failure)
        ports.rate[self.port, where] /= 2 if self.params["extra"] < 0.7 else 4


class NvswitchFatal(FabricFault):
    """An NVSwitch fatal SXID; about half are preceded by non-fatal SXIDs while the precursor lasts."""

    kind = "nvswitch_fatal"

    def nic_ports(self, ports: NicPorts, rng: np.random.Generator) -> None:
        s, failure = self.signals, self.event
        node = s.node_index(failure.node)
        if self.params["extra"] < 0.5:
            ports.sxid["non_fatal"][node] += rng.poisson(0.3 * s.timeline.step / 60 * self.level)
        at = s.at(failure.failure)
        if at < s.timeline.count:
            ports.sxid["fatal"][node, at] += 1


FAULTS: dict[str, type[FaultEffects]] = {
    cls.kind: cls
    for cls in (
        HbmDegradation,
        SramUncorrectable,
        ThermalRunaway,
        PcieDegradation,
        NvlinkErrors,
        GspTimeout,
        FellOffBus,
        IbLinkFlap,
        IbSymbolErrors,
        IbRateDowngrade,
        NvswitchFatal,
    )
}
