"""The state of one simulated GPU and how workload, faults and noise move it.

Counters only grow: each fault adds the change of a cumulative curve between two instants, so the
totals do not depend on how often the exporter samples. Transient values (temperatures, clocks,
link width) are recomputed from the baseline at every step.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pynvml
from gpuhealth.contract.faults import FABRIC_KINDS
from gpuhealth.exporter.sim import kernel_lines
from gpuhealth.exporter.sim.scenario import RESET_ENDS_KINDS, Fault, Scenario

# H100 SXM figures: thresholds, clocks (MHz), limits, HBM row-remap banks.
SLOWDOWN_C, SHUTDOWN_C = 87.0, 92.0
SM_CLOCK_MAX, MEM_CLOCK_MAX = 1980, 2619
POWER_LIMIT_W, IDLE_POWER_W, IDLE_TEMP_C = 700.0, 70.0, 34.0
MEMORY_TOTAL = 80 * 1024**3
REMAP_BANKS = 8192
PCIE_GEN, PCIE_WIDTH = 5, 16

REASON_GPU_IDLE = pynvml.nvmlClocksEventReasonGpuIdle
REASON_SW_POWER_CAP = pynvml.nvmlClocksEventReasonSwPowerCap
REASON_SW_THERMAL = pynvml.nvmlClocksEventReasonSwThermalSlowdown
REASON_HW_THERMAL = pynvml.nvmlClocksEventReasonHwThermalSlowdown
REASON_HW_SLOWDOWN = pynvml.nvmlClocksEventReasonHwSlowdown
REASON_HW_POWER_BRAKE = pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown

# Recovery actions a GPU reset carries out, as XID 154 names them; any other (a node reboot) outlives it.
RESET_RECOVERY_ACTIONS = {pynvml.NVML_GPU_RECOVERY_ACTION_NONE: "None",
                          pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET: "GPU Reset Required",
                          pynvml.NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET: "Drain and Reset Required"}

Emit = Callable[[int, str, int | None], None]  # (gpu index, kernel log text, NVML XID event or None)


@dataclass
class GpuState:
    index: int
    pci_bus_id: str
    nvlinks: int
    temp_offset: float = 0.0
    # transient, recomputed every step
    utilization: float = 0.0
    memory_utilization: float = 0.0
    power_watts: float = 0.0
    power_limit_watts: float = POWER_LIMIT_W
    temperature: float = IDLE_TEMP_C
    memory_temperature: float = IDLE_TEMP_C
    sm_clock: float = SM_CLOCK_MAX
    reasons: int = 0
    pcie_gen: int = PCIE_GEN
    pcie_width: int = PCIE_WIDTH
    nvml_delay: float = 0.0
    # persistent: counters and failure states
    ecc_corrected_volatile: float = 0.0
    ecc_corrected_aggregate: float = 0.0
    ecc_uncorrected_volatile: float = 0.0
    ecc_uncorrected_aggregate: float = 0.0
    retired_single_bit: int = 0
    retired_double_bit: int = 0
    retired_pending: int = 0
    remapped_correctable: float = 0.0
    remapped_uncorrectable: int = 0
    remap_pending: int = 0
    remap_failure: int = 0
    pcie_replays: float = 0.0
    nvlink_down: set[int] = field(default_factory=set)
    nvlink_errors: dict[tuple[int, str], float] = field(default_factory=dict)
    lost: bool = False
    hung: bool = False
    recovery_action: int = 0  # NVML_GPU_RECOVERY_ACTION_*, what XID 154 announces

    @property
    def pci_kernel(self) -> str:
        """The PCI address as the NVIDIA driver prints it in XID lines, ``PCI:0000:3b:00``."""
        domain, bus, rest = self.pci_bus_id.split(":")
        return f"PCI:{domain[-4:]}:{bus.lower()}:{rest.split('.')[0]}"

    def histogram(self) -> dict[str, int]:
        touched = min(int(self.remapped_correctable) + self.remapped_uncorrectable, REMAP_BANKS)
        exhausted = min(self.remap_failure, touched)
        return {"max": REMAP_BANKS - touched, "high": touched - exhausted, "partial": 0, "low": 0,
                "none": exhausted}


def smooth(p: float) -> float:
    """Cumulative share of precursor events by progress ``p``: slow at first, accelerating."""
    return min(max(p, 0.0), 1.0) ** 3


class FaultRun:
    """One scenario fault or noise item, stepped over time on its GPUs."""

    def __init__(self, fault: Fault, emit: Emit) -> None:
        self.fault = fault
        self.emit = emit
        self.progress = 0.0
        self.failed = False
        self.repaired: set[int] = set()  # GPUs a reset repaired: the event is over on them

    def phase_progress(self, t: float) -> float | None:
        """Progress 0..1 through the precursor (or noise) phase; None before it starts."""
        if t < self.fault.start:
            return None
        if self.fault.duration <= 0:
            return 1.0
        return min((t - self.fault.start) / self.fault.duration, 1.0)

    def step(self, t: float, gpus: list[GpuState]) -> None:
        p = self.phase_progress(t)
        if p is None:
            return
        noise_over = self.fault.is_noise and t > self.fault.start + self.fault.duration
        affected = [index for index in self.fault.gpus if index not in self.repaired]
        for index in affected:
            gpu = gpus[index]
            if not gpu.lost:
                getattr(self, f"_{self.fault.kind}")(gpu, p, self.progress, active=not noise_over)
        if not self.fault.is_noise and p >= 1.0 and not self.failed:
            self.failed = True
            for index in affected:
                getattr(self, f"_fail_{self.fault.kind}")(gpus[index])
        self.progress = p

    def _xid(self, gpu: GpuState, xid: int, text: str, event: bool = True) -> None:
        self.emit(gpu.index, f"NVRM: Xid ({gpu.pci_kernel}): {xid}, {text}", xid if event else None)

    def _grow(self, p: float, p_old: float, total: float) -> float:
        return total * (smooth(p) - smooth(p_old))

    # faults: precursor effects
    def _hbm_degradation(self, gpu: GpuState, p: float, p_old: float, active: bool) -> None:
        ecc = self._grow(p, p_old, 4000)
        gpu.ecc_corrected_volatile += ecc
        gpu.ecc_corrected_aggregate += ecc
        before = int(gpu.remapped_correctable)
        gpu.remapped_correctable += self._grow(p, p_old, 64)
        for _ in range(int(gpu.remapped_correctable) - before):
            self._xid(gpu, 63, "pid=4242, name=python, Row Remapper: New row marked for remapping, reset "
                               "gpu to activate.", event=False)

    def _thermal_runaway(self, gpu: GpuState, p: float, p_old: float, active: bool) -> None:
        gpu.temp_offset += 32.0 * p
        if gpu.temperature + gpu.temp_offset >= SLOWDOWN_C - 2:
            gpu.reasons |= REASON_SW_THERMAL
            gpu.sm_clock *= 0.8
        if gpu.temperature + gpu.temp_offset >= SLOWDOWN_C:
            gpu.reasons |= REASON_HW_THERMAL | REASON_HW_SLOWDOWN
            gpu.sm_clock *= 0.6

    def _pcie_degradation(self, gpu: GpuState, p: float, p_old: float, active: bool) -> None:
        gpu.pcie_replays += self._grow(p, p_old, 20000)
        if p >= 0.5:
            gpu.pcie_width = 8
        if p >= 0.8:
            gpu.pcie_gen = 4
        for _ in range(int(40 * smooth(p)) - int(40 * smooth(p_old))):
            self.emit(gpu.index, kernel_lines.aer_corrected(gpu.index, gpu.pci_bus_id), None)

    def _nvlink_errors(self, gpu: GpuState, p: float, p_old: float, active: bool) -> None:
        link = self.fault.params.get("link", 0)
        for kind, total in (("crc_flit", 50000), ("crc_data", 5000), ("replay", 2000), ("recovery", 20)):
            key = (link, kind)
            gpu.nvlink_errors[key] = gpu.nvlink_errors.get(key, 0.0) + self._grow(p, p_old, total)

    def _gsp_timeout(self, gpu: GpuState, p: float, p_old: float, active: bool) -> None:
        gpu.nvml_delay = 0.25 * p if p < 1.0 else 0.0

    def _fell_off_bus(self, gpu: GpuState, p: float, p_old: float, active: bool) -> None:
        """No precursor."""

    def _sram_uncorrectable(self, gpu: GpuState, p: float, p_old: float, active: bool) -> None:
        """No precursor: an SRAM uncorrectable error comes out of the blue."""

    # faults: hard failures
    def _fail_hbm_degradation(self, gpu: GpuState) -> None:
        xid = self.fault.params.get("xid", 95)
        gpu.ecc_uncorrected_volatile += 1
        gpu.ecc_uncorrected_aggregate += 1
        gpu.remapped_uncorrectable += 1
        gpu.remap_pending = 1
        if xid == 64:
            gpu.remap_failure = 1
        text = {48: "pid=4242, name=python, An uncorrectable double bit error (DBE) has been detected on "
                    "GPU in the framebuffer at partition 1, subpartition 0.",
                64: "pid=4242, name=python, Row Remapper Error: remapping failed.",
                94: "pid=4242, name=python, Contained: SM (0x1). RST: No, D-RST: No",
                95: "pid=4242, name=python, Uncontained: FBHUB. RST: Yes, D-RST: No"}[xid]
        self._xid(gpu, xid, text)
        self._require_reset(gpu)

    def _fail_sram_uncorrectable(self, gpu: GpuState) -> None:
        gpu.ecc_uncorrected_volatile += 1
        gpu.ecc_uncorrected_aggregate += 1
        self._xid(gpu, 95, "pid=4242, name=python, Uncontained: SM (0x1). RST: Yes, D-RST: No")
        self._require_reset(gpu)

    def _require_reset(self, gpu: GpuState) -> None:
        """The driver's answer to an uncorrectable error: its recovery action (the NVML field
        NVML_FI_DEV_GET_GPU_RECOVERY_ACTION) becomes a GPU reset, announced by XID 154."""
        gpu.recovery_action = pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET
        self._xid(gpu, 154, "GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)")

    def _fail_thermal_runaway(self, gpu: GpuState) -> None:
        self._fail_fell_off_bus(gpu)

    def _fail_pcie_degradation(self, gpu: GpuState) -> None:
        self._fail_fell_off_bus(gpu)

    def _fail_nvlink_errors(self, gpu: GpuState) -> None:
        link = self.fault.params.get("link", 0)
        gpu.nvlink_down.add(link)
        self._xid(gpu, 74, f"pid=4242, name=python, NVLink: fatal error detected on link {link}(0x0, 0x0, "
                           "0x10000, 0x0, 0x0, 0x0, 0x0)")

    def _fail_gsp_timeout(self, gpu: GpuState) -> None:
        gpu.hung = True
        self._xid(gpu, 119, "pid=4242, name=python, Timeout after 6s of waiting for RPC response from GPU0 "
                            "GSP! Expected function 76 (GSP_RM_CONTROL) (0x20802a02 0x8).")

    def _fail_fell_off_bus(self, gpu: GpuState) -> None:
        gpu.lost = True
        self._xid(gpu, 79, "pid=4242, name=python, GPU has fallen off the bus.")
        self.emit(gpu.index, kernel_lines.fallen_off_bus(gpu.index, gpu.pci_bus_id), None)

    # noise: active=False once the noise window is over
    def _sbe_burst(self, gpu: GpuState, p: float, p_old: float, active: bool) -> None:
        count = self.fault.params.get("count", 200) * (p - p_old)
        gpu.ecc_corrected_volatile += count
        gpu.ecc_corrected_aggregate += count

    def _hot_aisle(self, gpu: GpuState, p: float, p_old: float, active: bool) -> None:
        if active:
            gpu.temp_offset += self.fault.params.get("delta_celsius", 8.0)

    def _boot_replay_burst(self, gpu: GpuState, p: float, p_old: float, active: bool) -> None:
        gpu.pcie_replays += self.fault.params.get("count", 500) * (p - p_old)

    def _power_cap(self, gpu: GpuState, p: float, p_old: float, active: bool) -> None:
        if active:
            gpu.power_limit_watts = self.fault.params.get("watts", 350.0)
            if gpu.power_watts > gpu.power_limit_watts:
                gpu.sm_clock *= gpu.power_limit_watts / gpu.power_watts
                gpu.power_watts = gpu.power_limit_watts
                gpu.reasons |= REASON_SW_POWER_CAP

    def _idle_node(self, gpu: GpuState, p: float, p_old: float, active: bool) -> None:
        if active:
            _idle(gpu)

    def _sbe_chatter(self, gpu: GpuState, p: float, p_old: float, active: bool) -> None:
        self._sbe_burst(gpu, p, p_old, active)  # the same errors, spread thinly over a long window

    @staticmethod
    def _starts(p: float, p_old: float) -> bool:
        """True at the event's first step past its start, for what happens once."""
        return p_old == 0.0 < p

    def _benign_remap(self, gpu: GpuState, p: float, p_old: float, active: bool) -> None:
        if self._starts(p, p_old):
            gpu.remapped_correctable += 1
            self._xid(gpu, 63, "pid=4242, name=python, Row Remapper: New row marked for remapping, reset gpu "
                               "to activate.", event=False)
        gpu.remap_pending = 1 if active else 0  # until the GPU reset that ends the event

    def _contained_xid94(self, gpu: GpuState, p: float, p_old: float, active: bool) -> None:
        if self._starts(p, p_old):
            gpu.ecc_uncorrected_volatile += 1
            gpu.ecc_uncorrected_aggregate += 1
            gpu.remapped_uncorrectable += 1
            self._xid(gpu, 94, "pid=4242, name=python, Contained: SM (0x1). RST: No, D-RST: No")
        gpu.remap_pending = 1 if active else 0

    def _xid63(self, gpu: GpuState, p: float, p_old: float, active: bool) -> None:
        if self._starts(p, p_old):
            gpu.remapped_correctable += 1
            self._xid(gpu, 63, "pid=4242, name=python, Row Remapper: New row marked for remapping, reset gpu "
                               "to activate.", event=False)

    def _app_xid(self, gpu: GpuState, p: float, p_old: float, active: bool) -> None:
        """A buggy job faults on every GPU it runs on, about ten times over the event."""
        if self._starts(p, p_old) or (active and int(10 * p) > int(10 * p_old)):
            xid = self.fault.params.get("xid", 13)
            self._xid(gpu, xid, "pid=4242, name=python, Graphics Exception: ESR 0x514648=0x1000e")

    def _nvlink_flap(self, gpu: GpuState, p: float, p_old: float, active: bool) -> None:
        link = self.fault.params.get("link", 0)
        key = (link, "crc_flit")
        gpu.nvlink_errors[key] = gpu.nvlink_errors.get(key, 0.0) + 3000 * (p - p_old)
        if active and 0.4 <= p <= 0.6:  # the link drops and retrains, then heals
            gpu.nvlink_down.add(link)
        else:
            gpu.nvlink_down.discard(link)

    def _pcie_replay_steady(self, gpu: GpuState, p: float, p_old: float, active: bool) -> None:
        gpu.pcie_replays += self.fault.params.get("count", 100) * (p - p_old)

    def _warm_gpu(self, gpu: GpuState, p: float, p_old: float, active: bool) -> None:
        if active:
            gpu.temp_offset += self.fault.params.get("delta_celsius", 6.0)

    def _slow_nvml(self, gpu: GpuState, p: float, p_old: float, active: bool) -> None:
        if active:
            gpu.nvml_delay = max(gpu.nvml_delay, 0.3)

    def _power_brake(self, gpu: GpuState, p: float, p_old: float, active: bool) -> None:
        if active:
            gpu.reasons |= REASON_HW_POWER_BRAKE | REASON_HW_SLOWDOWN
            gpu.sm_clock *= 0.5
            gpu.power_watts = min(gpu.power_watts, 0.45 * POWER_LIMIT_W)


class ResetRefused(Exception):
    """A GPU reset that fails, as ``nvidia-smi -r`` does; the message says why."""


def _idle(gpu: GpuState) -> None:
    gpu.utilization = gpu.memory_utilization = 0.0
    gpu.pcie_gen = 1  # link power saving, as real GPUs do at idle
    gpu.power_watts = IDLE_POWER_W
    gpu.temperature = IDLE_TEMP_C
    gpu.memory_temperature = IDLE_TEMP_C + 2
    gpu.sm_clock = 345
    gpu.reasons |= REASON_GPU_IDLE


class Node:
    """All simulated GPUs of one node, advanced together to the scenario time ``t``."""

    def __init__(self, scenario: Scenario, emit: Emit) -> None:
        rng = random.Random(scenario.seed)
        self.gpus = [GpuState(i, _pci_bus_id(i), scenario.nvlinks) for i in range(scenario.gpus)]
        self._peer_offsets = [rng.uniform(-2.0, 2.0) for _ in self.gpus]
        self.emit = emit
        self.load(scenario)

    def load(self, scenario: Scenario) -> None:
        """Start (or restart, on reload) the scenario; GPUs come back as after a reset, counters stay."""
        self.scenario = scenario
        self.runs = [FaultRun(f, self.emit) for f in scenario.faults if f.kind not in FABRIC_KINDS]
        for gpu in self.gpus:
            gpu.lost = gpu.hung = False
            gpu.recovery_action = 0
            gpu.nvlink_down.clear()
            gpu.remap_pending = gpu.retired_pending = 0
            gpu.ecc_corrected_volatile = gpu.ecc_uncorrected_volatile = 0.0

    def reset_gpu(self, index: int) -> None:
        """What ``nvidia-smi -r -i INDEX`` does: volatile ECC counts cleared, pending row remaps applied,
        a recovery action of reset kind carried out, the GPU's hang and down links cleared, and the
        faults and noise a reset ends (``RESET_ENDS_KINDS``) over on it. Raises ``ResetRefused`` as the
        real reset fails: on a GPU off the bus, one still in use, or one whose driver asks for more."""
        gpu = self.gpus[index]
        if gpu.lost:
            raise ResetRefused(f"GPU {index} ({gpu.pci_bus_id}) has fallen off the bus: a reset cannot reach "
                               "it, the node needs a reboot")
        users = sorted(p.pid for p in self.scenario.processes if index in p.gpus)
        if users:
            raise ResetRefused(f"GPU {index} ({gpu.pci_bus_id}) is in use by process(es) "
                               f"{', '.join(map(str, users))}: stop them before the reset")
        if gpu.recovery_action not in RESET_RECOVERY_ACTIONS:
            raise ResetRefused(f"GPU {index} ({gpu.pci_bus_id}): the driver's recovery action "
                               f"{gpu.recovery_action} is more than a GPU reset (a node reboot)")
        for run in self.runs:
            if index in run.fault.gpus and run.fault.kind in RESET_ENDS_KINDS:
                run.repaired.add(index)
        gpu.hung = False
        if gpu.recovery_action != pynvml.NVML_GPU_RECOVERY_ACTION_NONE:  # the driver announces the change
            self.emit(index, f"NVRM: Xid ({gpu.pci_kernel}): 154, GPU recovery action changed from "
                             f"0x{gpu.recovery_action:x} ({RESET_RECOVERY_ACTIONS[gpu.recovery_action]}) to "
                             "0x0 (None)", 154)
            gpu.recovery_action = pynvml.NVML_GPU_RECOVERY_ACTION_NONE
        gpu.remap_pending = gpu.retired_pending = 0  # applied: the rows stay counted as remapped
        gpu.ecc_corrected_volatile = gpu.ecc_uncorrected_volatile = 0.0
        gpu.nvlink_down.clear()

    def advance(self, t: float) -> None:
        w = self.scenario.workload
        busy = True
        if w.period_seconds > 0:
            busy = (t % w.period_seconds) >= w.idle_fraction * w.period_seconds
        for gpu, offset in zip(self.gpus, self._peer_offsets, strict=True):
            gpu.reasons, gpu.temp_offset, gpu.nvml_delay = 0, 0.0, 0.0
            gpu.pcie_gen, gpu.pcie_width, gpu.power_limit_watts = PCIE_GEN, PCIE_WIDTH, POWER_LIMIT_W
            if busy and w.utilization > 0:
                wobble = 0.02 * math.sin(t / 7.0 + gpu.index)
                gpu.utilization = min(w.utilization + wobble, 1.0)
                gpu.memory_utilization = gpu.utilization * 0.6
                gpu.power_watts = w.power_watts * (1 + wobble)
                gpu.temperature = w.temperature_celsius + offset
                gpu.memory_temperature = w.memory_temperature_celsius + offset
                gpu.sm_clock = SM_CLOCK_MAX
            else:
                _idle(gpu)
        for run in self.runs:
            run.step(t, self.gpus)
        for gpu in self.gpus:
            gpu.temperature += gpu.temp_offset
            gpu.memory_temperature += gpu.temp_offset * 0.9


def _pci_bus_id(index: int) -> str:
    buses = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)
    bus = buses[index] if index < len(buses) else 0xE0 + index
    return f"00000000:{bus:02X}:00.0"
