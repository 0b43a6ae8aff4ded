"""Scenario files for the simulator: GPUs, a workload pattern and timed faults.

The fault vocabulary is ``gpuhealth.contract.faults`` (docs/contract.md), shared with the detection
benchmark; noise that needs a fleet is left out. Times are seconds from exporter start (or from the
SIGHUP that reloaded the file), so a precursor can last a minute in a demo or days in a soak test.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import yaml
from gpuhealth.contract.duration import Offset
from gpuhealth.contract.faults import (
    APP_XIDS,
    FABRIC_KINDS,
    FAULT_XIDS,
    RESET_ENDS_NOISE_KINDS,
    RESET_REPAIRS_KINDS,
)
from gpuhealth.contract.faults import SIMULATED_NODE_NOISE_KINDS as NOISE_KINDS
from gpuhealth.contract.files import parse_yaml, read_text
from gpuhealth.contract.validation import Location, Model, OneOf, problems
from pydantic import Field, ValidationError

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
    "ib_link_flap": (600.0, {"nic": int}),
    "ib_symbol_errors": (600.0, {"nic": int}),
    "ib_rate_downgrade": (60.0, {"nic": int, "rate_gbps": float}),
    "nvswitch_fatal": (60.0, {"count": int}),
    "ib_boot_flap": (30.0, {"nic": int}),
    "switch_reboot": (300.0, {}),
}
# What a GPU reset ends on its GPU, struck or still to come: the faults it repairs and the noise that
# lasts until a reset. Everything else (a wearing HBM stack among them) goes on after it.
RESET_ENDS_KINDS = (*RESET_REPAIRS_KINDS, *RESET_ENDS_NOISE_KINDS)
_NODE_WIDE = ("hot_aisle", "idle_node", "app_xid", "slow_nvml", "power_brake")
_NIC_KINDS = ("ib_link_flap", "ib_symbol_errors", "ib_rate_downgrade", "ib_boot_flap")  # take ``nic``


class ScenarioError(ValueError):
    """A scenario file is invalid; ``problems`` lists every problem found."""

    def __init__(self, source: str, problems: list[str]) -> None:
        super().__init__(f"{source}: " + "; ".join(problems))
        self.problems = problems


NonNegative = Annotated[float, Field(ge=0.0)]
Ratio = Annotated[float, Field(ge=0.0, le=1.0)]
Index = Annotated[int, Field(ge=0)]


class Workload(Model):
    """The load every GPU carries, steady or as a job loop."""

    utilization: Ratio = 0.9
    power_watts: NonNegative = 560.0
    temperature_celsius: NonNegative = 62.0
    memory_temperature_celsius: NonNegative = 58.0
    period_seconds: Offset = 0.0  # 0: steady load; else a job loop with an idle phase each period
    idle_fraction: Ratio = 0.0


class Process(Model):
    """A compute process NVML lists on its GPUs."""

    pid: Annotated[int, Field(ge=1)]
    gpus: list[Index]
    memory_bytes: Index = 8 << 30


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


class FaultEntry(Model):
    """One ``faults:`` entry. Which of the optional keys a kind takes is ``_KIND_KEYS``'s, checked by
    ``ScenarioFile.cross_check``; ``precursor`` is for faults, ``duration`` for noise."""

    kind: Annotated[str, OneOf(tuple(_KIND_KEYS))]
    gpu: Index | None = None  # the GPU; node-wide kinds take ``gpus`` (default: all)
    gpus: list[Index] | None = None
    start: Offset = 0.0
    precursor: Offset | None = None  # the kind's default when absent
    duration: Offset | None = None
    xid: int | None = None
    link: Index | None = None
    count: Index | None = None
    delta_celsius: float | None = None
    watts: NonNegative | None = None
    nic: Index | None = None  # the NIC (mlx5_<nic>) of an InfiniBand kind
    rate_gbps: Annotated[float, Field(gt=0)] | None = None

    def build(self, gpus: int) -> Fault:
        default, extra = _KIND_KEYS[self.kind]
        length = self.duration if self.kind in NOISE_KINDS else self.precursor
        if self.kind in _NODE_WIDE:
            indices = tuple(range(gpus)) if self.gpus is None else tuple(self.gpus)
        elif self.kind in FABRIC_KINDS:
            indices = ()  # the node's fabric, not a GPU
        else:
            indices = (self.gpu or 0,)
        given = {key: (cast, getattr(self, key)) for key, cast in extra.items()}
        params = {key: cast(value) for key, (cast, value) in given.items() if value is not None}
        return Fault(self.kind, indices, self.start, default if length is None else length, params)


@dataclass(frozen=True)
class Scenario:
    gpus: int = 8
    model: str = "NVIDIA H100 80GB HBM3"
    nvlinks: int = 18
    driver_version: str = "550.54.15"
    seed: int = 0
    nics: int | None = None  # InfiniBand NICs; None: the hardware profile's
    workload: Workload = field(default_factory=Workload)
    processes: tuple[Process, ...] = ()
    faults: tuple[Fault, ...] = ()


class ScenarioFile(Model):
    """A simulator scenario as written; times are seconds from exporter start (or a duration)."""

    gpus: Annotated[int, Field(ge=1)] = 8
    model: str = "NVIDIA H100 80GB HBM3"
    nvlinks: Index = 18
    driver_version: str = "550.54.15"
    seed: Index = 0
    nics: Index | None = None  # InfiniBand NICs (default: 8 on h100-sxm and h200, 4 on b200 and gb200)
    workload: Workload = Workload()
    processes: list[Process] = Field(default_factory=list)
    faults: list[FaultEntry] = Field(default_factory=list)

    @classmethod
    def cross_check(cls, data: dict[str, Any]) -> list[tuple[Location, str]]:
        gpus = data.get("gpus", 8)
        gpus = gpus if isinstance(gpus, int) and not isinstance(gpus, bool) and gpus >= 1 else 8
        nvlinks = data.get("nvlinks", 18)
        nvlinks = nvlinks if isinstance(nvlinks, int) and not isinstance(nvlinks, bool) else 18
        nics = data.get("nics")
        nics = nics if isinstance(nics, int) and not isinstance(nics, bool) else None
        found: list[tuple[Location, str]] = []
        for i, raw in _entries(data.get("processes")):
            found += [(("processes", i, *loc), text) for loc, text in _gpu_problems(raw, "gpus", gpus)]
        for i, raw in _entries(data.get("faults")):
            found += [(("faults", i, *loc), text) for loc, text in _fault_problems(raw, gpus, nvlinks, nics)]
        return found


def _entries(value: Any) -> list[tuple[int, dict[str, Any]]]:
    items = value if isinstance(value, list) else []
    return [(i, raw) for i, raw in enumerate(items) if isinstance(raw, dict)]


def _gpu_problems(raw: dict[str, Any], key: str, gpus: int) -> list[tuple[Location, str]]:
    """GPU indices beyond the scenario's GPUs (the field checks refuse the rest)."""
    value = raw.get(key)
    indices = value if isinstance(value, list) else [value]
    where: list[Location] = [(key, i) for i in range(len(indices))] if isinstance(value, list) else [(key,)]
    return [(loc, f"GPU {g} does not exist (the scenario has {gpus})")
            for loc, g in zip(where, indices, strict=True)
            if isinstance(g, int) and not isinstance(g, bool) and g >= gpus]


def _fault_problems(raw: dict[str, Any], gpus: int, nvlinks: int, nics: int | None
                    ) -> list[tuple[Location, str]]:
    """The keys a kind takes, its GPU or NIC, its XID and its link."""
    kind = raw.get("kind")
    if not isinstance(kind, str) or kind not in _KIND_KEYS:
        return []
    extra = _KIND_KEYS[kind][1]
    length = "duration" if kind in NOISE_KINDS else "precursor"
    allowed = {"kind", "start", length, *extra} | ({"gpus"} if kind in _NODE_WIDE else set()) | \
        ({"gpu"} if kind not in FABRIC_KINDS else set())
    found: list[tuple[Location, str]] = [
        ((key,), f"unknown key for {kind} (known: {', '.join(sorted(allowed))})") for key in raw
        if key not in allowed and key in FaultEntry.model_fields]
    if kind not in _NODE_WIDE and kind not in FABRIC_KINDS and "gpu" not in raw:
        found.append((("gpu",), f"{kind} needs 'gpu'"))
    if kind in _NIC_KINDS:
        nic = raw.get("nic")
        if "nic" not in raw:
            found.append((("nic",), f"{kind} needs 'nic'"))
        elif nics is not None and isinstance(nic, int) and nic >= nics:
            found.append((("nic",), f"NIC {nic} does not exist (the scenario has {nics})"))
    found += _gpu_problems(raw, "gpus" if kind in _NODE_WIDE else "gpu", gpus)
    xid = raw.get("xid")
    if kind == "hbm_degradation" and xid is not None and xid not in HBM_XIDS:
        found.append((("xid",), f"hbm_degradation ends in one of {HBM_XIDS}"))
    if kind == "app_xid" and xid is not None and xid not in APP_XIDS:
        found.append((("xid",), f"app_xid logs one of {APP_XIDS}"))
    link = raw.get("link")
    if isinstance(link, int) and "link" in extra and link >= max(nvlinks, 1):
        found.append((("link",), f"link {link} does not exist (the scenario has {nvlinks})"))
    return found


def parse_scenario(data: Any, source: str = "scenario") -> Scenario:
    """Validate a decoded scenario document; raise ``ScenarioError`` listing every problem."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ScenarioError(source, ["the document must be a mapping"])
    try:
        spec = ScenarioFile.model_validate(data)
    except ValidationError as exc:
        raise ScenarioError(source, problems(exc)) from None
    return Scenario(gpus=spec.gpus, model=spec.model, nvlinks=spec.nvlinks,
                    driver_version=spec.driver_version, seed=spec.seed, nics=spec.nics,
                    workload=spec.workload, processes=tuple(spec.processes),
                    faults=tuple(entry.build(spec.gpus) for entry in spec.faults))


def load_scenario(path: Path | None) -> Scenario:
    """Read a scenario file; None gives the default node (8 healthy H100s, 18 NVLinks each)."""
    if path is None:
        return Scenario()
    try:
        data = parse_yaml(read_text(path))
    except OSError as exc:
        raise ScenarioError(str(path), [f"cannot read: {exc.strerror}"]) from None
    except yaml.YAMLError as exc:
        raise ScenarioError(str(path), [f"not valid YAML: {exc}"]) from None
    return parse_scenario(data, str(path))


def after_reset(data: dict[str, Any], gpu: int) -> dict[str, Any]:
    """A scenario document as a reset of ``gpu`` leaves the node: what the reset ends on that GPU
    (``RESET_ENDS_KINDS``) is taken out, every other fault and setting kept as written."""
    faults = [entry for entry in data.get("faults") or []
              if not (entry.get("kind") in RESET_ENDS_KINDS and entry.get("gpu") == gpu)]
    return {**data, "faults": faults}
