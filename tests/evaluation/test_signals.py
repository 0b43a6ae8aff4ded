"""The generated series: each benign kind moves the signals a naive rule reads, each fault the
signals physics ties to it; read straight from the generator, no Prometheus involved."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import numpy as np
import pytest
from gpuhealth.contract.faults import FABRIC_KINDS

from gpuhealth.evaluation.scenario import NOISE_KINDS, parse_scenario
from gpuhealth.evaluation.signals import FleetSignals

GPU_NOISE_KINDS = tuple(k for k in NOISE_KINDS if k not in FABRIC_KINDS)  # fabric kinds: test_fabric.py

HOUR = 3600
AT = 10 * HOUR  # every benign event starts here (the checkpoint storm later, alone)
# node index and GPU of each benign event; rack kinds sit alone in their racks of four
PLACES = {
    kind: (i, 2)
    for i, kind in enumerate(k for k in GPU_NOISE_KINDS if k not in ("rack_cooling", "power_brake"))
}
PLACES |= {"power_brake": (20, None), "rack_cooling": (24, None)}
LENGTHS = {
    "xid63": "1m",
    "boot_replay_burst": "5m",
    "sbe_burst": "10m",
    "slow_nvml": "20m",
    "power_brake": "15m",
    "checkpoint_burst": "15m",
    "checkpoint_storm": "30m",
    "contained_xid94": "1h",
    "nvlink_flap": "2h",
}
GPU_KINDS = (
    "sbe_burst",
    "sbe_chatter",
    "benign_remap",
    "contained_xid94",
    "xid63",
    "nvlink_flap",
    "pcie_replay_steady",
    "warm_gpu",
    "load_imbalance",
    "boot_replay_burst",
)


def node(i: int) -> str:
    return f"gpu-{i:03d}"


@cache
def signals() -> FleetSignals:
    noise = []
    for kind, (index, gpu) in PLACES.items():
        event = {
            "node": node(index),
            "kind": kind,
            "at": "30h" if kind == "checkpoint_storm" else "10h",
            "duration": LENGTHS.get(kind, "6h"),
            "strength": 0.8,
        }
        if kind in GPU_KINDS:
            event["gpu"] = gpu
        noise.append(event)
    scenario = parse_scenario(
        {
            "name": "kinds",
            "seed": 3,
            "duration": "2d",
            "warmup": "1h",
            "fleet": {"nodes": 28, "nvlinks": 4, "rack_nodes": 4},
            "workload": {"job_nodes": [2, 4], "job_duration": ["20h", "30h"], "idle_gap": ["5m", "10m"]},
            "noise": noise,
        }
    )
    return FleetSignals(scenario)


def family(name: str, **labels: str) -> dict[str, np.ndarray]:
    """Series of ``name`` whose labels include ``labels``, by label text."""
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    return {
        text: values
        for fam in signals().families(lambda n: n == name)
        if fam.name == name
        for text, values in fam.series
        if all(w in text.split(",") for w in wanted)
    }


def one(name: str, **labels: str) -> np.ndarray:
    (values,) = family(name, **labels).values()
    return values


def window(start: float, length: float) -> slice:
    return signals().span(start, length)


def gpu_of(kind: str) -> tuple[str, str]:
    index, gpu = PLACES[kind]
    return node(index), str(gpu)


def increase(values: np.ndarray, where: slice) -> float:
    seen = np.nan_to_num(values)
    return float(seen[where.stop - 1] - seen[max(where.start - 1, 0)])


def during(kind: str) -> slice:
    return window(AT + 60, 3600)


def peers_mean(name: str, n: str, gpu: str, where: slice) -> tuple[float, float]:
    """The GPU's mean and its node peers' mean of a gauge over ``where``."""
    rows = family(name, node=n)
    mine = next(v for t, v in rows.items() if f'gpu="{gpu}"' in t.split(","))
    others = [v for t, v in rows.items() if f'gpu="{gpu}"' not in t.split(",")]
    return float(np.nanmean(mine[where])), float(np.nanmean([np.nanmean(v[where]) for v in others]))


def check_sbe_burst() -> None:
    n, g = gpu_of("sbe_burst")
    ecc = one("gpuhealth_gpu_ecc_errors_total", node=n, gpu=g, type="corrected", counter="volatile")
    assert increase(ecc, window(AT, 600)) >= 20
    assert increase(ecc, window(AT + 1200, 20 * HOUR)) <= 2  # then it stops


def check_sbe_chatter() -> None:
    n, g = gpu_of("sbe_chatter")
    ecc = one("gpuhealth_gpu_ecc_errors_total", node=n, gpu=g, type="corrected", counter="volatile")
    hourly = [increase(ecc, window(AT + h * HOUR, HOUR)) for h in range(6)]
    assert sum(h > 0 for h in hourly) >= 4 and max(hourly) < 60  # a low rate, hour after hour


def check_benign_remap() -> None:
    n, g = gpu_of("benign_remap")
    rows = one("gpuhealth_gpu_remapped_rows", node=n, gpu=g, type="correctable")
    pending = one("gpuhealth_gpu_remap_pending", node=n, gpu=g)
    assert increase(rows, window(AT, 120)) == 1
    assert pending[during("benign_remap")].min() == 1 and pending[window(AT + 7 * HOUR, HOUR)].max() == 0
    assert np.nanmax(one("gpuhealth_xid_events_total", node=n, gpu=g, xid="63")) >= 1


def check_contained_xid94() -> None:
    n, g = gpu_of("contained_xid94")
    assert np.nanmax(one("gpuhealth_xid_events_total", node=n, gpu=g, xid="94")) == 1
    unc = one("gpuhealth_gpu_ecc_errors_total", node=n, gpu=g, type="uncorrected", counter="volatile")
    assert increase(unc, window(AT, 120)) == 1
    pending = one("gpuhealth_gpu_remap_pending", node=n, gpu=g)
    assert pending[window(AT, 1800)].min() == 1 and pending[window(AT + 2 * HOUR, HOUR)].max() == 0  # reset
    assert (
        increase(one("gpuhealth_gpu_remapped_rows", node=n, gpu=g, type="uncorrectable"), window(AT, 120))
        == 1
    )


def check_xid63() -> None:
    n, g = gpu_of("xid63")
    assert np.nanmax(one("gpuhealth_xid_events_total", node=n, gpu=g, xid="63")) == 1
    assert one("gpuhealth_gpu_remap_pending", node=n, gpu=g).max() == 0


def check_app_xid() -> None:
    s = signals()
    event = next(n for n in s.scenario.noise if n.kind == "app_xid")
    assert len(s.reach(event)) >= 2  # a false alarm on any node of the job is blamed on it
    index, _ = PLACES["app_xid"]
    job = s.workload.job[index, s.at(AT)]
    members = np.flatnonzero(s.workload.job[:, s.at(AT)] == job) if job >= 0 else [index]
    assert len(members) >= 2  # a multi-node job: the same fault on every one of its nodes
    for member in members:
        xids = {
            t.split('xid="')[1].split('"')[0] for t in family("gpuhealth_xid_events_total", node=node(member))
        }
        assert xids & {"13", "31", "43", "45"}, node(member)
    counts = [np.nanmax(v) for v in family("gpuhealth_xid_events_total", node=node(index)).values()]
    assert sum(counts) >= 3  # it repeats


def check_nvlink_flap() -> None:
    n, g = gpu_of("nvlink_flap")
    errors = family("gpuhealth_gpu_nvlink_errors_total", node=n, gpu=g, type="crc_flit")
    moved = {t: increase(v, window(AT, 2 * HOUR)) for t, v in errors.items()}
    assert sum(m > 0 for m in moved.values()) == 1 and max(moved.values()) >= 10  # one link
    flapped = next(t for t, m in moved.items() if m > 0).replace('type="crc_flit",', "")
    up = family("gpuhealth_gpu_nvlink_up", node=n, gpu=g)[flapped]
    assert up[window(AT, 2 * HOUR)].min() == 0 and up[window(AT + 3 * HOUR, HOUR)].min() == 1  # it heals
    assert increase(next(iter(errors.values())), window(AT + 3 * HOUR, 10 * HOUR)) == 0


def check_pcie_replay_steady() -> None:
    n, g = gpu_of("pcie_replay_steady")
    replays = one("gpuhealth_gpu_pcie_replays_total", node=n, gpu=g)
    hourly = [increase(replays, window(AT + h * HOUR, HOUR)) for h in range(5)]
    assert all(h > 0 for h in hourly)
    assert one("gpuhealth_gpu_pcie_link_downgraded", node=n, gpu=g).max() == 0  # a healthy link


def check_boot_replay_burst() -> None:
    n, g = gpu_of("boot_replay_burst")
    replays = one("gpuhealth_gpu_pcie_replays_total", node=n, gpu=g)
    assert increase(replays, window(AT, 300)) >= 50
    assert increase(replays, window(AT + HOUR, 10 * HOUR)) == 0
    assert not signals().workload.busy[PLACES["boot_replay_burst"][0], signals().at(AT - 300)]  # rebooting


def check_load_imbalance() -> None:
    n, g = gpu_of("load_imbalance")
    where = window(AT + HOUR, 4 * HOUR)
    mine, others = peers_mean("gpuhealth_gpu_utilization_ratio", n, g, where)
    assert mine > others + 0.1
    mine, others = peers_mean("gpuhealth_gpu_temperature_celsius", n, g, where)
    assert mine > others + 2  # heat follows load: one GPU warmer than its peers, and healthy


def check_warm_gpu() -> None:
    n, g = gpu_of("warm_gpu")
    mine, others = peers_mean("gpuhealth_gpu_temperature_celsius", n, g, window(AT + HOUR, 4 * HOUR))
    assert mine > others + 4


def check_hot_aisle() -> None:
    index, _ = PLACES["hot_aisle"]
    temps = family("gpuhealth_gpu_temperature_celsius", node=node(index))
    lifts = [
        np.nanmean(v[window(AT + 2 * HOUR, 2 * HOUR)]) - np.nanmean(v[window(AT - 4 * HOUR, 3 * HOUR)])
        for v in temps.values()
    ]
    assert min(lifts) > 0.5 and max(lifts) - min(lifts) > 1.5  # every GPU warms, unevenly


def check_rack_cooling() -> None:
    s = signals()
    index, _ = PLACES["rack_cooling"]
    offset = s.thermal_offset[:, s.at(AT + HOUR)].reshape(s.fleet.nodes, -1)
    assert all(offset[n].min() > 1 for n in s.rack(node(index)))  # several nodes at once
    assert offset[s.rack(node(index)).start - 1].max() == 0  # the next rack is cool


def check_slow_nvml() -> None:
    index, _ = PLACES["slow_nvml"]
    latency = family("gpuhealth_gpu_nvml_latency_seconds", node=node(index))
    assert all(np.nanmean(v[window(AT, 900)]) > 0.1 for v in latency.values())  # every GPU of the node
    assert all(np.nanmax(v[window(AT + HOUR, HOUR)]) < 0.1 for v in latency.values())


def check_power_brake() -> None:
    s = signals()
    index, _ = PLACES["power_brake"]
    for member in s.rack(node(index)):
        brake = family(
            "gpuhealth_gpu_clock_event_active", node=node(member), reason="hw_power_brake_slowdown"
        )
        slow = family("gpuhealth_gpu_clock_event_active", node=node(member), reason="hw_slowdown")
        assert all(v[window(AT, 600)].min() == 1 for v in [*brake.values(), *slow.values()])
        assert all(v[window(AT + HOUR, HOUR)].max() == 0 for v in brake.values())


def check_power_cap() -> None:
    index, _ = PLACES["power_cap"]  # listed with gpu: that GPU; drawn without one: several
    limits = family("gpuhealth_gpu_power_limit_watts", node=node(index))
    capped = [t for t, v in limits.items() if np.nanmin(v[window(AT, HOUR)]) < 700]
    assert len(capped) >= 1
    events = family("gpuhealth_gpu_clock_event_active", node=node(index), reason="sw_power_cap")
    assert max(np.nanmax(v[window(AT, HOUR)]) for v in events.values()) == 1


def check_idle_node() -> None:
    index, _ = PLACES["idle_node"]
    util = family("gpuhealth_gpu_utilization_ratio", node=node(index))
    assert all(np.nanmax(v[window(AT, 5 * HOUR)]) == 0 for v in util.values())


def check_reboot_loop() -> None:
    s = signals()
    index, _ = PLACES["reboot_loop"]
    up = one("up", node=node(index))
    assert up[window(AT, 6 * HOUR)].min() == 0 and up[window(AT - 3 * HOUR, 2 * HOUR)].min() == 1
    temps = family("gpuhealth_gpu_temperature_celsius", node=node(index))
    assert all(np.isnan(v[up == 0]).all() for v in temps.values())  # nothing answers while it boots
    replays = sum(
        increase(v, window(AT, 7 * HOUR))
        for v in family("gpuhealth_gpu_pcie_replays_total", node=node(index)).values()
    )
    assert replays >= 20 and len(s.boots[index]) >= 2


def nfs_queue(index: int, op: str, start: float, length: float) -> float:
    queue = one("gpuhealth_nfs_rpc_queue_seconds_total", node=node(index), op=op)
    return increase(queue, window(start, length)) / length


def check_checkpoint_burst() -> None:
    index, _ = PLACES["checkpoint_burst"]
    assert nfs_queue(index, "WRITE", AT, 900) > 5 * nfs_queue(index, "WRITE", AT + 2 * HOUR, 900) + 1e-3


def check_checkpoint_storm() -> None:
    s = signals()
    storm = 30 * HOUR
    hit = [n for n in range(s.fleet.nodes) if s.checkpoint_load[n, s.at(storm + 600)] > 2]
    assert len(hit) >= 3  # many nodes write at once
    index = hit[0]
    assert nfs_queue(index, "GETATTR", storm, 1800) > 3 * nfs_queue(index, "GETATTR", storm - 3 * HOUR, 1800)
    pages = one("gpuhealth_host_page_outs_total", node=node(index))
    assert increase(pages, window(storm, 1800)) > 3 * increase(pages, window(storm - 3 * HOUR, 1800))


CHECKS: dict[str, Callable[[], None]] = {
    name.removeprefix("check_"): check for name, check in globals().items() if name.startswith("check_")
}


@pytest.mark.parametrize("kind", GPU_NOISE_KINDS)
def test_benign_kind_moves_the_signals_it_should(kind: str) -> None:
    assert kind in CHECKS, f"no check for {kind}"
    CHECKS[kind]()


@cache
def faults() -> FleetSignals:
    """Every fault kind and precursor shape on its own node; 16 PCIe degradations to see their mix."""
    listed = [
        {
            "node": "gpu-000",
            "gpu": 1,
            "kind": "hbm_degradation",
            "onset": "2h",
            "failure": "40h",
            "shape": "intermittent",
            "strength": 0.9,
        },
        {
            "node": "gpu-001",
            "gpu": 1,
            "kind": "thermal_runaway",
            "onset": "10h",
            "failure": "30h",
            "shape": "plateau",
        },
        {
            "node": "gpu-002",
            "gpu": 1,
            "kind": "nvlink_errors",
            "onset": "10h",
            "failure": "30h",
            "shape": "step",
            "first_xid": "29h",
        },
        {"node": "gpu-003", "gpu": 1, "kind": "sram_uncorrectable", "failure": "20h", "repaired": "30h"},
        {
            "node": "gpu-004",
            "gpu": 1,
            "kind": "hbm_degradation",
            "failure": "20h",
            "shape": "none",
            "xid": 48,
        },
        {"node": "gpu-005", "gpu": 1, "kind": "fell_off_bus", "failure": "20h", "repaired": "26h"},
    ]
    listed += [
        {"node": f"gpu-{8 + i:03d}", "gpu": 0, "kind": "pcie_degradation", "onset": "5h", "failure": "40h"}
        for i in range(16)
    ]
    scenario = parse_scenario(
        {
            "seed": 5,
            "duration": "2d",
            "warmup": "1h",
            "fleet": {"nodes": 24, "nvlinks": 4},
            "failures": listed,
        }
    )
    return FleetSignals(scenario)


def fault_series(name: str, node_name: str, gpu: int, **labels: str) -> np.ndarray:
    wanted = [f'node="{node_name}"', f'gpu="{gpu}"', *(f'{k}="{v}"' for k, v in labels.items())]
    for fam in faults().families(lambda n: n == name):
        for text, values in fam.series:
            if fam.name == name and all(w in text.split(",") for w in wanted):
                return values
    raise AssertionError(f"no {name} for {node_name}/{gpu}")


def test_intermittent_precursor_has_bursts_with_quiet_stretches_between() -> None:
    level = faults().precursor(faults().scenario.failures[0])
    inside = level[faults().at(2 * HOUR) : faults().at(40 * HOUR)]
    starts = np.flatnonzero(np.diff(inside) > 0)
    assert inside.max() == 1 and (inside == 0).mean() > 0.3 and len(starts) >= 1


def test_plateau_and_step_precursors_hold_their_level() -> None:
    s = faults()
    plateau = s.precursor(s.scenario.failures[1])[s.at(20 * HOUR) : s.at(30 * HOUR)]
    assert plateau.min() == plateau.max() == 1  # flat, not a ramp to the end
    steps = s.precursor(s.scenario.failures[2])[s.at(10 * HOUR) : s.at(29 * HOUR)]
    assert len(np.unique(steps)) <= 4 and steps[0] > 0  # a few levels, from the onset


def test_fault_xid_logged_before_the_gpu_dies_sets_the_failure_instant() -> None:
    s = faults()
    failure = s.scenario.failures[2]
    xid = fault_series("gpuhealth_xid_events_total", "gpu-002", 1, xid="74")
    first = int(np.flatnonzero(~np.isnan(xid))[0])
    assert first == s.at(failure.instant) == s.at(29 * HOUR) < s.at(failure.failure)
    up = [
        v
        for t, v in next(f for f in s.families(lambda n: n == "gpuhealth_gpu_nvlink_up")).series
        if 'node="gpu-002"' in t and 'gpu="1"' in t
    ]
    assert min(v[s.at(29.5 * HOUR)] for v in up) == 1 and min(v[s.at(31 * HOUR)] for v in up) == 0


def test_sudden_uncorrectable_errors_show_nothing_before_the_xid() -> None:
    for node_name, xid in (("gpu-003", "95"), ("gpu-004", "48")):
        ecc = fault_series(
            "gpuhealth_gpu_ecc_errors_total", node_name, 1, type="corrected", counter="volatile"
        )
        unc = fault_series(
            "gpuhealth_gpu_ecc_errors_total", node_name, 1, type="uncorrected", counter="volatile"
        )
        before = slice(0, faults().at(20 * HOUR))
        assert np.nanmax(ecc[before]) <= 2 and np.nanmax(unc[before]) == 0
        assert np.nanmax(unc) >= 1
        assert np.nanmax(fault_series("gpuhealth_xid_events_total", node_name, 1, xid=xid)) >= 1


def test_a_repaired_gpu_answers_again_and_its_node_runs_jobs() -> None:
    s = faults()
    up = fault_series("gpuhealth_gpu_up", "gpu-005", 1)
    assert up[s.at(21 * HOUR)] == 0 and up[s.at(27 * HOUR)] == 1
    assert s.workload.busy[5, s.at(25 * HOUR)] == 0 and s.workload.busy[5, s.at(40 * HOUR) :].any()
    unc = fault_series(
        "gpuhealth_gpu_ecc_errors_total", "gpu-003", 1, type="uncorrected", counter="aggregate"
    )
    assert unc[s.at(21 * HOUR)] >= 1 and unc[s.at(31 * HOUR)] == 0  # a new GPU, its counters from zero
    fallen = fault_series("gpuhealth_gpu_fallen_off_bus_total", "gpu-005", 1)
    assert fallen[s.at(21 * HOUR)] == 1 and np.isnan(fallen[s.at(27 * HOUR)])  # the exporter restarted


def test_failing_pcie_links_move_replays_but_not_always_aer_or_the_link_width() -> None:
    s = faults()
    pcie = [f for f in s.scenario.failures if f.kind == "pcie_degradation"]
    aer = {s.gpu_index(f.node, f.gpu) for f in pcie} & set(s.aer)
    downgraded = [
        np.nanmax(fault_series("gpuhealth_gpu_pcie_link_downgraded", f.node, f.gpu)) == 1 for f in pcie
    ]
    assert all(np.nanmax(fault_series("gpuhealth_gpu_pcie_replays_total", f.node, f.gpu)) > 0 for f in pcie)
    assert 0 < len(aer) < len(pcie)
    assert 0 < sum(downgraded) < len(pcie)
