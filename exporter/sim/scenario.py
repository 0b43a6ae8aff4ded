"""Scenario files for the simulator: GPUs, a workload pattern and timed faults.

The fault vocabulary is ``gpuhealth.contract.faults`` (docs/contract.md), shared with the detection
benchmark; noise that needs a fleet is left out. Times are seconds from exporter start (or from the
SIGHUP that reloaded the file), so a precursor can last a minute in a demo or days in a soak test.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from gpuhealth.contract.faults import APP_XIDS, FAULT_KINDS, FAULT_XIDS
from gpuhealth.contract.faults import NODE_NOISE_KINDS as NOISE_KINDS

HBM_XIDS = tuple(sorted(FAULT_XIDS["hbm_degradation"]))

# kind -> (default precursor or duration seconds, extra keys it accepts)
_KIND_KEYS: dict[str, tuple[float, dict[str, type]]] = {
    "hbm_degradation": (120.0, {"xid": int}),
    "thermal_runaway": (120.0, {}),
    "pcie_degradation": (120.0, {}),
    "nvlink_errors": (60.0, {"link": int}),
    "gsp_timeout": (0.0, {}),
    "fell_off_bus": (0.0, {}),
    "sbe_burst": (30.0, {"count": int}),
    "hot_aisle": (120.0, {"delta_celsius": float}),
    "boot_replay_burst": (5.0, {"count": int}),
    "power_cap": (120.0, {"watts": float}),
    "idle_node": (120.0, {}),
    "sram_uncorrectable": (0.0, {}),
    "sbe_chatter": (600.0, {"count": int}),
    "benign_remap": (120.0, {}),
    "contained_xid94": (60.0, {}),
    "app_xid": (120.0, {"xid": int}),
    "xid63": (1.0, {}),
    "nvlink_flap": (60.0, {"link": int}),
    "pcie_replay_steady": (600.0, {"count": int}),
    "warm_gpu": (600.0, {"delta_celsius": float}),
    "slow_nvml": (60.0, {}),
    "power_brake": (60.0, {}),
}
_NODE_WIDE = ("hot_aisle", "idle_node", "app_xid", "slow_nvml", "power_brake")


class ScenarioError(ValueError):
    """A scenario file is invalid; ``problems`` lists every problem found."""

    def __init__(self, source: str, problems: list[str]) -> None:
        super().__init__(f"{source}: " + "; ".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class Workload:
    utilization: float = 0.9
    power_watts: float = 560.0
    temperature_celsius: float = 62.0
    memory_temperature_celsius: float = 58.0
    period_seconds: float = 0.0   # 0: steady load; else a job loop with an idle phase each period
    idle_fraction: float = 0.0


@dataclass(frozen=True)
class Process:
    pid: int
    gpus: tuple[int, ...]
    memory_bytes: int = 8 << 30


@dataclass(frozen=True)
class Fault:
    """A fault (precursor, then a hard failure) or benign noise (active for ``duration``)."""

    kind: str
    gpus: tuple[int, ...]
    start: float = 0.0
    duration: float = 0.0   # precursor length for faults, active time for noise
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def is_noise(self) -> bool:
        return self.kind in NOISE_KINDS


@dataclass(frozen=True)
class Scenario:
    gpus: int = 8
    model: str = "NVIDIA H100 80GB HBM3"
    nvlinks: int = 18
    driver_version: str = "550.54.15"
    seed: int = 0
    workload: Workload = field(default_factory=Workload)
    processes: tuple[Process, ...] = ()
    faults: tuple[Fault, ...] = ()


_TOP_KEYS = {"gpus", "model", "nvlinks", "driver_version", "seed", "workload", "processes", "faults"}


def _number(value: Any, where: str, problems: list[str], minimum: float = 0.0, integer: bool = False) -> Any:
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or value < minimum:
        problems.append(f"{where}: expected {'an integer' if integer else 'a number'} >= {minimum:g}, "
                        f"got {value!r}")
        return None
    return value


def parse_scenario(data: Any, source: str = "scenario") -> Scenario:
    """Validate a decoded scenario document; raise ``ScenarioError`` listing every problem."""
    problems: list[str] = []
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ScenarioError(source, ["the document must be a mapping"])
    known = ", ".join(sorted(_TOP_KEYS))
    problems += [f"unknown key {k!r} (known: {known})" for k in data if k not in _TOP_KEYS]
    base = Scenario()
    gpus = _number(data.get("gpus", base.gpus), "gpus", problems, 1, integer=True) or base.gpus
    nvlinks = _number(data.get("nvlinks", base.nvlinks), "nvlinks", problems, 0, integer=True)
    seed = _number(data.get("seed", 0), "seed", problems, 0, integer=True)
    workload = _parse_workload(data.get("workload") or {}, problems)
    processes = tuple(p for i, raw in enumerate(data.get("processes") or [])
                      if (p := _parse_process(raw, f"processes[{i}]", gpus, problems)))
    faults = tuple(f for i, raw in enumerate(data.get("faults") or [])
                   if (f := _parse_fault(raw, f"faults[{i}]", gpus, nvlinks or 0, problems)))
    if problems:
        raise ScenarioError(source, problems)
    return Scenario(gpus=gpus, model=str(data.get("model", base.model)), nvlinks=nvlinks or 0,
                    driver_version=str(data.get("driver_version", base.driver_version)), seed=seed or 0,
                    workload=workload, processes=processes, faults=faults)


def _parse_workload(raw: Any, problems: list[str]) -> Workload:
    if not isinstance(raw, dict):
        problems.append("workload: must be a mapping")
        return Workload()
    known = Workload.__dataclass_fields__
    values = {}
    for key, value in raw.items():
        if key not in known:
            problems.append(f"workload: unknown key {key!r} (known: {', '.join(known)})")
        elif _number(value, f"workload.{key}", problems) is not None:
            values[key] = float(value)
    if values.get("utilization", 0) > 1 or values.get("idle_fraction", 0) > 1:
        problems.append("workload: utilization and idle_fraction are ratios in 0..1")
    return Workload(**values)


def _gpu_index(value: Any, where: str, gpus: int, problems: list[str]) -> int | None:
    index: int | None = _number(value, where, problems, 0, integer=True)
    if index is not None and index >= gpus:
        problems.append(f"{where}: GPU {index} does not exist (the scenario has {gpus})")
        return None
    return index


def _parse_process(raw: Any, where: str, gpus: int, problems: list[str]) -> Process | None:
    if not isinstance(raw, dict) or "pid" not in raw or "gpus" not in raw:
        problems.append(f"{where}: expected a mapping with 'pid' and 'gpus'")
        return None
    pid = _number(raw["pid"], f"{where}.pid", problems, 1, integer=True)
    indices = [_gpu_index(g, f"{where}.gpus", gpus, problems) for g in raw["gpus"] or []]
    known = tuple(i for i in indices if i is not None)
    if pid is None or len(known) < len(indices):
        return None
    return Process(pid, known)


def _parse_fault(raw: Any, where: str, gpus: int, nvlinks: int, problems: list[str]) -> Fault | None:
    if not isinstance(raw, dict):
        problems.append(f"{where}: must be a mapping")
        return None
    kind = raw.get("kind")
    if kind not in _KIND_KEYS:
        problems.append(f"{where}: unknown kind {kind!r} (faults: {', '.join(FAULT_KINDS)}; "
                        f"noise: {', '.join(NOISE_KINDS)})")
        return None
    default_duration, extra = _KIND_KEYS[kind]
    duration_key = "duration" if kind in NOISE_KINDS else "precursor"
    allowed = {"kind", "gpu", "start", duration_key, *extra} | ({"gpus"} if kind in _NODE_WIDE else set())
    before = len(problems)
    problems += [f"{where}: unknown key {k!r} for {kind} (known: {', '.join(sorted(allowed))})"
                 for k in raw if k not in allowed]
    start = _number(raw.get("start", 0), f"{where}.start", problems)
    duration = _number(raw.get(duration_key, default_duration), f"{where}.{duration_key}", problems)
    if kind in _NODE_WIDE:
        selected = raw.get("gpus", list(range(gpus)))
        indices = tuple(_gpu_index(g, f"{where}.gpus", gpus, problems) for g in selected)
    elif "gpu" not in raw:
        problems.append(f"{where}: {kind} needs 'gpu'")
        indices = ()
    else:
        indices = (_gpu_index(raw["gpu"], f"{where}.gpu", gpus, problems),)
    params = {}
    for key, cls in extra.items():
        if key in raw and _number(raw[key], f"{where}.{key}", problems, integer=cls is int) is not None:
            params[key] = cls(raw[key])
    if kind == "hbm_degradation" and params.get("xid", 95) not in HBM_XIDS:
        problems.append(f"{where}.xid: hbm_degradation ends in one of {HBM_XIDS}")
    if kind == "app_xid" and params.get("xid", 13) not in APP_XIDS:
        problems.append(f"{where}.xid: app_xid logs one of {APP_XIDS}")
    if params.get("link", 0) >= max(nvlinks, 1):
        problems.append(f"{where}.link: link {params['link']} does not exist (the scenario has {nvlinks})")
    if len(problems) > before:
        return None
    known = tuple(i for i in indices if i is not None)  # all of them: a missing one is a problem above
    return Fault(kind, known, float(start), float(duration), params)


def load_scenario(path: Path | None) -> Scenario:
    """Read a scenario file; None gives the default node (8 healthy H100s, 18 NVLinks each)."""
    if path is None:
        return Scenario()
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ScenarioError(str(path), [f"cannot read: {exc.strerror}"]) from None
    except yaml.YAMLError as exc:
        raise ScenarioError(str(path), [f"not valid YAML: {exc}"]) from None
    return parse_scenario(data, str(path))
