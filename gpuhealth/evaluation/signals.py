"""The fleet's time series, under the exporter's metric names, with faults and benign noise applied.

Shapes follow ../shared/DOMAIN.md. A fault's precursor (ramp, plateau, steps or intermittent bursts,
with its own strength) moves only signals physics ties to the fault, and each event draws which of
them it moves; sudden faults show nothing until the XID. After a hard failure the node's job hangs
for a while (interrupts and runnable processes collapse), then the node is drained until repaired.
Benign events move the very signals faults move, so a naive rule is fooled by them. Values are
``float64`` arrays over the timeline, ``NaN`` where the exporter would publish no sample (a GPU lost
from the bus, a rebooting node).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from gpuhealth.evaluation.scenario import HANG_MAX, Failure, Noise, Scenario
from gpuhealth.evaluation.workload import Timeline, Workload, schedule

SLOWDOWN_C, SHUTDOWN_C = 87.0, 92.0
POWER_LIMIT_W, IDLE_POWER_W = 700.0, 70.0
SM_CLOCK_MAX_HZ, SM_CLOCK_IDLE_HZ = 1980e6, 345e6
MEMORY_TOTAL_BYTES = 80 * 1024**3
HOST_MEMORY_BYTES = 2 * 1024**4
HOST_CPUS = 96
CLOCK_REASONS = (
    "gpu_idle",
    "applications_clocks_setting",
    "sw_power_cap",
    "hw_slowdown",
    "sync_boost",
    "sw_thermal_slowdown",
    "hw_thermal_slowdown",
    "hw_power_brake_slowdown",
    "display_clock_setting",
)
NVLINK_ERROR_TYPES = ("crc_flit", "crc_data", "replay", "recovery")
NFS_OPS = ("READ", "WRITE", "GETATTR")
NFS_MOUNT = "/checkpoints"
COLLECTORS = ("nvml", "kmsg", "host", "nfs")
# Kinds after which NVML no longer answers for the GPU.
LOST_KINDS = ("thermal_runaway", "pcie_degradation", "gsp_timeout", "fell_off_bus")


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

    def _gauge(self, name: str, values: np.ndarray, extra: str = "", node: bool = False) -> Family:
        return Family(name, "gauge", self._rows(values, self.node_labels if node else self.gpu_labels, extra))

    def _count(self, name: str, values: np.ndarray, extra: str = "", node: bool = False) -> Family:
        return Family(
            name, "counter", self._rows(values, self.node_labels if node else self.gpu_labels, extra)
        )

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

    def noise_of(self, *kinds: str) -> list[Noise]:
        return [n for n in self.scenario.noise if n.kind in kinds]

    def noise_draws(self, *kinds: str) -> Iterator[tuple[Noise, np.random.Generator]]:
        """Benign events of ``kinds``, each with its own random stream (its draws never depend on
        which other events the scenario holds)."""
        for i, noise in enumerate(self.scenario.noise):
            if noise.kind in kinds:
                yield noise, self.rng(f"noise-{i}-{noise.kind}")

    def faults_of(self, *kinds: str) -> list[Failure]:
        return [f for f in self.scenario.failures if f.kind in kinds]

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
                "remaps": rng.random(),  # how many rows the wear hits again and again (see ``hbm``)
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
        for noise, rng in self.noise_draws("reboot_loop"):
            for boot in self.reboots(noise, rng):
                out[self.node_index(noise.node), self.span(boot - rng.uniform(180, 600), 0)] = True
        return out

    def reboots(self, noise: Noise, rng: np.random.Generator) -> np.ndarray:
        """Boot instants of a reboot loop (offsets from the start), two to eight in its duration."""
        return np.sort(noise.at + rng.uniform(0, noise.duration, int(rng.integers(2, 9))))

    @cached_property
    def workload(self) -> Workload:
        work = schedule(self.scenario, self.timeline, self.rng("workload"))
        for noise in self.noise_of("idle_node", "reboot_loop"):
            work.job[self.node_index(noise.node), self.span(noise.at, noise.duration)] = -1
        for noise in self.noise_of("boot_replay_burst"):  # the node reboots, then the burst
            work.job[self.node_index(noise.node), self.at(noise.at - 600) : self.at(noise.at)] = -1
        for failure in self.scenario.failures:  # drained until repaired
            hang_end = failure.failure + self.failure_params[failure]["hang"]
            back = self.timeline.count if failure.repaired is None else self.at(failure.repaired)
            work.job[self.node_index(failure.node), self.at(hang_end) : back] = -1
        work.checkpoint &= work.job >= 0
        return work

    def reach(self, noise: Noise) -> list[str]:
        """The nodes a benign event touches: its job's nodes, its rack, or its own node."""
        if noise.kind in ("app_xid", "checkpoint_storm"):
            nodes = self.job_nodes(noise)
            if noise.kind == "checkpoint_storm":
                nodes = np.flatnonzero(
                    self.checkpoint_load[:, self.span(noise.at, noise.duration)].max(axis=1) > 2
                ).tolist()
            return [self.fleet.node(int(n)) for n in nodes]
        if noise.kind in ("rack_cooling", "power_brake"):
            return [self.fleet.node(n) for n in self.rack(noise.node)]
        if noise.kind == "hot_aisle" and noise.strength > 0.6:
            return [noise.node, self.fleet.node(min(self.node_index(noise.node) + 1, self.fleet.nodes - 1))]
        return [noise.node]

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
        for noise in self.noise_of("checkpoint_burst"):
            load[self.node_index(noise.node), self.span(noise.at, noise.duration)] = 1.5 + 2 * noise.strength
        for noise, rng in self.noise_draws("checkpoint_storm"):
            others = np.flatnonzero(rng.random(self.fleet.nodes) < 0.2 + 0.5 * noise.strength)
            for node in set(self.job_nodes(noise)) | set(others.tolist()):
                where = self.span(noise.at, noise.duration)
                load[node, where] = np.where(self.workload.busy[node, where], 2.5 + 3 * noise.strength, 0)
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
        for failure in self.faults_of(*LOST_KINDS):
            out[self.gpu_index(failure.node, failure.gpu), self.out_of_service(failure)] = True
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
        for noise, draw in self.noise_draws("load_imbalance"):  # one rank carries more work
            node = self.node_index(noise.node)
            heavy = noise.gpu if noise.gpu is not None else int(draw.integers(self.fleet.gpus_per_node))
            light = [
                i
                for i in range(self.node_gpus(node).start, self.node_gpus(node).stop)
                if i != self.gpu_index(noise.node, heavy)
            ]
            util[light, self.span(noise.at, noise.duration)] *= 1 - 0.1 - 0.35 * noise.strength
        util = np.where(self.per_gpu(self.checkpoint_load > 0), 0.12 * self.busy, util)
        return np.where(self.per_gpu(self.hung), 1.0, util)

    @cached_property
    def power_limit(self) -> np.ndarray:
        limit = np.full(self.shape, POWER_LIMIT_W)
        for noise, rng in self.noise_draws("power_cap"):
            cap = POWER_LIMIT_W - 250 - 150 * noise.strength
            node = self.node_index(noise.node)
            gpus = (
                [noise.gpu]
                if noise.gpu is not None
                else rng.choice(
                    self.fleet.gpus_per_node,
                    int(rng.integers(2, self.fleet.gpus_per_node + 1)),
                    replace=False,
                ).tolist()
            )
            for gpu in gpus:
                limit[node * self.fleet.gpus_per_node + gpu, self.span(noise.at, noise.duration)] = cap
        return limit

    @cached_property
    def power_brake(self) -> np.ndarray:
        """(GPUs, T): the facility asserts power brake over a rack (HW slowdown on every GPU)."""
        out = np.zeros(self.shape, dtype=bool)
        for noise in self.noise_of("power_brake"):
            for node in self.rack(noise.node):
                out[self.node_gpus(node), self.span(noise.at, noise.duration)] = True
        return out

    @cached_property
    def power(self) -> np.ndarray:
        rng = self.rng("power")
        load_power = rng.uniform(600, 690, (self.gpus, 1))
        draw = IDLE_POWER_W + self.utilization * (load_power - IDLE_POWER_W) + rng.normal(0, 10, self.shape)
        draw = np.where(self.power_brake, np.minimum(draw, 0.45 * POWER_LIMIT_W), draw)
        return np.clip(draw, IDLE_POWER_W - 15, self.power_limit)

    def _envelope(self, noise: Noise, rise: float = 900.0) -> tuple[slice, np.ndarray]:
        """The event's span and a 0..1 envelope rising and falling over ``rise`` seconds."""
        where = self.span(noise.at, noise.duration)
        n = where.stop - where.start
        ramp = np.minimum(np.arange(n) + 1, np.arange(n)[::-1] + 1) * self.timeline.step / rise
        return where, np.minimum(1, ramp)

    @cached_property
    def thermal_offset(self) -> np.ndarray:
        """Extra heat at the same load: hot aisles and rack cooling incidents (unevenly over the GPUs
        of a node: position in the airflow matters), chronically warm GPUs, and thermal faults."""
        offset = np.zeros(self.shape)
        g = self.fleet.gpus_per_node
        for noise, rng in self.noise_draws("hot_aisle", "rack_cooling"):
            where, shape = self._envelope(noise)
            first = self.node_index(noise.node)
            if noise.kind == "rack_cooling":
                nodes, heat = list(self.rack(noise.node)), 4 + 10 * noise.strength
            else:
                nodes, heat = (
                    list(range(first, min(first + (2 if noise.strength > 0.6 else 1), self.fleet.nodes))),
                    (3 + 6 * noise.strength),
                )
            for node in nodes:
                position = rng.uniform(0.4, 1.5, g)[:, None]
                offset[node * g : (node + 1) * g, where] += heat * position * shape
        for noise in self.noise_of("warm_gpu"):
            offset[self.gpu_index(noise.node, noise.gpu), self.span(noise.at, noise.duration)] += (
                2 + 8 * noise.strength
            )
        for failure in self.faults_of("thermal_runaway"):
            offset[self.gpu_index(failure.node, failure.gpu)] += (6 + 12 * failure.strength) * self.precursor(
                failure
            )
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
        yield self._gauge("up", np.where(self.down, 0.0, 1.0), node=True)

    def _collectors(self) -> Iterator[Family]:
        ones = np.ones((self.fleet.nodes, self.timeline.count))
        yield Family(
            "gpuhealth_collector_success",
            "gauge",
            [row for c in COLLECTORS for row in self._rows(ones, self.node_labels, f'collector="{c}",')],
        )

    def _gpu_counts(self) -> Iterator[Family]:
        expected = np.full((self.fleet.nodes, self.timeline.count), float(self.fleet.gpus_per_node))
        visible = expected.copy()
        for failure in self.faults_of("thermal_runaway", "pcie_degradation", "fell_off_bus"):
            visible[self.node_index(failure.node), self.out_of_service(failure)] -= 1
        yield self._gauge("gpuhealth_gpus_expected", expected, node=True)
        yield self._gauge("gpuhealth_gpus_visible", visible, node=True)

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
        yield Family("gpuhealth_gpu_info", "gauge", rows)

    def _gpu_up(self) -> Iterator[Family]:
        yield self._gauge("gpuhealth_gpu_up", np.where(self.lost, 0.0, 1.0))

    def _nvml_errors(self) -> Iterator[Family]:
        rows = []
        for failure in self.faults_of(*LOST_KINDS):
            error = "timeout" if failure.kind == "gsp_timeout" else "gpu_is_lost"
            i = self.gpu_index(failure.node, failure.gpu)
            lost = np.zeros(self.timeline.count)
            lost[self.out_of_service(failure)] = 1
            values = _first_event_on(np.cumsum(lost))
            rows.append((f'error="{error}",{self.gpu_labels[i]}', values))
        yield Family("gpuhealth_gpu_nvml_errors_total", "counter", rows)

    def _nvml_latency(self) -> Iterator[Family]:
        rng = self.rng("nvml-latency")
        latency = 0.003 + 0.002 * rng.lognormal(0, 0.4, self.shape)
        for failure in self.faults_of("gsp_timeout"):
            if self.failure_params[failure]["extra"] < 0.4:  # slow answers before some GSP timeouts,
                a = self.at(failure.failure - 300 - 600 * failure.strength)  # for every GPU of the node
                b = self.at(failure.failure)
                latency[self.node_gpus(self.node_index(failure.node)), a:b] += np.linspace(0.05, 1.5, b - a)
        for noise, draw in self.noise_draws("slow_nvml"):  # a busy node answers slowly, then recovers
            where = self.span(noise.at, noise.duration)
            latency[self.node_gpus(self.node_index(noise.node)), where] += draw.uniform(
                0.1, 0.3 + 2.5 * noise.strength, (self.fleet.gpus_per_node, where.stop - where.start)
            )
        yield self._gauge("gpuhealth_gpu_nvml_latency_seconds", self.readable(np.round(latency, 4)))

    def _temperatures(self) -> Iterator[Family]:
        rng = self.rng("memory-temperature")
        memory = np.round(self.temperature + 5 + 0.3 * self.thermal_offset + rng.normal(0, 0.6, self.shape))
        yield self._gauge("gpuhealth_gpu_temperature_celsius", self.readable(self.temperature))
        yield self._gauge("gpuhealth_gpu_temperature_max_celsius", self.readable(self.temperature_max))
        yield self._gauge("gpuhealth_gpu_memory_temperature_celsius", self.readable(memory))
        yield self._gauge(
            "gpuhealth_gpu_temperature_slowdown_margin_celsius",
            self.readable(SLOWDOWN_C - self.temperature_max),
        )

    def _thresholds(self) -> Iterator[Family]:
        yield self._gauge(
            "gpuhealth_gpu_temperature_slowdown_threshold_celsius",
            self.readable(np.full(self.shape, SLOWDOWN_C)),
        )
        yield self._gauge(
            "gpuhealth_gpu_temperature_shutdown_threshold_celsius",
            self.readable(np.full(self.shape, SHUTDOWN_C)),
        )

    def _power(self) -> Iterator[Family]:
        yield self._gauge("gpuhealth_gpu_power_watts", self.readable(np.round(self.power, 1)))
        yield self._gauge("gpuhealth_gpu_power_limit_watts", self.readable(self.power_limit))

    def _clocks(self) -> Iterator[Family]:
        events = self.clock_events
        factor = (
            (self.power_limit / POWER_LIMIT_W) ** 0.6
            * (1 - 0.25 * events["sw_thermal_slowdown"])
            * (1 - 0.3 * events["hw_thermal_slowdown"])
            * (1 - 0.5 * events["hw_slowdown"])
        )
        clock = np.where(self.busy, np.round(SM_CLOCK_MAX_HZ * factor / 15e6) * 15e6, SM_CLOCK_IDLE_HZ)
        yield self._gauge("gpuhealth_gpu_sm_clock_hertz", self.readable(clock))
        yield self._gauge(
            "gpuhealth_gpu_sm_clock_max_hertz", self.readable(np.full(self.shape, SM_CLOCK_MAX_HZ))
        )

    def _clock_events(self) -> Iterator[Family]:
        events = self.clock_events
        yield Family(
            "gpuhealth_gpu_clock_event_active",
            "gauge",
            [
                row
                for reason in CLOCK_REASONS
                for row in self._rows(
                    self.readable(np.round(events[reason])), self.gpu_labels, f'reason="{reason}",'
                )
            ],
        )
        yield Family(
            "gpuhealth_gpu_clock_event_seconds_total",
            "counter",
            [
                row
                for reason in CLOCK_REASONS
                for row in self._rows(
                    self.readable(np.round(_counter(events[reason] * self.timeline.step), 3)),
                    self.gpu_labels,
                    f'reason="{reason}",',
                )
            ],
        )

    def _utilization(self) -> Iterator[Family]:
        util = np.round(self.utilization, 2)
        yield self._gauge("gpuhealth_gpu_utilization_ratio", self.readable(util))
        yield self._gauge("gpuhealth_gpu_memory_utilization_ratio", self.readable(np.round(util * 0.55, 2)))

    def _memory(self) -> Iterator[Family]:
        used = np.where(self.busy, 0.9 * MEMORY_TOTAL_BYTES, 0.6e9)
        yield self._gauge("gpuhealth_gpu_memory_used_bytes", self.readable(used))
        yield self._gauge(
            "gpuhealth_gpu_memory_total_bytes", self.readable(np.full(self.shape, float(MEMORY_TOTAL_BYTES)))
        )

    @cached_property
    def hbm(self) -> dict[str, np.ndarray]:
        """ECC and row-remap increments: background SBEs, SBE bursts and chatter, benign remaps and
        contained errors, HBM degradations and sudden uncorrectable errors."""
        rng = self.rng("hbm")
        minutes = self.timeline.step / 60
        corrected = np.zeros(self.shape)
        background = rng.random(self.gpus) < 0.04  # a few GPUs log the odd corrected error
        corrected[background] = rng.poisson(
            self.timeline.step / 86400, (int(background.sum()), self.timeline.count)
        )
        remapped = np.zeros(self.shape)
        uncorrectable = np.zeros(self.shape)
        uncorrected = np.zeros(self.shape)
        pending = np.zeros(self.shape)
        failed = np.zeros(self.shape)
        for noise, draw in self.noise_draws("sbe_burst", "sbe_chatter"):
            i, where = self.gpu_index(noise.node, noise.gpu), self.span(noise.at, noise.duration)
            n = where.stop - where.start
            if noise.kind == "sbe_burst":
                corrected[i, where] += draw.poisson((20 + 280 * noise.strength) / n, n)
            else:  # a low steady rate for hours to days: 1 to 30 an hour
                corrected[i, where] += draw.poisson((1 + 29 * noise.strength) / 60 * minutes, n)
        for noise in self.noise_of("benign_remap", "contained_xid94", "xid63"):
            i, at = self.gpu_index(noise.node, noise.gpu), self.at(noise.at)
            if at >= self.timeline.count:
                continue
            if noise.kind == "contained_xid94":  # one uncorrectable error, contained, its row remapped
                uncorrected[i, at] += 1
                uncorrectable[i, at] += 1
            else:
                remapped[i, at] += 1
            if noise.kind != "xid63":  # the remap takes effect at the next GPU reset
                pending[i, self.span(noise.at, noise.duration)] = 1
        for failure in self.faults_of("hbm_degradation", "sram_uncorrectable"):
            i, level = self.gpu_index(failure.node, failure.gpu), self.precursor(failure)
            params = self.failure_params[failure]
            corrected[i] += rng.poisson((2 + 40 * failure.strength) * minutes * level)
            # rows whose errors recur get remapped: one to many, some wear hits few rows again
            remaps = params["remaps"] > 0.3
            rows = 1 + 40 * failure.strength * params["remaps"]
            remapped[i] += rng.poisson(rows * level / max(level.sum(), 1))
            a, b = self.at(failure.onset), self.at(failure.instant)
            if failure.first_xid is not None and b < self.timeline.count:  # a contained error first
                uncorrected[i, b] += 1
                uncorrectable[i, b] += 1
                pending[i, b : self.at(failure.failure)] = 1
            elif failure.kind == "hbm_degradation" and failure.strength > 0.5 and b - a > 2 and remaps:
                k = a + int((b - a) * 0.9)  # strong degradations run out of spare rows first
                uncorrectable[i, k] += 1
                pending[i, k:b] = 1
            end = self.at(failure.failure)
            if end < self.timeline.count:
                uncorrected[i, end] += 1 + int(failure.strength * 3)
            if failure.xid == 64:
                failed[i, self.out_of_service(failure)] = 1
        return {
            "corrected": corrected,
            "uncorrected": uncorrected,
            "remapped": remapped,
            "uncorrectable": uncorrectable,
            "pending": pending,
            "failure": failed,
        }

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
        yield Family("gpuhealth_gpu_ecc_errors_total", "counter", rows)

    def _remaps(self) -> Iterator[Family]:
        rng = self.rng("remap-lifetime")
        lifetime = np.where(rng.random(self.gpus) < 0.05, rng.integers(1, 3, self.gpus), 0).astype(float)
        yield Family(
            "gpuhealth_gpu_remapped_rows",
            "gauge",
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
        yield self._gauge("gpuhealth_gpu_remap_pending", self.readable(self.hbm["pending"]))
        yield self._gauge("gpuhealth_gpu_remap_failure", self.readable(self.hbm["failure"]))

    @cached_property
    def replays(self) -> np.ndarray:
        rng = self.rng("pcie")
        replays = np.zeros(self.shape)
        for noise, draw in self.noise_draws("boot_replay_burst"):  # spread over the first minutes
            gpus = [noise.gpu] if noise.gpu is not None else range(self.fleet.gpus_per_node)
            where = self.span(noise.at, noise.duration)
            n = where.stop - where.start
            for gpu in gpus:
                replays[self.gpu_index(noise.node, gpu), where] += draw.poisson(
                    (50 + 450 * noise.strength) / n, n
                )
        for noise, draw in self.noise_draws("reboot_loop"):  # every boot retrains the links
            for boot in self.reboots(noise, draw):
                gpu = int(draw.integers(self.fleet.gpus_per_node))
                at = self.at(boot)
                if at < self.timeline.count:
                    replays[self.gpu_index(noise.node, gpu), at] += int(draw.integers(20, 400))
        for noise, draw in self.noise_draws("pcie_replay_steady"):  # a healthy link that replays steadily
            where = self.span(noise.at, noise.duration)
            rate = (0.05 + 3 * noise.strength) * self.timeline.step / 60
            replays[self.gpu_index(noise.node, noise.gpu), where] += draw.poisson(
                rate, where.stop - where.start
            )
        for failure in self.faults_of("pcie_degradation"):
            per_step = (1 + 40 * failure.strength) * self.timeline.step / 60
            replays[self.gpu_index(failure.node, failure.gpu)] += rng.poisson(
                per_step * self.precursor(failure)
            )
        return replays

    @cached_property
    def aer(self) -> dict[int, np.ndarray]:
        """Corrected AER increments per GPU: some failing links and some healthy replaying ones log
        them, at their own rate."""
        rng = self.rng("aer")
        out: dict[int, np.ndarray] = {}
        for failure in self.faults_of("pcie_degradation"):
            if self.failure_params[failure]["aer"]:
                i = self.gpu_index(failure.node, failure.gpu)
                per_step = (0.2 + 10 * failure.strength) * self.timeline.step / 60
                out[i] = out.get(i, 0) + rng.poisson(per_step * self.precursor(failure))
        for noise, draw in self.noise_draws("pcie_replay_steady"):
            if draw.random() < 0.5:
                i = self.gpu_index(noise.node, noise.gpu)
                out[i] = out.get(i, 0) + np.floor(self.replays[i] / 3)
        return out

    def _pcie(self) -> Iterator[Family]:
        rng = self.rng("pcie-lifetime")
        lifetime = np.where(rng.random(self.gpus) < 0.1, rng.integers(1, 200, self.gpus), 0).astype(float)
        width = np.full(self.shape, 16.0)
        generation = np.full(self.shape, 5.0)
        for failure in self.faults_of("pcie_degradation"):
            params = self.failure_params[failure]
            if params["downgrade"] and failure.has_precursor:  # the link retrains lower late in the decay
                a, b = self.at(failure.onset), self.at(failure.instant)
                where = slice(
                    a + int((b - a) * (0.4 + 0.55 * params["extra"])), self.out_of_service(failure).stop
                )
                target = generation if params["generation"] else width
                target[self.gpu_index(failure.node, failure.gpu), where] = 4 if params["generation"] else 8
        yield self._count(
            "gpuhealth_gpu_pcie_replays_total", self.readable(self.replaced(_counter(self.replays, lifetime)))
        )
        yield self._gauge("gpuhealth_gpu_pcie_link_generation", self.readable(generation))
        yield self._gauge("gpuhealth_gpu_pcie_link_generation_max", self.readable(np.full(self.shape, 5.0)))
        yield self._gauge("gpuhealth_gpu_pcie_link_width_lanes", self.readable(width))
        yield self._gauge("gpuhealth_gpu_pcie_link_width_max_lanes", self.readable(np.full(self.shape, 16.0)))
        yield self._gauge(
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
        yield Family("gpuhealth_pcie_aer_errors_total", "counter", rows)

    @cached_property
    def nvlink_errors(self) -> tuple[dict[tuple[int, int], np.ndarray], dict[tuple[int, int], np.ndarray]]:
        """CRC flit increments and down masks per (GPU, link): failing links (some stay quiet until the
        end) and links that flap and heal."""
        rng = self.rng("nvlink")
        flits: dict[tuple[int, int], np.ndarray] = {}
        down: dict[tuple[int, int], np.ndarray] = {}
        per_minute = self.timeline.step / 60
        for failure in self.faults_of("nvlink_errors"):
            i, level = self.gpu_index(failure.node, failure.gpu), self.precursor(failure)
            params = self.failure_params[failure]
            rate = 0.01 + 0.05 * failure.strength if params["quiet"] else 2 + 200 * failure.strength
            key = (i, int(params["link"]))
            flits[key] = flits.get(key, 0) + rng.poisson(rate * per_minute * level)
            down.setdefault(key, np.zeros(self.timeline.count, dtype=bool))[self.out_of_service(failure)] = (
                True
            )
        for noise, draw in self.noise_draws("nvlink_flap"):
            key = (self.gpu_index(noise.node, noise.gpu), int(draw.integers(max(self.fleet.nvlinks, 1))))
            where = self.span(noise.at, noise.duration)
            n = where.stop - where.start
            bursty = draw.random(n) < 0.3
            increments = np.zeros(self.timeline.count)
            increments[where] = draw.poisson((5 + 400 * noise.strength) * per_minute * bursty)
            flits[key] = flits.get(key, 0) + increments
            if noise.strength > 0.4:  # the link drops and retrains within a couple of minutes
                mask = down.setdefault(key, np.zeros(self.timeline.count, dtype=bool))
                mask[self.span(noise.at + noise.duration / 2, 120)] = True
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
                for kind in NVLINK_ERROR_TYPES:
                    values = zeros[i]
                    if (i, link) in moving:
                        counter = self.replaced(_counter(moving[(i, link)][kind]), i)
                        values = np.where(self.lost[i], np.nan, counter)
                        totals[i] = totals[i] + values
                    error_rows.append((f'link="{link}",type="{kind}",{labels}', values))
        yield Family("gpuhealth_gpu_nvlink_up", "gauge", up_rows)
        yield Family("gpuhealth_gpu_nvlink_errors_total", "counter", error_rows)
        yield Family(
            "gpuhealth_gpu_nvlink_errors_all_links_total",
            "counter",
            [(self.gpu_labels[i], values) for i, values in totals.items()],
        )

    def _processes(self) -> Iterator[Family]:
        yield self._gauge("gpuhealth_gpu_processes", self.readable(self.busy.astype(float)))

    def _jobs(self) -> Iterator[Family]:
        rows = []
        for node, labels in enumerate(self.node_labels):
            jobs = self.workload.job[node]
            for job_id in np.unique(jobs[jobs >= 0]):
                values = np.where(jobs == job_id, 1.0, np.nan)
                rows += [
                    (f'gpu="{g}",job_id="{job_id}",{labels}', values) for g in range(self.fleet.gpus_per_node)
                ]
        yield Family("gpuhealth_gpu_job_info", "gauge", rows)

    @cached_property
    def boots(self) -> dict[int, list[int]]:
        """Per node, the sample indices where the node (and its exporter) starts again: back from
        repair, or a reboot; the exporter's event counters start from zero there."""
        out: dict[int, list[int]] = {}
        for failure in self.scenario.failures:
            if failure.repaired is not None:
                out.setdefault(self.node_index(failure.node), []).append(self.at(failure.repaired))
        for noise, rng in self.noise_draws("reboot_loop"):
            out.setdefault(self.node_index(noise.node), []).extend(
                self.at(b) for b in self.reboots(noise, rng)
            )
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
        """Increments per (GPU, XID): remaps (63), contained errors (94), buggy jobs (13/31/43/45),
        NVLink flaps (74), and every fault's XIDs from its first one on."""
        events: dict[tuple[int, int], np.ndarray] = {}

        def add(i: int, xid: int, at: int, count: float = 1.0) -> None:
            if at < self.timeline.count:
                events.setdefault((i, xid), np.zeros(self.timeline.count))[at] += count

        remaps = self.hbm["remapped"] + self.hbm["uncorrectable"]
        for i, k in zip(*np.nonzero(remaps), strict=True):
            add(int(i), 63, int(k), remaps[i, k])
        for noise in self.noise_of("contained_xid94"):
            add(self.gpu_index(noise.node, noise.gpu), 94, self.at(noise.at))
        for noise, rng in self.noise_draws("app_xid"):  # every node of the buggy job, again and again
            xid = int(rng.choice([13, 31, 43, 45], p=[0.35, 0.35, 0.15, 0.15]))
            for node in self.job_nodes(noise):
                t = noise.at + rng.uniform(0, 600)
                while t < noise.at + noise.duration:
                    for gpu in rng.choice(self.fleet.gpus_per_node, int(rng.integers(1, 9)), replace=False):
                        add(node * self.fleet.gpus_per_node + int(gpu), xid, self.at(t))
                        if xid == 13 and rng.random() < 0.5:
                            add(node * self.fleet.gpus_per_node + int(gpu), 43, self.at(t))
                    t += np.exp(rng.uniform(np.log(300), np.log(2 * 3600)))
        for noise in self.noise_of("nvlink_flap"):
            if noise.strength > 0.5:
                add(self.gpu_index(noise.node, noise.gpu), 74, self.at(noise.at + noise.duration / 2))
        for failure in self.scenario.failures:
            i = self.gpu_index(failure.node, failure.gpu)
            if failure.first_xid is not None:  # logged before the GPU dies
                first = 94 if failure.kind == "hbm_degradation" else failure.xid
                every = max(int(120 / self.timeline.step), 1)
                for k in range(self.at(failure.instant), self.at(failure.failure), every):
                    add(i, first, k)
            add(i, failure.xid, self.at(failure.failure))
        return events

    def _xids(self) -> Iterator[Family]:
        """A GPU's counter of an XID appears with its first event, as the exporter publishes them."""
        rows = [
            (f'xid="{xid}",{self.gpu_labels[i]}', self.events_counter(i, increments))
            for (i, xid), increments in sorted(self.xid_events.items())
        ]
        yield Family("gpuhealth_xid_events_total", "counter", rows)

    def _fallen(self) -> Iterator[Family]:
        """Only a GPU that fell off the bus has the counter, from then on, as the exporter publishes it."""
        falls: dict[int, np.ndarray] = {}
        for failure in self.faults_of("thermal_runaway", "pcie_degradation", "fell_off_bus"):
            i = self.gpu_index(failure.node, failure.gpu)
            at = self.at(failure.failure)
            if at < self.timeline.count:
                falls.setdefault(i, np.zeros(self.timeline.count))[at] += 1
        rows = [(self.gpu_labels[i], self.events_counter(i, f)) for i, f in sorted(falls.items())]
        yield Family("gpuhealth_gpu_fallen_off_bus_total", "counter", rows)

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
        yield Family("gpuhealth_host_cpu_seconds_total", "counter", rows)

    def _host_memory(self) -> Iterator[Family]:
        shape = (self.fleet.nodes, self.timeline.count)
        yield self._gauge(
            "gpuhealth_host_memory_total_bytes", np.full(shape, float(HOST_MEMORY_BYTES)), node=True
        )
        available = (
            HOST_MEMORY_BYTES - self.node_rate("memory", 0.45, 0.05, 0.45, checkpoint=0.1) * HOST_MEMORY_BYTES
        )
        yield self._gauge("gpuhealth_host_memory_available_bytes", np.round(available, -6), node=True)

    def _load(self) -> Iterator[Family]:
        procs = np.round(self.node_rate("procs", 12, 1, 0.3, checkpoint=2, spread=0.2))
        alpha = 1 - np.exp(-self.timeline.step / 60)
        load = np.empty(procs.shape)
        load[:, 0] = procs[:, 0]
        for i in range(1, procs.shape[1]):
            load[:, i] = load[:, i - 1] + alpha * (procs[:, i] - load[:, i - 1])
        yield self._gauge("gpuhealth_host_procs_running", procs, node=True)
        yield self._gauge("gpuhealth_host_load1", np.round(load, 2), node=True)

    def _interrupts(self) -> Iterator[Family]:
        step = self.timeline.step
        yield self._count(
            "gpuhealth_host_interrupts_total",
            np.round(_counter(self.node_rate("interrupts", 10000, 1500, 2600, 2000) * step)),
            node=True,
        )
        yield self._count(
            "gpuhealth_host_context_switches_total",
            np.round(_counter(self.node_rate("ctxt", 50000, 4000, 7000, 8000) * step)),
            node=True,
        )

    @cached_property
    def storage_stress(self) -> np.ndarray:
        """(nodes, T) 0..1: some HBM failures stall the host before the XID (paging, slow NFS metadata),
        and so do checkpoint storms."""
        stress = np.zeros((self.fleet.nodes, self.timeline.count))
        for failure in self.faults_of("hbm_degradation"):
            if self.failure_params[failure]["extra"] < 0.3:
                a, b = self.at(failure.instant - 1800), self.at(failure.instant)
                stress[self.node_index(failure.node), a:b] = failure.strength
        # a checkpoint storm saturates the client's RPC slots: metadata calls queue and pages go out
        return np.maximum(stress, np.clip((self.checkpoint_load - 1.5) / 4, 0, 0.8))

    def _paging(self) -> Iterator[Family]:
        step = self.timeline.step
        rate = self.node_rate("page-outs", 300, 50, 100, 2500, spread=0.3) + 40000 * self.storage_stress
        yield self._count("gpuhealth_host_page_outs_total", np.round(_counter(rate * step)), node=True)
        yield self._count("gpuhealth_host_swap_outs_total", np.zeros(rate.shape), node=True)

    def _io(self) -> Iterator[Family]:
        step = self.timeline.step
        for name, device, busy, idle, ckpt in (
            ("gpuhealth_host_disk_read_bytes_total", "nvme0n1", 2e6, 1e5, 0),
            ("gpuhealth_host_disk_written_bytes_total", "nvme0n1", 5e6, 2e5, 1e7),
            ("gpuhealth_host_network_receive_bytes_total", "ib0", 9e9, 1e6, 1e9),
            ("gpuhealth_host_network_transmit_bytes_total", "ib0", 9e9, 1e6, 3e9),
        ):
            values = np.round(_counter(self.node_rate(name, busy, idle, idle, ckpt, spread=0.1) * step))
            yield self._count(name, values, extra=f'device="{device}",', node=True)

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
            yield Family(name, "counter", rows)
        sends = np.asarray(sum(ops.values()) * step)
        extra = f'mount="{NFS_MOUNT}",'
        yield self._count("gpuhealth_nfs_transport_sends_total", np.round(_counter(sends)), extra, node=True)
        yield self._count(
            "gpuhealth_nfs_transport_backlog_queue_total",
            np.round(_counter(sends * (0.1 + 60 * load))),
            extra,
            node=True,
        )
