"""Fleet scenarios: the simulated cluster, its workload, and the ground truth to score alerts against.

A scenario is YAML (format in ``bench/scenarios/README.md``). Validation collects every problem and
raises them together, so a user fixes a file in one pass. Random draws depend only on the seed, so a
run is reproducible and ``--seed`` gives an independent fleet history with the same shape.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from gpuhealth.contract.duration import parse_duration as prometheus_duration

# The fault vocabulary (kinds, their XIDs) is docs/contract.md's, shared with the exporter's simulator.
from gpuhealth.contract.faults import FAULT_KINDS, FAULT_XIDS, NOISE_KINDS, SUDDEN_KINDS

# How a precursor evolves between onset and the first XID (``none``: no precursor at all).
PRECURSOR_SHAPES = ("ramp", "plateau", "step", "intermittent", "none")
# ``mix: field``: shares of GPU-attributable interruptions (bench/scenarios/README.md cites each one;
# Llama 3 on 16,384 H100 for 54 days; its 30.1 % "faulty GPU" is split between three kinds by assumption).
FIELD_SHARES = {
    "fell_off_bus": 15.0,
    "pcie_degradation": 7.5,
    "nvlink_errors": 7.6,
    "hbm_degradation": 17.2,
    "sram_uncorrectable": 4.5,
    "gsp_timeout": 4.1,
    "thermal_runaway": 1.4,
}
# Benign kinds about one GPU; ``GPU_OPTIONAL`` may name one GPU or leave the choice to the draw.
GPU_NOISE = (
    "sbe_burst",
    "sbe_chatter",
    "benign_remap",
    "contained_xid94",
    "xid63",
    "nvlink_flap",
    "pcie_replay_steady",
    "warm_gpu",
)
GPU_OPTIONAL_NOISE = ("power_cap", "boot_replay_burst", "load_imbalance")
# How long a benign event lasts when the scenario does not say (seconds, drawn log-uniformly).
NOISE_DURATIONS = {
    "sbe_burst": (60, 900),
    "hot_aisle": (3600, 6 * 3600),
    "boot_replay_burst": (60, 600),
    "power_cap": (2 * 3600, 12 * 3600),
    "idle_node": (3600, 8 * 3600),
    "checkpoint_burst": (300, 1200),
    "sbe_chatter": (6 * 3600, 3 * 86400),
    "benign_remap": (6 * 3600, 4 * 86400),  # remap pending until the next GPU reset
    "contained_xid94": (300, 2 * 3600),  # until the reset that follows
    "app_xid": (1800, 12 * 3600),
    "xid63": (60, 60),
    "nvlink_flap": (300, 3 * 3600),
    "pcie_replay_steady": (86400, 14 * 86400),
    "load_imbalance": (2 * 3600, 36 * 3600),
    "warm_gpu": (3 * 86400, 14 * 86400),
    "slow_nvml": (120, 1800),
    "power_brake": (60, 1200),
    "rack_cooling": (1800, 4 * 3600),
    "reboot_loop": (3600, 6 * 3600),
    "checkpoint_storm": (600, 2700),
}
DEFAULT_PRECURSOR = (1800, 24 * 3600)
DEFAULT_MIN_LEAD = 900.0  # time to checkpoint a job and drain its node
DEFAULT_FIELD_RATE = 0.17  # GPU failures per day per 64 nodes in the field (../shared/DOMAIN.md)
DEFAULT_LEMON_WINDOW = 7 * 86400
HANG_MAX = 1800.0  # longest a job hangs after its GPU's hard failure before the node is drained



class ScenarioError(ValueError):
    """A scenario with problems; ``problems`` lists each one, the message shows them all."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.problems = problems
        super().__init__(f"{source}: {len(problems)} problem(s):\n" + "\n".join(f"  - {p}" for p in problems))


def parse_duration(text: Any) -> float:
    """Seconds from a Prometheus duration (``90s``, ``1h30m``, ``14d``; gpuhealth.contract.duration's
    grammar, so ``1.5h`` is refused as Prometheus refuses it) or from a plain number of seconds."""
    if isinstance(text, bool):
        raise ValueError(f"{text!r} is not a duration")
    if isinstance(text, int | float):
        return float(text)
    return float(prometheus_duration(str(text).strip()))


@dataclass(frozen=True)
class Fleet:
    nodes: int
    gpus_per_node: int
    model: str
    nvlinks: int
    node_name: str
    rack_nodes: int = 4  # nodes sharing a rack's power and cooling

    def node(self, index: int) -> str:
        return self.node_name.format(index=index)

    @property
    def node_names(self) -> list[str]:
        return [self.node(i) for i in range(self.nodes)]


@dataclass(frozen=True)
class Workload:
    job_nodes: tuple[int, int]
    job_duration: tuple[float, float]
    idle_gap: tuple[float, float]
    checkpoint_every: float
    checkpoint_duration: float


@dataclass(frozen=True)
class Failure:
    """Ground truth for one failing GPU. Times are seconds since the evaluated period's start.

    ``first_xid`` is the failure instant that scoring uses: the first XID the fault logs (some
    faults log one before the GPU dies at ``failure``); None means at ``failure``. ``repaired`` is
    when the node returns to service (None: never)."""

    node: str
    gpu: int
    kind: str
    onset: float
    failure: float
    xid: int
    strength: float
    shape: str = "ramp"
    first_xid: float | None = None
    repaired: float | None = None

    @property
    def instant(self) -> float:
        return self.failure if self.first_xid is None else self.first_xid

    @property
    def has_precursor(self) -> bool:
        return self.onset < self.instant

    @property
    def precursor_seconds(self) -> float:
        return self.instant - self.onset


@dataclass(frozen=True)
class Noise:
    """A benign event; ``gpu`` is None for node-wide events. Times in seconds since the start."""

    node: str
    kind: str
    at: float
    duration: float
    strength: float
    gpu: int | None = None


@dataclass(frozen=True)
class Scenario:
    name: str
    seed: int
    start: float  # unix seconds, start of the evaluated period
    duration: float
    warmup: float  # history generated before ``start`` so that long rule windows are filled
    step: float
    fleet: Fleet
    workload: Workload
    failures: tuple[Failure, ...] = field(default_factory=tuple)
    noise: tuple[Noise, ...] = field(default_factory=tuple)
    fused_step: float | None = None  # evaluation step of alerts reading recording rules; None: theirs
    min_lead: float = DEFAULT_MIN_LEAD  # an alert predicts only this long before the failure instant
    field_rate: float = DEFAULT_FIELD_RATE  # failures per day per 64 nodes, for precision
    lemon_window: float = DEFAULT_LEMON_WINDOW  # a lemon alert is right if its node fails within it

    @property
    def end(self) -> float:
        return self.start + self.duration

    @property
    def data_start(self) -> float:
        return self.start - self.warmup


class _Checker:
    """Reads typed fields from a mapping, recording a problem instead of raising."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def mapping(self, value: Any, where: str) -> dict[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, dict):
            self.problems.append(f"{where}: expected a mapping, got {type(value).__name__}")
            return {}
        return value

    def unknown(self, data: dict[str, Any], allowed: set[str], where: str) -> None:
        for key in sorted(set(data) - allowed, key=str):
            self.problems.append(f"{where}.{key}: unknown key (allowed: {', '.join(sorted(allowed))})")

    def integer(
        self, data: dict[str, Any], key: str, where: str, default: int | None = None, minimum: int = 0
    ) -> int:
        value = data.get(key, default)
        if value is None:
            self.problems.append(f"{where}.{key}: required")
            return minimum
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            self.problems.append(f"{where}.{key}: expected an integer >= {minimum}, got {value!r}")
            return minimum
        return value

    def number(
        self, data: dict[str, Any], key: str, where: str, default: float, low: float, high: float
    ) -> float:
        value = data.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
            self.problems.append(f"{where}.{key}: expected a number in [{low}, {high}], got {value!r}")
            return default
        return float(value)

    def duration(
        self, data: dict[str, Any], key: str, where: str, default: Any = None, positive: bool = True
    ) -> float:
        value = data.get(key, default)
        if value is None:
            self.problems.append(f"{where}.{key}: required")
            return 1.0
        try:
            seconds = parse_duration(value)
        except ValueError as exc:
            self.problems.append(f"{where}.{key}: {exc}")
            return 1.0
        if seconds < 0 or (positive and seconds == 0):
            self.problems.append(f"{where}.{key}: must be {'positive' if positive else '>= 0'}")
            return 1.0
        return seconds

    def duration_range(self, data: dict[str, Any], key: str, where: str, default: Any) -> tuple[float, float]:
        value = data.get(key, default)
        if not isinstance(value, list | tuple) or len(value) != 2:
            self.problems.append(f"{where}.{key}: expected [low, high] durations, got {value!r}")
            return (1.0, 1.0)
        pair = {"low": value[0], "high": value[1]}
        low = self.duration(pair, "low", f"{where}.{key}")
        high = self.duration(pair, "high", f"{where}.{key}")
        if low > high:
            self.problems.append(f"{where}.{key}: low {value[0]} is above high {value[1]}")
        return (low, high)

    def choice(self, data: dict[str, Any], key: str, where: str, options: tuple[str, ...]) -> str:
        value = data.get(key)
        if value not in options:
            self.problems.append(f"{where}.{key}: {value!r} is not one of {', '.join(options)}")
            return options[0]
        return value

    def kinds(self, data: dict[str, Any], key: str, where: str, options: tuple[str, ...]) -> list[str]:
        value = data.get(key, list(options))
        if not isinstance(value, list) or not value:
            self.problems.append(f"{where}.{key}: expected a non-empty list of kinds")
            return list(options)
        bad = [v for v in value if v not in options]
        if bad:
            self.problems.append(
                f"{where}.{key}: unknown kind(s) {', '.join(map(str, bad))} (known: {', '.join(options)})"
            )
        return [v for v in value if v in options] or list(options)


def _parse_start(checker: _Checker, value: Any) -> float:
    if isinstance(value, datetime):
        return (value if value.tzinfo else value.replace(tzinfo=UTC)).timestamp()
    try:
        parsed = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        checker.problems.append(f"start: {value!r} is not an RFC 3339 time (e.g. 2026-01-05T00:00:00Z)")
        return 0.0
    return (parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)).timestamp()


def load_scenario(path: Path, seed: int | None = None) -> Scenario:
    """Read, validate and expand a scenario file; ``seed`` overrides the file's seed."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ScenarioError(str(path), [f"cannot read: {exc.strerror}"]) from None
    except yaml.YAMLError as exc:
        raise ScenarioError(str(path), [f"not valid YAML: {exc}"]) from None
    return parse_scenario(data, str(path), seed=seed)


def parse_scenario(data: Any, source: str = "scenario", seed: int | None = None) -> Scenario:
    check = _Checker()
    data = check.mapping(data, "scenario")
    check.unknown(
        data,
        {
            "name",
            "seed",
            "start",
            "duration",
            "warmup",
            "fused_step",
            "step",
            "fleet",
            "workload",
            "failures",
            "noise",
            "random",
            "min_lead",
            "field_rate",
            "lemon_window",
            "repair",
        },
        "scenario",
    )
    file_seed = check.integer(data, "seed", "scenario", default=1)
    seed = file_seed if seed is None else seed
    start = _parse_start(check, data.get("start", "2026-01-05T00:00:00Z"))
    duration = check.duration(data, "duration", "scenario")
    warmup = check.duration(data, "warmup", "scenario", default="6h", positive=False)
    step = check.duration(data, "step", "scenario", default="60s")
    if step < 1 or step != int(step):
        check.problems.append(f"scenario.step: must be a whole number of seconds >= 1, got {step:g}s")
    min_lead = check.duration(data, "min_lead", "scenario", default=DEFAULT_MIN_LEAD, positive=False)
    field_rate = check.number(data, "field_rate", "scenario", DEFAULT_FIELD_RATE, 1e-6, 1000.0)
    lemon_window = check.duration(data, "lemon_window", "scenario", default=DEFAULT_LEMON_WINDOW)
    repair = check.duration_range(data, "repair", "scenario", None) if "repair" in data else None

    fused_step = check.duration(data, "fused_step", "scenario") if "fused_step" in data else None
    raw_fleet = check.mapping(data.get("fleet"), "fleet")
    check.unknown(
        raw_fleet, {"nodes", "gpus_per_node", "model", "nvlinks", "node_name", "rack_nodes"}, "fleet"
    )
    node_name = str(raw_fleet.get("node_name", "gpu-{index:03d}"))
    try:
        node_name.format(index=0)
    except (KeyError, IndexError, ValueError):
        check.problems.append(f"fleet.node_name: {node_name!r} must be a format string using {{index}}")
        node_name = "gpu-{index:03d}"
    fleet = Fleet(
        nodes=check.integer(raw_fleet, "nodes", "fleet", minimum=1),
        gpus_per_node=check.integer(raw_fleet, "gpus_per_node", "fleet", default=8, minimum=1),
        model=str(raw_fleet.get("model", "NVIDIA H100 80GB HBM3")),
        nvlinks=check.integer(raw_fleet, "nvlinks", "fleet", default=18, minimum=0),
        node_name=node_name,
        rack_nodes=check.integer(raw_fleet, "rack_nodes", "fleet", default=4, minimum=1),
    )

    raw_work = check.mapping(data.get("workload"), "workload")
    check.unknown(
        raw_work,
        {"job_nodes", "job_duration", "idle_gap", "checkpoint_every", "checkpoint_duration"},
        "workload",
    )
    job_nodes = raw_work.get("job_nodes", [1, 4])
    if (
        not isinstance(job_nodes, list)
        or len(job_nodes) != 2
        or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in job_nodes)
        or job_nodes[0] > job_nodes[1]
    ):
        check.problems.append(f"workload.job_nodes: expected [low, high] node counts >= 1, got {job_nodes!r}")
        job_nodes = [1, 1]
    workload = Workload(
        job_nodes=(job_nodes[0], job_nodes[1]),
        job_duration=check.duration_range(raw_work, "job_duration", "workload", ["2h", "12h"]),
        idle_gap=check.duration_range(raw_work, "idle_gap", "workload", ["5m", "1h"]),
        checkpoint_every=check.duration(raw_work, "checkpoint_every", "workload", default="1h"),
        checkpoint_duration=check.duration(raw_work, "checkpoint_duration", "workload", default="4m"),
    )

    nodes = set(fleet.node_names)
    failures = [
        _failure(check, item, f"failures[{i}]", nodes, fleet, duration)
        for i, item in enumerate(_items(check, data.get("failures"), "failures"))
    ]
    noise = [
        _noise(check, item, f"noise[{i}]", nodes, fleet, duration)
        for i, item in enumerate(_items(check, data.get("noise"), "noise"))
    ]
    rng = random.Random(seed)
    raw_random = check.mapping(data.get("random"), "random")
    check.unknown(raw_random, {"failures", "noise"}, "random")
    if repair is not None:
        failures = [_repaired(f, rng, repair) if f is not None else None for f in failures]
    failures += _random_failures(check, raw_random.get("failures"), rng, fleet, duration, failures, repair)
    noise += _random_noise(check, raw_random.get("noise"), rng, fleet, duration)
    _check_overlaps(check, failures)
    if check.problems:
        raise ScenarioError(source, check.problems)
    return Scenario(
        name=str(data.get("name", Path(source).stem)),
        seed=seed,
        start=start,
        duration=duration,
        warmup=warmup,
        step=step,
        fused_step=fused_step,
        fleet=fleet,
        workload=workload,
        failures=tuple(f for f in failures if f is not None),
        noise=tuple(n for n in noise if n is not None),
        min_lead=min_lead,
        field_rate=field_rate,
        lemon_window=lemon_window,
    )


def _items(check: _Checker, value: Any, where: str) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list):
        check.problems.append(f"{where}: expected a list")
        return []
    return [check.mapping(item, f"{where}[{i}]") for i, item in enumerate(value)]


def _location(
    check: _Checker, item: dict[str, Any], where: str, nodes: set[str], fleet: Fleet, gpu_required: bool
) -> tuple[str, int | None]:
    node = item.get("node")
    if node not in nodes:
        check.problems.append(
            f"{where}.node: {node!r} is not a node of the fleet "
            f"({fleet.node(0)} .. {fleet.node(fleet.nodes - 1)})"
        )
    gpu = item.get("gpu")
    if gpu is None and not gpu_required:
        return str(node), None
    if isinstance(gpu, bool) or not isinstance(gpu, int) or not 0 <= gpu < fleet.gpus_per_node:
        check.problems.append(f"{where}.gpu: expected a GPU index 0..{fleet.gpus_per_node - 1}, got {gpu!r}")
        return str(node), 0
    return str(node), gpu


def _failure(
    check: _Checker, item: dict[str, Any], where: str, nodes: set[str], fleet: Fleet, duration: float
) -> Failure | None:
    check.unknown(
        item,
        {"node", "gpu", "kind", "onset", "failure", "xid", "strength", "shape", "first_xid", "repaired"},
        where,
    )
    node, gpu = _location(check, item, where, nodes, fleet, gpu_required=True)
    kind = check.choice(item, "kind", where, FAULT_KINDS)
    known = len(check.problems)
    failure = check.duration(item, "failure", where)
    sudden = kind in SUDDEN_KINDS or item.get("shape") == "none"
    onset = failure if sudden else check.duration(item, "onset", where, positive=False)
    if sudden and "onset" in item:
        what = kind if kind in SUDDEN_KINDS else f"{kind} with shape none"
        check.problems.append(f"{where}.onset: {what} has no precursor; leave onset out")
    shape = "none" if kind in SUDDEN_KINDS else str(item.get("shape", "ramp"))
    if shape not in PRECURSOR_SHAPES:
        check.problems.append(f"{where}.shape: {shape!r} is not one of {', '.join(PRECURSOR_SHAPES)}")
    first_xid = check.duration(item, "first_xid", where, positive=False) if "first_xid" in item else None
    if first_xid is not None and not onset <= first_xid <= failure:
        check.problems.append(f"{where}.first_xid: must lie between onset and failure")
    if onset > failure and len(check.problems) == known:
        check.problems.append(f"{where}: onset {item.get('onset')} is after failure {item.get('failure')}")
    if failure >= duration:
        check.problems.append(f"{where}.failure: {item.get('failure')} is not within the scenario duration")
    repaired = check.duration(item, "repaired", where) if "repaired" in item else None
    if repaired is not None and repaired <= failure + HANG_MAX:
        check.problems.append(f"{where}.repaired: must be more than 30m after the failure")
    xid = item.get("xid", FAULT_XIDS[kind][0])
    if xid not in FAULT_XIDS[kind]:
        check.problems.append(
            f"{where}.xid: {xid!r} is not an XID of {kind} ({', '.join(map(str, FAULT_XIDS[kind]))})"
        )
    strength = check.number(item, "strength", where, 0.7, 0.0, 1.0)
    return Failure(
        node,
        gpu or 0,
        kind,
        onset,
        failure,
        int(xid) if isinstance(xid, int) else 0,
        strength,
        shape,
        first_xid,
        repaired,
    )


def _noise(
    check: _Checker, item: dict[str, Any], where: str, nodes: set[str], fleet: Fleet, duration: float
) -> Noise | None:
    check.unknown(item, {"node", "gpu", "kind", "at", "duration", "strength"}, where)
    kind = check.choice(item, "kind", where, NOISE_KINDS)
    node, gpu = _location(check, item, where, nodes, fleet, gpu_required=kind in GPU_NOISE)
    if gpu is not None and kind not in GPU_NOISE + GPU_OPTIONAL_NOISE:
        check.problems.append(f"{where}.gpu: {kind} is node-wide; leave gpu out")
        gpu = None
    at = check.duration(item, "at", where, positive=False)
    if at >= duration:
        check.problems.append(f"{where}.at: {item.get('at')} is not within the scenario duration")
    low, high = NOISE_DURATIONS[kind]
    length = check.duration(item, "duration", where, default=(low + high) / 2)
    strength = check.number(item, "strength", where, 0.7, 0.0, 1.0)
    return Noise(node, kind, at, length, strength, gpu)


def _weights(
    check: _Checker,
    section: dict[str, Any],
    key: str,
    where: str,
    options: tuple[str, ...],
    default: dict[str, float],
) -> dict[str, float]:
    """A ``{name: share}`` mapping (or a list: equal shares) restricted to known names."""
    value = section.get(key, default)
    if isinstance(value, list):
        value = dict.fromkeys(value, 1.0)
    if not isinstance(value, dict) or not value:
        check.problems.append(f"{where}.{key}: expected a list or a mapping of name: share")
        return default
    out = {}
    for name, share in value.items():
        if name not in options:
            check.problems.append(f"{where}.{key}: unknown name {name!r} (known: {', '.join(options)})")
        elif isinstance(share, bool) or not isinstance(share, int | float) or share < 0:
            check.problems.append(f"{where}.{key}.{name}: expected a share >= 0, got {share!r}")
        else:
            out[name] = float(share)
    if out and not sum(out.values()):
        check.problems.append(f"{where}.{key}: every share is 0")
    return out or default


def _loguniform(rng: random.Random, low: float, high: float) -> float:
    return math.exp(rng.uniform(math.log(low), math.log(high))) if low > 0 else rng.uniform(low, high)


def _repaired(failure: Failure, rng: random.Random, repair: tuple[float, float]) -> Failure:
    """A listed failure without ``repaired`` gets a drawn repair delay when the scenario has ``repair``."""
    if failure.repaired is not None:
        return failure
    return replace(failure, repaired=round(failure.failure + HANG_MAX + _loguniform(rng, *repair)))


def _busy(failures: list[Failure | None]) -> dict[str, list[tuple[float, float]]]:
    """Per node, the spans a failure holds it: from precursor onset until it is back in service."""
    spans: dict[str, list[tuple[float, float]]] = {}
    for f in failures:
        if f is not None:
            end = math.inf if f.repaired is None else f.repaired
            spans.setdefault(f.node, []).append((f.onset, end))
    return spans


def _random_failures(
    check: _Checker,
    value: Any,
    rng: random.Random,
    fleet: Fleet,
    duration: float,
    fixed: list[Failure | None],
    repair: tuple[float, float] | None,
) -> list[Failure]:
    """Draw failures where their node is in service for the whole precursor. Without ``mix: field``
    kinds are taken in turn so that every listed kind occurs; with it they are drawn in field shares."""
    section = check.mapping(value, "random.failures")
    check.unknown(
        section,
        {"count", "kinds", "precursor", "mix", "shapes", "strength", "lemons", "early_xid"},
        "random.failures",
    )
    count = check.integer(section, "count", "random.failures", default=0) if section else 0
    if not count:
        return []
    kinds = check.kinds(section, "kinds", "random.failures", FAULT_KINDS)
    mix = section.get("mix", "equal")
    if mix not in ("equal", "field"):
        check.problems.append(f"random.failures.mix: {mix!r} is not one of equal, field")
    low, high = (
        check.duration_range(section, "precursor", "random.failures", ["30m", "24h"])
        if "precursor" in section
        else DEFAULT_PRECURSOR
    )
    shapes = _weights(check, section, "shapes", "random.failures", PRECURSOR_SHAPES, {"ramp": 1.0})
    strength = section.get("strength", [0.25, 1.0])
    if (
        not isinstance(strength, list)
        or len(strength) != 2
        or not all(isinstance(x, int | float) and not isinstance(x, bool) and 0 < x <= 1 for x in strength)
        or strength[0] > strength[1]
    ):
        check.problems.append(
            f"random.failures.strength: expected [low, high] within (0, 1], got {strength!r}"
        )
        strength = [0.25, 1.0]
    early = check.number(section, "early_xid", "random.failures", 0.0, 0.0, 1.0)
    lemons = check.mapping(section.get("lemons"), "random.failures.lemons")
    check.unknown(lemons, {"nodes", "weight"}, "random.failures.lemons")
    lemon_count = check.integer(lemons, "nodes", "random.failures.lemons", default=0)
    lemon_weight = check.number(lemons, "weight", "random.failures.lemons", 10.0, 1.0, 1000.0)
    if high + 1800 >= duration:
        check.problems.append("random.failures.precursor: the longest precursor does not fit in the duration")
    if lemon_count > fleet.nodes:
        check.problems.append(
            f"random.failures.lemons.nodes: {lemon_count} exceeds the fleet's {fleet.nodes}"
        )
    if check.problems:
        return []
    if mix == "field":
        order = rng.choices(kinds, weights=[FIELD_SHARES[k] for k in kinds], k=count)
    else:
        order = [kinds[i % len(kinds)] for i in range(count)]
        rng.shuffle(order)
    names = fleet.node_names
    lemon_nodes = set(rng.sample(names, lemon_count))
    node_weights = [lemon_weight if n in lemon_nodes else 1.0 for n in names]
    spans = _busy(fixed)
    drawn: list[Failure] = []
    for kind in order:
        for _ in range(500):
            shape = "none" if kind in SUDDEN_KINDS else rng.choices(list(shapes), list(shapes.values()))[0]
            lead = 0.0 if shape == "none" else _loguniform(rng, low, high)
            hard = rng.uniform(lead + 600, duration - 1800)
            node = rng.choices(names, node_weights)[0]
            back = None if repair is None else hard + HANG_MAX + _loguniform(rng, *repair)
            end = math.inf if back is None else back
            if all(end <= a or hard - lead >= b for a, b in spans.get(node, [])):
                break
        else:
            check.problems.append(
                f"random.failures.count: no room left for {count} failures (nodes stay out of service "
                "from precursor onset until repaired; give repair, fewer failures or a longer duration)"
            )
            return []
        first = None
        if early and lead and kind in ("hbm_degradation", "nvlink_errors") and rng.random() < early:
            first = round(hard - rng.uniform(0.02, 0.3) * lead)  # an XID logged before the GPU dies
        spans.setdefault(node, []).append((hard - lead, end))
        drawn.append(
            Failure(
                node,
                rng.randrange(fleet.gpus_per_node),
                kind,
                round(hard - lead),
                round(hard),
                rng.choice(FAULT_XIDS[kind]),
                round(_loguniform(rng, *strength), 2),
                shape,
                first,
                None if back is None else round(back),
            )
        )
    return drawn


def _random_noise(
    check: _Checker, value: Any, rng: random.Random, fleet: Fleet, duration: float
) -> list[Noise]:
    """Benign events in the listed kinds' shares (every listed kind at least once), durations drawn
    log-uniformly from the kind's range."""
    section = check.mapping(value, "random.noise")
    check.unknown(section, {"count", "kinds"}, "random.noise")
    count = check.integer(section, "count", "random.noise", default=0) if section else 0
    shares = _weights(check, section, "kinds", "random.noise", NOISE_KINDS, dict.fromkeys(NOISE_KINDS, 1.0))
    if not count or check.problems:
        return []
    kinds = _apportion(shares, count)
    drawn = []
    for kind in kinds:
        low, high = NOISE_DURATIONS[kind]
        length = min(_loguniform(rng, low, high), duration)
        gpu = rng.randrange(fleet.gpus_per_node) if kind in GPU_NOISE else None
        drawn.append(
            Noise(
                fleet.node(rng.randrange(fleet.nodes)),
                kind,
                round(rng.uniform(0, max(duration - length, 1))),
                round(length),
                round(rng.uniform(0.1, 1.0), 2),
                gpu,
            )
        )
    rng.shuffle(drawn)
    return drawn


def _apportion(shares: dict[str, float], count: int) -> list[str]:
    """``count`` kinds in proportion to ``shares`` (largest remainder), each kind with a share > 0
    at least once when ``count`` allows."""
    kinds = [k for k, v in shares.items() if v > 0]
    total = sum(shares[k] for k in kinds)
    exact = {k: count * shares[k] / total for k in kinds}
    taken = {k: max(int(exact[k]), 1 if count >= len(kinds) else 0) for k in kinds}
    for k in sorted(kinds, key=lambda k: exact[k] - int(exact[k]), reverse=True):
        if sum(taken.values()) >= count:
            break
        taken[k] += 1
    while sum(taken.values()) > count:
        k = max(kinds, key=lambda k: taken[k])
        taken[k] -= 1
    return [k for k in kinds for _ in range(taken[k])]


def _check_overlaps(check: _Checker, failures: list[Failure | None]) -> None:
    """A node is out of service from a failure's precursor onset until its repair (for ever without
    one), so another failure on it must lie outside that span."""
    seen: dict[str, list[tuple[int, float, float]]] = {}
    for i, failure in enumerate(failures):
        if failure is None:
            continue
        end = math.inf if failure.repaired is None else failure.repaired
        for j, a, b in seen.get(failure.node, []):
            if not (end <= a or failure.onset >= b):
                check.problems.append(
                    f"failures[{i}]: {failure.node} is out of service then because of failures[{j}] "
                    "(until repaired; give `repaired` or `repair` to let a node fail again)"
                )
        seen.setdefault(failure.node, []).append((i, failure.onset, end))
