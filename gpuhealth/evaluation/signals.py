"""The fleet's time series, under the exporter's metric names, with faults and benign noise applied.

Shapes follow ../shared/DOMAIN.md. What each fault and benign kind does lives in its own class
(``faults.py``, ``noise.py``); this module holds what they share (timeline, workload, the fleet's
layout, the precursor shapes, repairs and reboots) and builds each metric family, folding every
event's effects into the signals it moves. After a hard failure the node's job hangs for a while
(interrupts and runnable processes collapse), then the node is drained until repaired. Values are
``float64`` arrays over the timeline, ``NaN`` where the exporter would publish no sample (a GPU lost
from the bus, a rebooting node).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from gpuhealth.contract.metrics import CLOCK_EVENT_REASONS, COLLECTORS, LEGACY_NVLINK_ERROR_TYPES, SPECS
from gpuhealth.evaluation.effects import FOLD_ORDER, Effects
from gpuhealth.evaluation.faults import FAULTS, FaultEffects
from gpuhealth.evaluation.hardware import (
    HOST_CPUS,
    HOST_MEMORY_BYTES,
    IDLE_POWER_W,
    MEMORY_TOTAL_BYTES,
    POWER_LIMIT_W,
    SHUTDOWN_C,
    SLOWDOWN_C,
    SM_CLOCK_IDLE_HZ,
    SM_CLOCK_MAX_HZ,
)
from gpuhealth.evaluation.nics import Fabric, has_fabric
from gpuhealth.evaluation.noise import NOISE, NoiseEffects
from gpuhealth.evaluation.scenario import HANG_MAX, Failure, Noise, Scenario
from gpuhealth.evaluation.workload import Timeline, Workload, schedule

NFS_OPS = ("READ", "WRITE", "GETATTR")
NFS_MOUNT = "/checkpoints"


@dataclass
class Family:
    """One metric family: its sample name, type and series (label text, values)."""

    name: str
    kind: str
    series: list[tuple[str, np.ndarray]]


def _counter(increments: np.ndarray, offset: np.ndarray | float = 0.0) -> np.ndarray:
    return np.cumsum(increments, axis=-1) + (np.asarray(offset)[..., None] if np.ndim(offset) else offset)


def _first_event_on(counter: np.ndarray) -> np.ndarray:
    """An event counter absent (NaN) until its first event."""
    return np.where(counter == 0, np.nan, counter)


class FleetSignals:
    """Builds each metric family on demand from shared per-GPU and per-node state."""

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.fleet = scenario.fleet
        self.timeline = Timeline.of(scenario)
        self.gpus = self.fleet.nodes * self.fleet.gpus_per_node
        self.shape = (self.gpus, self.timeline.count)
        self.node_labels = [
            f'instance="{n}:9835",job="gpuhealth-exporter",node="{n}"' for n in self.fleet.node_names
        ]
        self.gpu_labels = [
            f'gpu="{g}",{labels}' for labels in self.node_labels for g in range(self.fleet.gpus_per_node)
        ]
        self.builders: dict[str, Callable[[], Iterator[Family]]] = {
            "up": self._up,
            "gpuhealth_collector_success": self._collectors,
            "gpuhealth_gpus_expected": self._gpu_counts,
            "gpuhealth_gpus_visible": self._gpu_counts,
            "gpuhealth_gpu_info": self._info,
            "gpuhealth_gpu_up": self._gpu_up,
            "gpuhealth_gpu_nvml_errors_total": self._nvml_errors,
            "gpuhealth_gpu_nvml_latency_seconds": self._nvml_latency,
            "gpuhealth_gpu_temperature_celsius": self._temperatures,
            "gpuhealth_gpu_temperature_max_celsius": self._temperatures,
            "gpuhealth_gpu_memory_temperature_celsius": self._temperatures,
            "gpuhealth_gpu_temperature_slowdown_margin_celsius": self._temperatures,
            "gpuhealth_gpu_temperature_slowdown_threshold_celsius": self._thresholds,
            "gpuhealth_gpu_temperature_shutdown_threshold_celsius": self._thresholds,
            "gpuhealth_gpu_power_watts": self._power,
            "gpuhealth_gpu_power_limit_watts": self._power,
            "gpuhealth_gpu_sm_clock_hertz": self._clocks,
            "gpuhealth_gpu_sm_clock_max_hertz": self._clocks,
            "gpuhealth_gpu_clock_event_active": self._clock_events,
            "gpuhealth_gpu_clock_event_seconds_total": self._clock_events,
            "gpuhealth_gpu_utilization_ratio": self._utilization,
            "gpuhealth_gpu_memory_utilization_ratio": self._utilization,
            "gpuhealth_gpu_memory_used_bytes": self._memory,
            "gpuhealth_gpu_memory_total_bytes": self._memory,
            "gpuhealth_gpu_ecc_errors_total": self._ecc,
            "gpuhealth_gpu_remapped_rows": self._remaps,
            "gpuhealth_gpu_remap_pending": self._remaps,
            "gpuhealth_gpu_remap_failure": self._remaps,
            "gpuhealth_gpu_pcie_replays_total": self._pcie,
            "gpuhealth_gpu_pcie_link_generation": self._pcie,
            "gpuhealth_gpu_pcie_link_generation_max": self._pcie,
            "gpuhealth_gpu_pcie_link_width_lanes": self._pcie,
            "gpuhealth_gpu_pcie_link_width_max_lanes": self._pcie,
            "gpuhealth_gpu_pcie_link_downgraded": self._pcie,
            "gpuhealth_pcie_aer_errors_total": self._aer,
            "gpuhealth_gpu_nvlink_up": self._nvlink,
            "gpuhealth_gpu_nvlink_errors_total": self._nvlink,
            "gpuhealth_gpu_nvlink_errors_all_links_total": self._nvlink,
            "gpuhealth_gpu_processes": self._processes,
            "gpuhealth_gpu_job_info": self._jobs,
            "gpuhealth_xid_events_total": self._xids,
            "gpuhealth_gpu_fallen_off_bus_total": self._fallen,
            "gpuhealth_host_cpu_seconds_total": self._cpu,
            "gpuhealth_host_memory_total_bytes": self._host_memory,
            "gpuhealth_host_memory_available_bytes": self._host_memory,
            "gpuhealth_host_load1": self._load,
            "gpuhealth_host_interrupts_total": self._interrupts,
            "gpuhealth_host_context_switches_total": self._interrupts,
            "gpuhealth_host_procs_running": self._load,
            "gpuhealth_host_page_outs_total": self._paging,
            "gpuhealth_host_swap_outs_total": self._paging,
            "gpuhealth_host_disk_read_bytes_total": self._io,
            "gpuhealth_host_disk_written_bytes_total": self._io,
            "gpuhealth_host_network_receive_bytes_total": self._io,
            "gpuhealth_host_network_transmit_bytes_total": self._io,
            **{
                name: self._nfs
                for name in (
                    "gpuhealth_nfs_rpc_operations_total",
                    "gpuhealth_nfs_rpc_transmissions_total",
                    "gpuhealth_nfs_rpc_queue_seconds_total",
                    "gpuhealth_nfs_rpc_rtt_seconds_total",
                    "gpuhealth_nfs_rpc_execute_seconds_total",
                    "gpuhealth_nfs_transport_sends_total",
                    "gpuhealth_nfs_transport_backlog_queue_total",
                )
            },
        }
        if has_fabric(self):
            self.builders.update(self.fabric.builders())

    # ---- output -------------------------------------------------------------------------------------
    def families(self, wanted: Callable[[str], bool] = lambda name: True) -> Iterator[Family]:
        """Every family whose sample name ``wanted`` accepts; shared builders run once."""
        done: set[Callable[[], Iterator[Family]]] = set()
        for name, builder in self.builders.items():
            if not wanted(name) or builder in done:
                continue
            done.add(builder)
            for family in builder():
                if wanted(family.name):
                    yield family

    def _rows(self, values: np.ndarray, labels: list[str], extra: str = "") -> list[tuple[str, np.ndarray]]:
        return [(f"{extra}{label}" if extra else label, values[i]) for i, label in enumerate(labels)]

    def _family(self, name: str, rows: list[tuple[str, np.ndarray]]) -> Family:
        """A family of the exporter's metric table, of the type it has there (``up`` is Prometheus's)."""
        return Family(name, "gauge" if name == "up" else SPECS[name].kind, rows)

    def _series(self, name: str, values: np.ndarray, extra: str = "", node: bool = False) -> Family:
        """One series per GPU (or per node), labels ``extra`` first."""
        return self._family(name, self._rows(values, self.node_labels if node else self.gpu_labels, extra))

    # ---- shared state -------------------------------------------------------------------------------
    def rng(self, purpose: str) -> np.random.Generator:
        """An independent stream per purpose, so adding a signal does not reshuffle the others."""
        return np.random.default_rng([self.scenario.seed, *purpose.encode()])

    def at(self, rel: float) -> int:
        return self.timeline.index(self.scenario.start + rel)

    def gpu_index(self, node: str, gpu: int | None) -> int:
        if gpu is None:
            raise ValueError(f"an event on one GPU of {node} names no GPU")
        return self.fleet.node_names.index(node) * self.fleet.gpus_per_node + gpu

    def node_index(self, node: str) -> int:
        return self.fleet.node_names.index(node)

    @cached_property
    def fabric(self) -> Fabric:
        """The fleet's NIC ports and NVSwitch SXIDs (``nics.py``)."""
        return Fabric(self)

    @cached_property
    def events(self) -> list[Effects]:
        """Every fault and benign event, in the order they fold into the signals they share."""
        rank = {kind: r for r, kinds in enumerate(FOLD_ORDER) for kind in kinds}
        ranked: list[tuple[int, int, Effects]] = [
            *((rank[e.event.kind], i, e) for i, e in enumerate(self.faults)),
            *((rank[e.event.kind], i, e) for i, e in enumerate(self.noise)),
        ]
        return [effects for _, _, effects in sorted(ranked, key=lambda item: item[:2])]

    @cached_property
    def faults(self) -> list[FaultEffects]:
        """The scenario's faults, in scenario order."""
        return [FAULTS[f.kind](self, f) for f in self.scenario.failures]

    @cached_property
    def noise(self) -> list[NoiseEffects]:
        """The scenario's benign events, in scenario order."""
        return [NOISE[n.kind](self, n, i) for i, n in enumerate(self.scenario.noise)]

    def span(self, rel: float, length: float) -> slice:
        """Sample indices of [rel, rel + length), at least one sample."""
        a = self.at(rel)
        return slice(a, max(self.at(rel + length), min(a + 1, self.timeline.count)))

    def rack(self, node: str) -> range:
        """Node indices in the rack of ``node``."""
        size = self.fleet.rack_nodes
        first = self.node_index(node) // size * size
        return range(first, min(first + size, self.fleet.nodes))

    def node_gpus(self, node: int) -> slice:
        g = self.fleet.gpus_per_node
        return slice(node * g, (node + 1) * g)

    @cached_property
    def failure_params(self) -> dict[Failure, dict[str, float]]:
        """Per-event draws: ramp exponent, hang length, and which of the signals physics ties to the
        fault this one moves (a failing PCIe link does not always log AER or downgrade)."""
        rng = self.rng("failure-params")
        return {
            f: {
                "shape": rng.uniform(1.0, 3.0),
                "hang": rng.uniform(600, HANG_MAX),
                "extra": rng.uniform(0, 1),
                "link": int(rng.integers(0, max(self.fleet.nvlinks, 1))),
                "aer": rng.random() < 0.5,
                "downgrade": rng.random() < 0.35,
                "generation": rng.random() < 0.4,
                "remaps": rng.random(),  # how many rows the wear hits again and again (``MemoryFault``)
                "quiet": rng.random() < 0.35,
                "rise": rng.uniform(0.03, 0.3),
                "steps": int(rng.integers(1, 4)),
                "seed": int(rng.integers(0, 2**31)),
            }
            for f in self.scenario.failures
        }

    def precursor(self, failure: Failure) -> np.ndarray:
        """0..1 over the timeline: the fault's precursor between onset and the first XID, in the
        event's shape (ramp, plateau, step, intermittent bursts); 1 from the first XID to the hard
        failure; 0 elsewhere."""
        out = np.zeros(self.timeline.count)
        params = self.failure_params[failure]
        a, b = self.at(failure.onset), self.at(failure.instant)
        out[b : self.at(failure.failure)] = 1.0 if failure.has_precursor else 0.0
        n = b - a
        if n <= 0 or failure.shape == "none":
            return out
        x = np.linspace(0, 1, n, endpoint=False)
        rng = np.random.default_rng(int(params["seed"]))
        if failure.shape == "plateau":
            out[a:b] = np.minimum(x / params["rise"], 1.0)
        elif failure.shape == "step":
            edges = np.sort(rng.uniform(0, 0.9, int(params["steps"])))
            edges[0] = 0.0
            out[a:b] = (x[:, None] >= edges[None, :]).sum(axis=1) / edges.size
        elif failure.shape == "intermittent":
            step, t = self.timeline.step, 0
            while t < n:  # bursts of 10 min to 3 h, quiet for 6 h to 2 days between them
                burst = int(np.exp(rng.uniform(np.log(600), np.log(3 * 3600))) / step) + 1
                out[a + t : a + min(t + burst, n)] = 1.0
                t += burst + int(np.exp(rng.uniform(np.log(6 * 3600), np.log(2 * 86400))) / step)
        else:
            out[a:b] = x ** params["shape"]
        return out

    @cached_property
    def down(self) -> np.ndarray:
        """(nodes, T): the node is rebooting, its exporter does not answer."""
        out = np.zeros((self.fleet.nodes, self.timeline.count), dtype=bool)
        for event in self.events:
            event.offline(out)
        return out

    @cached_property
    def workload(self) -> Workload:
        work = schedule(self.scenario, self.timeline, self.rng("workload"))
        for event in self.events:
            event.no_job(work.job)
        for failure in self.scenario.failures:  # drained until repaired
            hang_end = failure.failure + self.failure_params[failure]["hang"]
            back = self.timeline.count if failure.repaired is None else self.at(failure.repaired)
            work.job[self.node_index(failure.node), self.at(hang_end) : back] = -1
        work.checkpoint &= work.job >= 0
        return work

    def reach(self, noise: Noise) -> list[str]:
        """The nodes a benign event touches: its job's nodes, its rack, or its own node."""
        return self.noise[self.scenario.noise.index(noise)].reach()

    def job_nodes(self, noise: Noise) -> list[int]:
        """Nodes running the job that runs on the event's node when it starts (the node alone if idle)."""
        node, at = self.node_index(noise.node), self.at(noise.at)
        job = self.workload.job[node, min(at, self.timeline.count - 1)]
        if job < 0:
            return [node]
        return np.flatnonzero(self.workload.job[:, min(at, self.timeline.count - 1)] == job).tolist()

    @cached_property
    def checkpoint_load(self) -> np.ndarray:
        """(nodes, T) checkpoint write intensity: 1 for a regular checkpoint, more for a burst or a
        storm (several jobs writing at once)."""
        load = self.workload.checkpoint.astype(float)
        for event in self.events:
            event.checkpoint(load)
        return load

    @cached_property
    def hung(self) -> np.ndarray:
        """(nodes, T): the job hangs in a collective between the hard failure and its kill."""
        out = np.zeros((self.fleet.nodes, self.timeline.count), dtype=bool)
        for failure in self.scenario.failures:
            a = self.at(failure.failure)
            out[
                self.node_index(failure.node),
                a : self.at(failure.failure + self.failure_params[failure]["hang"]),
            ] = True
        return out

    def out_of_service(self, failure: Failure) -> slice:
        """From the hard failure until the node is back from repair."""
        back = self.timeline.count if failure.repaired is None else self.at(failure.repaired)
        return slice(self.at(failure.failure), back)

    @cached_property
    def lost(self) -> np.ndarray:
        """(GPUs, T): NVML no longer answers for the GPU (until it is replaced), or the node reboots."""
        out = self.per_gpu(self.down).copy()
        for fault in self.faults:
            if fault.lost_error:
                out[fault.row, self.out_of_service(fault.event)] = True
        return out

    def replaced(self, counter: np.ndarray, row: int | None = None) -> np.ndarray:
        """A GPU's counter restarts from zero once the failed GPU is replaced by the repair: (GPUs, T)
        values, or one GPU's row when ``row`` names it."""
        out = counter.copy()
        for failure in sorted(self.scenario.failures, key=lambda f: f.repaired or 0):
            i, back = self.gpu_index(failure.node, failure.gpu), failure.repaired
            if back is None or (row is not None and i != row) or self.at(back) >= self.timeline.count:
                continue
            r = self.at(back)
            line = out if row is not None else out[i]
            line[r:] -= line[max(r - 1, 0)]
        return out

    def per_gpu(self, node_values: np.ndarray) -> np.ndarray:
        return np.repeat(node_values, self.fleet.gpus_per_node, axis=0)

    def readable(self, values: np.ndarray) -> np.ndarray:
        """NVML readings: absent once the GPU is lost."""
        return np.where(self.lost, np.nan, values)

    @cached_property
    def busy(self) -> np.ndarray:
        return self.per_gpu(self.workload.busy)

    @cached_property
    def job_intensity(self) -> np.ndarray:
        """(nodes, T) how hard the running job drives its GPUs: each job its own, 0.75..1."""
        job = self.workload.job
        return np.where(job >= 0, 0.75 + 0.25 * ((job * 2654435761) % 1009) / 1009, 1.0)

    @cached_property
    def utilization(self) -> np.ndarray:
        rng = self.rng("utilization")
        util = np.clip(rng.normal(0.94, 0.025, self.shape), 0.6, 1.0) * self.busy
        util *= self.per_gpu(self.job_intensity)
        for event in self.events:
            event.utilization(util)
        util = np.where(self.per_gpu(self.checkpoint_load > 0), 0.12 * self.busy, util)
        return np.where(self.per_gpu(self.hung), 1.0, util)

    @cached_property
    def power_limit(self) -> np.ndarray:
        limit = np.full(self.shape, POWER_LIMIT_W)
        for event in self.events:
            event.power_limit(limit)
        return limit

    @cached_property
    def power_brake(self) -> np.ndarray:
        """(GPUs, T): the facility asserts power brake (HW slowdown)."""
        out = np.zeros(self.shape, dtype=bool)
        for event in self.events:
            event.power_brake(out)
        return out

    @cached_property
    def power(self) -> np.ndarray:
        rng = self.rng("power")
        load_power = rng.uniform(600, 690, (self.gpus, 1))
        draw = IDLE_POWER_W + self.utilization * (load_power - IDLE_POWER_W) + rng.normal(0, 10, self.shape)
        draw = np.where(self.power_brake, np.minimum(draw, 0.45 * POWER_LIMIT_W), draw)
        return np.clip(draw, IDLE_POWER_W - 15, self.power_limit)

    @cached_property
    def thermal_offset(self) -> np.ndarray:
        """Extra heat at the same load: hot aisles and rack cooling incidents, chronically warm GPUs,
        and thermal faults."""
        offset = np.zeros(self.shape)
        for event in self.events:
            event.heat(offset)
        return offset

    @cached_property
    def temperature(self) -> np.ndarray:
        """Smoothed heat from power draw (a few minutes' thermal lag), plus offsets, NVML integer degrees."""
        rng = self.rng("temperature")
        target = (
            30
            + rng.normal(0, 1.0, (self.fleet.nodes, 1)).repeat(self.fleet.gpus_per_node, 0)
            + rng.normal(0, 1.5, (self.gpus, 1))
            + 42 * (self.power - IDLE_POWER_W) / 630
            + self.thermal_offset
        )
        alpha = 1 - np.exp(-self.timeline.step / 180)
        smooth = np.empty(self.shape)
        smooth[:, 0] = target[:, 0]
        for i in range(1, self.timeline.count):
            smooth[:, i] = smooth[:, i - 1] + alpha * (target[:, i] - smooth[:, i - 1])
        return np.round(smooth + rng.normal(0, 0.5, self.shape))

    @cached_property
    def temperature_max(self) -> np.ndarray:
        return self.temperature + np.ceil(np.abs(self.rng("tmax").normal(0, 0.8, self.shape)))

    @cached_property
    def clock_events(self) -> dict[str, np.ndarray]:
        """Fraction of each sampling window spent in each clock event reason."""
        zero = np.zeros(self.shape)
        busy = self.busy.astype(float)
        capped = (self.power_limit < POWER_LIMIT_W) & self.busy
        return {
            "gpu_idle": 1 - busy,
            "applications_clocks_setting": zero,
            "sw_power_cap": capped.astype(float),
            "hw_slowdown": self.power_brake.astype(float),
            "sync_boost": zero,
            "sw_thermal_slowdown": np.clip((self.temperature_max - (SLOWDOWN_C - 4)) / 4, 0, 1),
            "hw_thermal_slowdown": np.clip((self.temperature_max - SLOWDOWN_C + 1) / 3, 0, 1),
            "hw_power_brake_slowdown": self.power_brake.astype(float),
            "display_clock_setting": zero,
        }

    # ---- GPU families -------------------------------------------------------------------------------
    def _up(self) -> Iterator[Family]:
        yield self._series("up", np.where(self.down, 0.0, 1.0), node=True)

    def _collectors(self) -> Iterator[Family]:
        ones = np.ones((self.fleet.nodes, self.timeline.count))
        yield self._family(
            "gpuhealth_collector_success",
            [row for c in COLLECTORS for row in self._rows(ones, self.node_labels, f'collector="{c}",')],
        )

    def _gpu_counts(self) -> Iterator[Family]:
        expected = np.full((self.fleet.nodes, self.timeline.count), float(self.fleet.gpus_per_node))
        visible = expected.copy()
        for fault in self.faults:
            if fault.falls_off_bus:
                visible[self.node_index(fault.event.node), self.out_of_service(fault.event)] -= 1
        yield self._series("gpuhealth_gpus_expected", expected, node=True)
        yield self._series("gpuhealth_gpus_visible", visible, node=True)

    def _info(self) -> Iterator[Family]:
        ones = np.ones(self.timeline.count)
        buses = ("18", "2a", "3a", "5d", "9a", "ab", "ba", "db")
        rows = []
        for i, labels in enumerate(self.gpu_labels):
            node, gpu = divmod(i, self.fleet.gpus_per_node)
            rows.append(
                (
                    f'uuid="GPU-{self.scenario.seed:08x}-{node:04x}-{gpu:04x}",'
                    f'pci_bus_id="00000000:{buses[gpu % len(buses)].upper()}:00.0",'
                    f'model="{self.fleet.model}",serial="{1650000000000 + i}",driver_version="550.90.07",'
                    f'vbios_version="96.00.99.00.01",{labels}',
                    ones,
                )
            )
        yield self._family("gpuhealth_gpu_info", rows)

    def _gpu_up(self) -> Iterator[Family]:
        yield self._series("gpuhealth_gpu_up", np.where(self.lost, 0.0, 1.0))

    def _nvml_errors(self) -> Iterator[Family]:
        rows = []
        for fault in self.faults:
            if not fault.lost_error:
                continue
            lost = np.zeros(self.timeline.count)
            lost[self.out_of_service(fault.event)] = 1
            values = _first_event_on(np.cumsum(lost))
            rows.append((f'error="{fault.lost_error}",query="sample",{self.gpu_labels[fault.row]}', values))
        yield self._family("gpuhealth_gpu_nvml_errors_total", rows)

    def _nvml_latency(self) -> Iterator[Family]:
        rng = self.rng("nvml-latency")
        latency = 0.003 + 0.002 * rng.lognormal(0, 0.4, self.shape)
        for event in self.events:
            event.nvml_latency(latency)
        yield self._series("gpuhealth_gpu_nvml_latency_seconds", self.readable(np.round(latency, 4)))

    def _temperatures(self) -> Iterator[Family]:
        rng = self.rng("memory-temperature")
        memory = np.round(self.temperature + 5 + 0.3 * self.thermal_offset + rng.normal(0, 0.6, self.shape))
        yield self._series("gpuhealth_gpu_temperature_celsius", self.readable(self.temperature))
        yield self._series("gpuhealth_gpu_temperature_max_celsius", self.readable(self.temperature_max))
        yield self._series("gpuhealth_gpu_memory_temperature_celsius", self.readable(memory))
        yield self._series(
            "gpuhealth_gpu_temperature_slowdown_margin_celsius",
            self.readable(SLOWDOWN_C - self.temperature_max),
        )

    def _thresholds(self) -> Iterator[Family]:
        yield self._series(
            "gpuhealth_gpu_temperature_slowdown_threshold_celsius",
            self.readable(np.full(self.shape, SLOWDOWN_C)),
        )
        yield self._series(
            "gpuhealth_gpu_temperature_shutdown_threshold_celsius",
            self.readable(np.full(self.shape, SHUTDOWN_C)),
        )

    def _power(self) -> Iterator[Family]:
        yield self._series("gpuhealth_gpu_power_watts", self.readable(np.round(self.power, 1)))
        yield self._series("gpuhealth_gpu_power_limit_watts", self.readable(self.power_limit))

    def _clocks(self) -> Iterator[Family]:
        events = self.clock_events
        factor = (
            (self.power_limit / POWER_LIMIT_W) ** 0.6
            * (1 - 0.25 * events["sw_thermal_slowdown"])
            * (1 - 0.3 * events["hw_thermal_slowdown"])
            * (1 - 0.5 * events["hw_slowdown"])
        )
        clock = np.where(self.busy, np.round(SM_CLOCK_MAX_HZ * factor / 15e6) * 15e6, SM_CLOCK_IDLE_HZ)
        yield self._series("gpuhealth_gpu_sm_clock_hertz", self.readable(clock))
        yield self._series(
            "gpuhealth_gpu_sm_clock_max_hertz", self.readable(np.full(self.shape, SM_CLOCK_MAX_HZ))
        )

    def _clock_events(self) -> Iterator[Family]:
        events = self.clock_events
        yield self._family(
            "gpuhealth_gpu_clock_event_active",
            [
                row
                for reason in CLOCK_EVENT_REASONS
                for row in self._rows(
                    self.readable(np.round(events[reason])), self.gpu_labels, f'reason="{reason}",'
                )
            ],
        )
        yield self._family(
            "gpuhealth_gpu_clock_event_seconds_total",
            [
                row
                for reason in CLOCK_EVENT_REASONS
                for row in self._rows(
                    self.readable(np.round(_counter(events[reason] * self.timeline.step), 3)),
                    self.gpu_labels,
                    f'reason="{reason}",',
                )
            ],
        )

    def _utilization(self) -> Iterator[Family]:
        util = np.round(self.utilization, 2)
        yield self._series("gpuhealth_gpu_utilization_ratio", self.readable(util))
        yield self._series("gpuhealth_gpu_memory_utilization_ratio", self.readable(np.round(util * 0.55, 2)))

    def _memory(self) -> Iterator[Family]:
        used = np.where(self.busy, 0.9 * MEMORY_TOTAL_BYTES, 0.6e9)
        yield self._series("gpuhealth_gpu_memory_used_bytes", self.readable(used))
        yield self._series(
            "gpuhealth_gpu_memory_total_bytes", self.readable(np.full(self.shape, float(MEMORY_TOTAL_BYTES)))
        )

    @cached_property
    def hbm(self) -> dict[str, np.ndarray]:
        """ECC and row-remap increments: background SBEs, SBE bursts and chatter, benign remaps and
        contained errors, HBM degradations and sudden uncorrectable errors."""
        rng = self.rng("hbm")
        kinds = ("corrected", "uncorrected", "remapped", "uncorrectable")
        hbm = {kind: np.zeros(self.shape) for kind in kinds}
        background = rng.random(self.gpus) < 0.04  # a few GPUs log the odd corrected error
        hbm["corrected"][background] = rng.poisson(
            self.timeline.step / 86400, (int(background.sum()), self.timeline.count)
        )
        hbm["pending"], hbm["failure"] = np.zeros(self.shape), np.zeros(self.shape)
        for event in self.events:
            event.memory_errors(hbm, rng)
        return hbm

    def _ecc(self) -> Iterator[Family]:
        rng = self.rng("ecc-lifetime")
        lifetime = np.where(rng.random(self.gpus) < 0.1, rng.integers(1, 50, self.gpus), 0).astype(float)
        rows = []
        for kind, counter_kind, offset in (
            ("corrected", "volatile", 0.0),
            ("corrected", "aggregate", lifetime),
            ("uncorrected", "volatile", 0.0),
            ("uncorrected", "aggregate", 0.0),
        ):
            values = self.readable(self.replaced(_counter(self.hbm[kind], offset)))
            rows += self._rows(values, self.gpu_labels, f'type="{kind}",counter="{counter_kind}",')
        yield self._family("gpuhealth_gpu_ecc_errors_total", rows)

    def _remaps(self) -> Iterator[Family]:
        rng = self.rng("remap-lifetime")
        lifetime = np.where(rng.random(self.gpus) < 0.05, rng.integers(1, 3, self.gpus), 0).astype(float)
        yield self._family(
            "gpuhealth_gpu_remapped_rows",
            [
                *self._rows(
                    self.readable(self.replaced(_counter(self.hbm["remapped"], lifetime))),
                    self.gpu_labels,
                    'type="correctable",',
                ),
                *self._rows(
                    self.readable(self.replaced(_counter(self.hbm["uncorrectable"]))),
                    self.gpu_labels,
                    'type="uncorrectable",',
                ),
            ],
        )
        yield self._series("gpuhealth_gpu_remap_pending", self.readable(self.hbm["pending"]))
        yield self._series("gpuhealth_gpu_remap_failure", self.readable(self.hbm["failure"]))

    @cached_property
    def replays(self) -> np.ndarray:
        """(GPUs, T) PCIe replay increments: boots, healthy links that replay, failing links."""
        rng = self.rng("pcie")
        replays = np.zeros(self.shape)
        for event in self.events:
            event.replays(replays, rng)
        return replays

    @cached_property
    def aer(self) -> dict[int, np.ndarray]:
        """Corrected AER increments per GPU: some failing links and some healthy replaying ones log
        them, at their own rate."""
        rng = self.rng("aer")
        out: dict[int, np.ndarray] = {}
        for event in self.events:
            event.aer(out, rng)
        return out

    def _pcie(self) -> Iterator[Family]:
        rng = self.rng("pcie-lifetime")
        lifetime = np.where(rng.random(self.gpus) < 0.1, rng.integers(1, 200, self.gpus), 0).astype(float)
        width = np.full(self.shape, 16.0)
        generation = np.full(self.shape, 5.0)
        for event in self.events:
            event.pcie_link(width, generation)
        yield self._series(
            "gpuhealth_gpu_pcie_replays_total", self.readable(self.replaced(_counter(self.replays, lifetime)))
        )
        yield self._series("gpuhealth_gpu_pcie_link_generation", self.readable(generation))
        yield self._series("gpuhealth_gpu_pcie_link_generation_max", self.readable(np.full(self.shape, 5.0)))
        yield self._series("gpuhealth_gpu_pcie_link_width_lanes", self.readable(width))
        yield self._series(
            "gpuhealth_gpu_pcie_link_width_max_lanes", self.readable(np.full(self.shape, 16.0))
        )
        yield self._series(
            "gpuhealth_gpu_pcie_link_downgraded",
            self.readable(((width < 16) | (generation < 5)).astype(float)),
        )

    def _aer(self) -> Iterator[Family]:
        rows = []
        for i, increments in sorted(self.aer.items()):
            node, gpu = divmod(i, self.fleet.gpus_per_node)
            rows.append(
                (
                    f'pci_bus_id="00000000:{18 + gpu:02X}:00.0",severity="corrected",'
                    f'gpu="{gpu}",{self.node_labels[node]}',
                    _counter(increments),
                )
            )
        yield self._family("gpuhealth_pcie_aer_errors_total", rows)

    @cached_property
    def nvlink_errors(self) -> tuple[dict[tuple[int, int], np.ndarray], dict[tuple[int, int], np.ndarray]]:
        """CRC flit increments and down masks per (GPU, link): failing links (some stay quiet until the
        end) and links that flap and heal."""
        rng = self.rng("nvlink")
        flits: dict[tuple[int, int], np.ndarray] = {}
        down: dict[tuple[int, int], np.ndarray] = {}
        for event in self.events:
            event.nvlink(flits, down, rng)
        return flits, down

    def _nvlink(self) -> Iterator[Family]:
        """Every link of every GPU; only failing or flapping links move."""
        rng = self.rng("nvlink-split")
        flits, down = self.nvlink_errors
        moving = {
            key: {
                "crc_flit": flit,
                "crc_data": rng.binomial(flit.astype(np.int64), 0.1),
                "replay": rng.binomial(flit.astype(np.int64), 0.2),
                "recovery": rng.binomial(flit.astype(np.int64), 0.01),
            }
            for key, flit in flits.items()
        }
        zeros = self.readable(np.zeros(self.shape))
        ones = self.readable(np.ones(self.shape))
        up_rows, error_rows = [], []
        totals = {i: zeros[i] for i in range(len(self.gpu_labels))}
        for link in range(self.fleet.nvlinks):
            for i, labels in enumerate(self.gpu_labels):
                state = ones[i]
                if (i, link) in down:
                    state = np.where(down[(i, link)] & ~np.isnan(state), 0.0, state)
                up_rows.append((f'link="{link}",{labels}', state))
                for kind in LEGACY_NVLINK_ERROR_TYPES:
                    values = zeros[i]
                    if (i, link) in moving:
                        counter = self.replaced(_counter(moving[(i, link)][kind]), i)
                        values = np.where(self.lost[i], np.nan, counter)
                        totals[i] = totals[i] + values
                    error_rows.append((f'link="{link}",type="{kind}",{labels}', values))
        yield self._family("gpuhealth_gpu_nvlink_up", up_rows)
        yield self._family("gpuhealth_gpu_nvlink_errors_total", error_rows)
        yield self._family(
            "gpuhealth_gpu_nvlink_errors_all_links_total",
            [(self.gpu_labels[i], values) for i, values in totals.items()],
        )

    def _processes(self) -> Iterator[Family]:
        yield self._series("gpuhealth_gpu_processes", self.readable(self.busy.astype(float)))

    def _jobs(self) -> Iterator[Family]:
        rows = []
        for node, labels in enumerate(self.node_labels):
            jobs = self.workload.job[node]
            for job_id in np.unique(jobs[jobs >= 0]):
                values = np.where(jobs == job_id, 1.0, np.nan)
                rows += [
                    (f'gpu="{g}",job_id="{job_id}",{labels}', values) for g in range(self.fleet.gpus_per_node)
                ]
        yield self._family("gpuhealth_gpu_job_info", rows)

    @cached_property
    def boots(self) -> dict[int, list[int]]:
        """Per node, the sample indices where the node (and its exporter) starts again: back from
        repair, or a reboot; the exporter's event counters start from zero there."""
        out: dict[int, list[int]] = {}
        for failure in self.scenario.failures:
            if failure.repaired is not None:
                out.setdefault(self.node_index(failure.node), []).append(self.at(failure.repaired))
        for noise in self.noise:
            out.setdefault(noise.node, []).extend(self.at(b) for b in noise.restarts())
        return {node: sorted(i for i in set(boots) if i < self.timeline.count) for node, boots in out.items()}

    def events_counter(self, i: int, increments: np.ndarray) -> np.ndarray:
        """The exporter's counter of events on GPU ``i``: absent until the first event after each boot."""
        out = np.empty(self.timeline.count)
        edges = [0, *self.boots.get(i // self.fleet.gpus_per_node, []), self.timeline.count]
        for a, b in itertools.pairwise(edges):
            out[a:b] = _first_event_on(np.cumsum(increments[a:b]))
        return out

    @cached_property
    def xid_events(self) -> dict[tuple[int, int], np.ndarray]:
        """Increments per (GPU, XID): remapped rows (63), and what each event logs."""
        events: dict[tuple[int, int], np.ndarray] = {}

        def add(i: int, xid: int, at: int, count: float = 1.0) -> None:
            if at < self.timeline.count:
                events.setdefault((i, xid), np.zeros(self.timeline.count))[at] += count

        remaps = self.hbm["remapped"] + self.hbm["uncorrectable"]
        for i, k in zip(*np.nonzero(remaps), strict=True):
            add(int(i), 63, int(k), remaps[i, k])
        for event in self.events:
            event.xids(add)
        return events

    def _xids(self) -> Iterator[Family]:
        """A GPU's counter of an XID appears with its first event, as the exporter publishes them."""
        rows = [
            (f'xid="{xid}",{self.gpu_labels[i]}', self.events_counter(i, increments))
            for (i, xid), increments in sorted(self.xid_events.items())
        ]
        yield self._family("gpuhealth_xid_events_total", rows)

    def _fallen(self) -> Iterator[Family]:
        """Only a GPU that fell off the bus has the counter, from then on, as the exporter publishes it."""
        falls: dict[int, np.ndarray] = {}
        for fault in self.faults:
            at = self.at(fault.event.failure)
            if fault.falls_off_bus and at < self.timeline.count:
                falls.setdefault(fault.row, np.zeros(self.timeline.count))[at] += 1
        rows = [(self.gpu_labels[i], self.events_counter(i, f)) for i, f in sorted(falls.items())]
        yield self._family("gpuhealth_gpu_fallen_off_bus_total", rows)

    # ---- host families ------------------------------------------------------------------------------
    def node_rate(
        self,
        purpose: str,
        busy: float,
        idle: float,
        hung: float,
        checkpoint: float = 0.0,
        spread: float = 0.05,
    ) -> np.ndarray:
        """Per-node rate following the workload: busy/idle/hung levels plus checkpoint load and jitter."""
        work = self.workload.busy
        level = np.where(work, busy, idle) + checkpoint * self.checkpoint_load
        level = np.where(self.hung, hung, level)
        return np.maximum(level * self.rng(purpose).normal(1, spread, level.shape), 0)

    def _cpu(self) -> Iterator[Family]:
        step = self.timeline.step
        user = self.node_rate("cpu-user", 40, 0.6, 4)
        system = self.node_rate("cpu-system", 6, 0.3, 1)
        iowait = self.node_rate("cpu-iowait", 0.2, 0.05, 0.05, checkpoint=6)
        idle = np.maximum(HOST_CPUS - user - system - iowait, 0)
        rows = []
        for mode, rate in (("user", user), ("system", system), ("iowait", iowait), ("idle", idle)):
            rows += self._rows(np.round(_counter(rate * step), 2), self.node_labels, f'mode="{mode}",')
        yield self._family("gpuhealth_host_cpu_seconds_total", rows)

    def _host_memory(self) -> Iterator[Family]:
        shape = (self.fleet.nodes, self.timeline.count)
        yield self._series(
            "gpuhealth_host_memory_total_bytes", np.full(shape, float(HOST_MEMORY_BYTES)), node=True
        )
        available = (
            HOST_MEMORY_BYTES - self.node_rate("memory", 0.45, 0.05, 0.45, checkpoint=0.1) * HOST_MEMORY_BYTES
        )
        yield self._series("gpuhealth_host_memory_available_bytes", np.round(available, -6), node=True)

    def _load(self) -> Iterator[Family]:
        procs = np.round(self.node_rate("procs", 12, 1, 0.3, checkpoint=2, spread=0.2))
        alpha = 1 - np.exp(-self.timeline.step / 60)
        load = np.empty(procs.shape)
        load[:, 0] = procs[:, 0]
        for i in range(1, procs.shape[1]):
            load[:, i] = load[:, i - 1] + alpha * (procs[:, i] - load[:, i - 1])
        yield self._series("gpuhealth_host_procs_running", procs, node=True)
        yield self._series("gpuhealth_host_load1", np.round(load, 2), node=True)

    def _interrupts(self) -> Iterator[Family]:
        step = self.timeline.step
        yield self._series(
            "gpuhealth_host_interrupts_total",
            np.round(_counter(self.node_rate("interrupts", 10000, 1500, 2600, 2000) * step)),
            node=True,
        )
        yield self._series(
            "gpuhealth_host_context_switches_total",
            np.round(_counter(self.node_rate("ctxt", 50000, 4000, 7000, 8000) * step)),
            node=True,
        )

    @cached_property
    def storage_stress(self) -> np.ndarray:
        """(nodes, T) 0..1: some HBM failures stall the host before the XID (paging, slow NFS metadata),
        and so do checkpoint storms."""
        stress = np.zeros((self.fleet.nodes, self.timeline.count))
        for event in self.events:
            event.storage_stress(stress)
        # a checkpoint storm saturates the client's RPC slots: metadata calls queue and pages go out
        return np.maximum(stress, np.clip((self.checkpoint_load - 1.5) / 4, 0, 0.8))

    def _paging(self) -> Iterator[Family]:
        step = self.timeline.step
        rate = self.node_rate("page-outs", 300, 50, 100, 2500, spread=0.3) + 40000 * self.storage_stress
        yield self._series("gpuhealth_host_page_outs_total", np.round(_counter(rate * step)), node=True)
        yield self._series("gpuhealth_host_swap_outs_total", np.zeros(rate.shape), node=True)

    def _io(self) -> Iterator[Family]:
        step = self.timeline.step
        for name, device, busy, idle, ckpt in (
            ("gpuhealth_host_disk_read_bytes_total", "nvme0n1", 2e6, 1e5, 0),
            ("gpuhealth_host_disk_written_bytes_total", "nvme0n1", 5e6, 2e5, 1e7),
            ("gpuhealth_host_network_receive_bytes_total", "ib0", 9e9, 1e6, 1e9),
            ("gpuhealth_host_network_transmit_bytes_total", "ib0", 9e9, 1e6, 3e9),
        ):
            values = np.round(_counter(self.node_rate(name, busy, idle, idle, ckpt, spread=0.1) * step))
            yield self._series(name, values, extra=f'device="{device}",', node=True)

    def _nfs(self) -> Iterator[Family]:
        """Per-op RPC counters; checkpoints queue WRITEs on the client (slot table exhaustion)."""
        step, load, stress = self.timeline.step, self.checkpoint_load, self.storage_stress
        ops = {
            "READ": self.node_rate("nfs-read", 20, 1, 1, 50, spread=0.2),
            "WRITE": self.node_rate("nfs-write", 5, 0.5, 0.5, 2500, spread=0.2),
            "GETATTR": self.node_rate("nfs-getattr", 40, 5, 5, 20, spread=0.2),
        }
        rtt = {"READ": 0.002 + 0.002 * load, "WRITE": 0.003 + 0.004 * load, "GETATTR": 0.0005 + 0.02 * stress}
        queue = {
            "READ": 0.0001 + 0.005 * load,
            "WRITE": 0.0001 + 0.08 * load,
            "GETATTR": 0.00005 + 0.05 * stress,
        }
        families: dict[str, list[tuple[str, np.ndarray]]] = {}
        for op in NFS_OPS:
            extra = f'mount="{NFS_MOUNT}",op="{op}",'
            count = _counter(ops[op] * step)
            for name, values in (
                ("gpuhealth_nfs_rpc_operations_total", np.round(count)),
                ("gpuhealth_nfs_rpc_transmissions_total", np.round(count * 1.0005)),
                ("gpuhealth_nfs_rpc_queue_seconds_total", np.round(_counter(ops[op] * queue[op] * step), 3)),
                ("gpuhealth_nfs_rpc_rtt_seconds_total", np.round(_counter(ops[op] * rtt[op] * step), 3)),
                (
                    "gpuhealth_nfs_rpc_execute_seconds_total",
                    np.round(_counter(ops[op] * (queue[op] + rtt[op] + 0.0001) * step), 3),
                ),
            ):
                families.setdefault(name, []).extend(self._rows(values, self.node_labels, extra))
        for name, rows in families.items():
            yield self._family(name, rows)
        sends = np.asarray(sum(ops.values()) * step)
        extra = f'mount="{NFS_MOUNT}",'
        yield self._series("gpuhealth_nfs_transport_sends_total", np.round(_counter(sends)), extra, node=True)
        yield self._series(
            "gpuhealth_nfs_transport_backlog_queue_total",
            np.round(_counter(sends * (0.1 + 60 * load))),
            extra,
            node=True,
        )
