"""Fleet scenarios: the simulated cluster, its workload, and the ground truth to score alerts against.

A scenario is YAML (format in ``bench/scenarios/README.md``). Validation collects every problem and
raises them together, so a user fixes a file in one pass. Random draws depend only on the seed, so a
run is reproducible and ``--seed`` gives an independent fleet history with the same shape.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

FAULT_KINDS = (
    "hbm_degradation",
    "thermal_runaway",
    "pcie_degradation",
    "nvlink_errors",
    "gsp_timeout",
    "fell_off_bus",
)
NOISE_KINDS = ("sbe_burst", "hot_aisle", "boot_replay_burst", "power_cap", "idle_node", "checkpoint_burst")
# Faults that give no warning: their precursor onset is the hard failure itself.
SUDDEN_KINDS = ("gsp_timeout", "fell_off_bus")
# XIDs the kernel logs at the hard failure (docs/contract.md, fault vocabulary).
FAULT_XIDS = {
    "hbm_degradation": (64, 94, 95, 48),
    "thermal_runaway": (79,),
    "pcie_degradation": (79,),
    "nvlink_errors": (74,),
    "gsp_timeout": (119,),
    "fell_off_bus": (79,),
}
# How long a benign event lasts when the scenario does not say (seconds, drawn uniformly).
NOISE_DURATIONS = {
    "sbe_burst": (60, 900),
    "hot_aisle": (3600, 6 * 3600),
    "boot_replay_burst": (60, 60),
    "power_cap": (2 * 3600, 12 * 3600),
    "idle_node": (3600, 8 * 3600),
    "checkpoint_burst": (300, 1200),
}
DEFAULT_PRECURSOR = (1800, 24 * 3600)

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)")
_DURATION = re.compile(rf"^(?:{_DURATION_PART.pattern})+$")
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


class ScenarioError(ValueError):
    """A scenario with problems; ``problems`` lists each one, the message shows them all."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.problems = problems
        super().__init__(f"{source}: {len(problems)} problem(s):\n" + "\n".join(f"  - {p}" for p in problems))


def parse_duration(text: Any) -> float:
    """Seconds from a Prometheus-style duration (``90s``, ``15m``, ``6h``, ``14d``, ``1h30m``) or a number."""
    if isinstance(text, bool):
        raise ValueError(f"{text!r} is not a duration")
    if isinstance(text, int | float):
        return float(text)
    text = str(text).strip()
    if not _DURATION.match(text):
        raise ValueError(f"{text!r} is not a duration (e.g. 30s, 15m, 6h, 14d, 1h30m)")
    return sum(float(number) * _UNITS[unit] for number, unit in _DURATION_PART.findall(text))


@dataclass(frozen=True)
class Fleet:
    nodes: int
    gpus_per_node: int
    model: str
    nvlinks: int
    node_name: str

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
    """Ground truth for one failing GPU. Times are seconds since the evaluated period's start."""

    node: str
    gpu: int
    kind: str
    onset: float
    failure: float
    xid: int
    strength: float

    @property
    def has_precursor(self) -> bool:
        return self.onset < self.failure


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

    fused_step = check.duration(data, "fused_step", "scenario") if "fused_step" in data else None
    raw_fleet = check.mapping(data.get("fleet"), "fleet")
    check.unknown(raw_fleet, {"nodes", "gpus_per_node", "model", "nvlinks", "node_name"}, "fleet")
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
    failures += _random_failures(check, raw_random.get("failures"), rng, fleet, duration, failures)
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
    check.unknown(item, {"node", "gpu", "kind", "onset", "failure", "xid", "strength"}, where)
    node, gpu = _location(check, item, where, nodes, fleet, gpu_required=True)
    kind = check.choice(item, "kind", where, FAULT_KINDS)
    known = len(check.problems)
    failure = check.duration(item, "failure", where)
    onset = failure if kind in SUDDEN_KINDS else check.duration(item, "onset", where, positive=False)
    if kind in SUDDEN_KINDS and "onset" in item:
        check.problems.append(f"{where}.onset: {kind} has no precursor; leave onset out")
    if onset > failure and len(check.problems) == known:
        check.problems.append(f"{where}: onset {item.get('onset')} is after failure {item.get('failure')}")
    if failure >= duration:
        check.problems.append(f"{where}.failure: {item.get('failure')} is not within the scenario duration")
    xid = item.get("xid", FAULT_XIDS[kind][0])
    if xid not in FAULT_XIDS[kind]:
        check.problems.append(
            f"{where}.xid: {xid!r} is not an XID of {kind} ({', '.join(map(str, FAULT_XIDS[kind]))})"
        )
    strength = check.number(item, "strength", where, 0.7, 0.0, 1.0)
    return Failure(node, gpu or 0, kind, onset, failure, int(xid) if isinstance(xid, int) else 0, strength)


def _noise(
    check: _Checker, item: dict[str, Any], where: str, nodes: set[str], fleet: Fleet, duration: float
) -> Noise | None:
    check.unknown(item, {"node", "gpu", "kind", "at", "duration", "strength"}, where)
    kind = check.choice(item, "kind", where, NOISE_KINDS)
    node, gpu = _location(check, item, where, nodes, fleet, gpu_required=kind in ("sbe_burst", "power_cap"))
    at = check.duration(item, "at", where, positive=False)
    if at >= duration:
        check.problems.append(f"{where}.at: {item.get('at')} is not within the scenario duration")
    low, high = NOISE_DURATIONS[kind]
    length = check.duration(item, "duration", where, default=(low + high) / 2)
    strength = check.number(item, "strength", where, 0.7, 0.0, 1.0)
    return Noise(node, kind, at, length, strength, gpu)


def _random_section(
    check: _Checker, value: Any, where: str, options: tuple[str, ...]
) -> tuple[int, list[str], dict[str, Any]]:
    section = check.mapping(value, where)
    allowed = {"count", "kinds", "precursor"} if where == "random.failures" else {"count", "kinds"}
    check.unknown(section, allowed, where)
    count = check.integer(section, "count", where, default=0) if section else 0
    return count, check.kinds(section, "kinds", where, options), section


def _random_failures(
    check: _Checker,
    value: Any,
    rng: random.Random,
    fleet: Fleet,
    duration: float,
    fixed: list[Failure | None],
) -> list[Failure]:
    """Draw failures on distinct nodes, kinds taken in turn so that every listed kind occurs."""
    count, kinds, section = _random_section(check, value, "random.failures", FAULT_KINDS)
    if not count:
        return []
    low, high = (
        check.duration_range(section, "precursor", "random.failures", ["30m", "24h"])
        if "precursor" in section
        else DEFAULT_PRECURSOR
    )
    taken = {f.node for f in fixed if f is not None}
    free = [node for node in fleet.node_names if node not in taken]
    if count > len(free):
        check.problems.append(
            f"random.failures.count: {count} exceeds the {len(free)} nodes left to fail "
            "(one failure per node)"
        )
        return []
    if high + 1800 >= duration:
        check.problems.append("random.failures.precursor: the longest precursor does not fit in the duration")
        return []
    order = [kinds[i % len(kinds)] for i in range(count)]
    rng.shuffle(order)
    drawn = []
    for kind, node in zip(order, rng.sample(free, count), strict=True):
        gpu = rng.randrange(fleet.gpus_per_node)
        lead = 0.0 if kind in SUDDEN_KINDS else math.exp(rng.uniform(math.log(low), math.log(high)))
        failure = rng.uniform(lead + 600, duration - 1800)
        drawn.append(
            Failure(
                node,
                gpu,
                kind,
                round(failure - lead),
                round(failure),
                rng.choice(FAULT_XIDS[kind]),
                round(rng.uniform(0.25, 1.0), 2),
            )
        )
    return drawn


def _random_noise(
    check: _Checker, value: Any, rng: random.Random, fleet: Fleet, duration: float
) -> list[Noise]:
    count, kinds, _ = _random_section(check, value, "random.noise", NOISE_KINDS)
    drawn = []
    for i in range(count):
        kind = kinds[i % len(kinds)]
        low, high = NOISE_DURATIONS[kind]
        length = rng.uniform(low, high)
        gpu = (
            rng.randrange(fleet.gpus_per_node)
            if kind in ("sbe_burst", "power_cap", "boot_replay_burst")
            else None
        )
        drawn.append(
            Noise(
                fleet.node(rng.randrange(fleet.nodes)),
                kind,
                round(rng.uniform(0, max(duration - length, 1))),
                round(length),
                round(rng.uniform(0.25, 1.0), 2),
                gpu,
            )
        )
    rng.shuffle(drawn)
    return drawn


def _check_overlaps(check: _Checker, failures: list[Failure | None]) -> None:
    """A failed node is out of service until the end of the run, so it fails at most once."""
    seen: dict[str, int] = {}
    for i, failure in enumerate(failures):
        if failure is None:
            continue
        if failure.node in seen:
            check.problems.append(
                f"failures[{i}]: {failure.node} already fails in "
                f"failures[{seen[failure.node]}]; one failure per node"
            )
        seen[failure.node] = i
