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
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    PlainValidator,
    ValidationError,
    WithJsonSchema,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import PydanticCustomError, core_schema
from pydantic_core.core_schema import CoreSchema

from gpuhealth.contract.duration import Offset, PositiveSeconds, Seconds
from gpuhealth.contract.duration import parse_duration as prometheus_duration

# The fault vocabulary (kinds, their XIDs) is docs/contract.md's, shared with the exporter's simulator.
from gpuhealth.contract.faults import (
    FAULT_KINDS,
    FAULT_XIDS,
    NOISE_KINDS,
    PORT_KINDS,
    SUDDEN_KINDS,
)
from gpuhealth.contract.files import parse_yaml, read_text
from gpuhealth.contract.validation import Location, Model, OneOf, problems

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
    # Llama 3's "network" 8.4 %, split between the fabric kinds by assumption (drawn only where listed)
    "ib_link_flap": 3.0,
    "ib_symbol_errors": 2.4,
    "ib_rate_downgrade": 1.0,
    "nvswitch_fatal": 2.0,
}
# Every fault and noise kind a scenario may name: the shared vocabulary and the fabric kinds.
NO_XID = (0,)  # Failure.xid of a fabric fault: it logs no XID
# Benign kinds about one GPU; ``GPU_OPTIONAL`` may name one GPU or leave the choice to the draw.
GPU_NOISE = (
    "ib_boot_flap",
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
    "ib_boot_flap": (60, 60),
    "switch_reboot": (300, 1200),  # a leaf switch's reboot: 5 to 20 minutes
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


Count = Annotated[int, Field(ge=0)]
AtLeastOne = Annotated[int, Field(ge=1)]
Share = Annotated[float, Field(ge=0.0, le=1.0)]


def _ordered(pair: list[Any]) -> list[Any]:
    """``[low, high]``: low first."""
    if pair[0] > pair[1]:
        raise ValueError(f"low {pair[0]:g} is above high {pair[1]:g}")
    return pair


Pair = Field(min_length=2, max_length=2)
SecondsRange = Annotated[list[PositiveSeconds], Pair, AfterValidator(_ordered)]


def _node_name(value: str) -> str:
    try:
        value.format(index=0)
    except (KeyError, IndexError, ValueError):
        raise ValueError(f"{value!r} must be a format string using {{index}}") from None
    return value


def _whole_step(value: float) -> float:
    if value < 1 or value != int(value):
        raise ValueError(f"must be a whole number of seconds >= 1, got {value:g}s")
    return value


def _start(value: Any) -> float:
    """An RFC 3339 time (YAML reads an unquoted one as a datetime), as unix seconds; UTC if unzoned."""
    try:
        text = str(value).replace("Z", "+00:00")
        parsed = value if isinstance(value, datetime) else datetime.fromisoformat(text)
    except ValueError:
        raise PydanticCustomError("start", "{value} is not an RFC 3339 time (e.g. 2026-01-05T00:00:00Z)",
                                  {"value": repr(value)}) from None
    return (parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)).timestamp()


class Shares:
    """Field metadata: ``{name: share}`` (a list: equal shares) over a vocabulary, not all zero."""

    def __init__(self, options: tuple[str, ...]) -> None:
        self.options = options

    def validate(self, value: Any) -> dict[str, float]:
        if isinstance(value, list):
            value = dict.fromkeys(value, 1.0)
        if not isinstance(value, dict) or not value:
            raise PydanticCustomError("shares", "expected a list or a mapping of name: share")
        bad = [f"unknown name {name!r} (known: {', '.join(self.options)})" for name in value
               if name not in self.options]
        bad += [f"{name}: expected a share >= 0, got {share!r}" for name, share in value.items()
                if isinstance(share, bool) or not isinstance(share, int | float) or share < 0]
        if not bad and not sum(value.values()):
            bad.append("every share is 0")
        if bad:
            raise PydanticCustomError("shares", "{problems}", {"problems": "; ".join(bad)})
        return {name: float(share) for name, share in value.items()}

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        return core_schema.no_info_plain_validator_function(self.validate)

    def __get_pydantic_json_schema__(self, schema: CoreSchema,
                                     handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        names = {"type": "string", "enum": list(self.options)}
        return {"anyOf": [{"type": "array", "items": names, "minItems": 1},
                          {"type": "object", "propertyNames": names, "minProperties": 1,
                           "additionalProperties": {"type": "number", "minimum": 0}}]}


FaultKind = Annotated[str, OneOf(FAULT_KINDS)]
Start = Annotated[float, PlainValidator(_start), WithJsonSchema({"type": "string", "format": "date-time"})]
NoiseKind = Annotated[str, OneOf(NOISE_KINDS)]


class Fleet(Model):
    """The simulated cluster."""

    nodes: AtLeastOne
    gpus_per_node: AtLeastOne = 8
    model: str = "NVIDIA H100 80GB HBM3"
    nvlinks: Count = 18
    node_name: Annotated[str, AfterValidator(_node_name)] = "gpu-{index:03d}"
    rack_nodes: AtLeastOne = 4  # nodes sharing a rack's power and cooling (and a leaf switch)
    nics_per_node: Count = 0  # InfiniBand ports, NIC i beside GPU i; 0: no fabric series (nics.py)
    switch_names: bool = True  # the inventory names each port's leaf switch (false: switch="")
    # InfiniBand, or Ethernet: RoCE ports, each with its netdev (carrier changes, speed, operstate)
    nic_link_layer: Literal["InfiniBand", "Ethernet"] = "InfiniBand"

    def node(self, index: int) -> str:
        return self.node_name.format(index=index)

    @property
    def node_names(self) -> list[str]:
        return [self.node(i) for i in range(self.nodes)]


class WorkloadSpec(Model):
    """The ``workload:`` section: job sizes and lengths, gaps between jobs, checkpoints."""

    job_nodes: Annotated[list[AtLeastOne], Pair, AfterValidator(_ordered)] = [1, 4]  # noqa: RUF012
    job_duration: SecondsRange = [7200.0, 43200.0]  # noqa: RUF012
    idle_gap: SecondsRange = [300.0, 3600.0]  # noqa: RUF012
    checkpoint_every: PositiveSeconds = 3600.0
    checkpoint_duration: PositiveSeconds = 240.0


class FailureSpec(Model):
    """One listed failure; the checks that need the fleet or the kind are ``_failure_problems``."""

    node: str
    gpu: Count
    kind: FaultKind
    onset: Offset | None = None  # required unless the kind (or shape none) has no precursor
    failure: PositiveSeconds
    xid: int | None = None  # the kind's first XID by default
    strength: Share = 0.7
    shape: Annotated[str, OneOf(PRECURSOR_SHAPES)] = "ramp"
    first_xid: Offset | None = None
    repaired: PositiveSeconds | None = None


class NoiseSpec(Model):
    """One listed benign event; without ``duration`` it lasts the middle of its kind's range."""

    node: str
    gpu: Count | None = None
    kind: NoiseKind
    at: Offset
    duration: PositiveSeconds | None = None
    strength: Share = 0.7


class Lemons(Model):
    nodes: Count = 0  # nodes drawn as lemons
    weight: Annotated[float, Field(ge=1.0, le=1000.0)] = 10.0  # how much likelier a lemon is to fail


class RandomFailures(Model):
    count: Count = 0
    kinds: Annotated[list[FaultKind], Field(min_length=1)] = list(FAULT_KINDS)  # noqa: RUF012
    mix: Literal["equal", "field"] = "equal"
    precursor: SecondsRange = list(DEFAULT_PRECURSOR)  # noqa: RUF012
    shapes: Annotated[dict[str, float], Shares(PRECURSOR_SHAPES)] = {"ramp": 1.0}  # noqa: RUF012
    strength: Annotated[list[Annotated[float, Field(gt=0.0, le=1.0)]], Pair, AfterValidator(_ordered)] = [  # noqa: RUF012
        0.25, 1.0]
    lemons: Lemons = Lemons()
    early_xid: Share = 0.0  # share of HBM/NVLink failures that log an XID before the GPU dies


class RandomNoise(Model):
    count: Count = 0
    kinds: Annotated[dict[str, float], Shares(NOISE_KINDS)] = Field(
        default_factory=lambda: dict.fromkeys(NOISE_KINDS, 1.0))


class RandomSpec(Model):
    failures: RandomFailures = RandomFailures()
    noise: RandomNoise = RandomNoise()


class ScenarioFile(Model):
    """A scenario file as written (format in ``bench/scenarios/README.md``); ``parse_scenario``
    expands it into a ``Scenario``."""

    name: str | None = None  # the file's stem by default
    seed: Count = 1
    start: Start = Field(default="2026-01-05T00:00:00Z", validate_default=True)
    duration: PositiveSeconds
    warmup: Offset = 6 * 3600.0  # history before start, so that long rule windows are filled
    step: Annotated[float, Seconds(), AfterValidator(_whole_step)] = 60.0
    fused_step: PositiveSeconds | None = None
    min_lead: Offset = DEFAULT_MIN_LEAD
    field_rate: Annotated[float, Field(ge=1e-6, le=1000.0)] = DEFAULT_FIELD_RATE
    lemon_window: PositiveSeconds = DEFAULT_LEMON_WINDOW
    repair: SecondsRange | None = None  # draws a repair delay for failures that do not give one
    fleet: Fleet
    workload: WorkloadSpec = WorkloadSpec()
    failures: list[FailureSpec] = Field(default_factory=list)
    noise: list[NoiseSpec] = Field(default_factory=list)
    random: RandomSpec = RandomSpec()

    @classmethod
    def cross_check(cls, data: dict[str, Any]) -> list[tuple[Location, str]]:
        return _cross_problems(data)


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


def load_scenario(path: Path, seed: int | None = None) -> Scenario:
    """Read, validate and expand a scenario file; ``seed`` overrides the file's seed."""
    path = Path(path)
    try:
        data = parse_yaml(read_text(path))
    except OSError as exc:
        raise ScenarioError(str(path), [f"cannot read: {exc.strerror}"]) from None
    except yaml.YAMLError as exc:
        raise ScenarioError(str(path), [f"not valid YAML: {exc}"]) from None
    return parse_scenario(data, str(path), seed=seed)


def parse_scenario(data: Any, source: str = "scenario", seed: int | None = None) -> Scenario:
    """Validate a scenario (every problem at once, as ``ScenarioError``) and expand its random draws;
    ``seed`` overrides the file's seed."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ScenarioError(source, [f"scenario: expected a mapping, got {type(data).__name__}"])
    try:
        spec = ScenarioFile.model_validate(data)
    except ValidationError as exc:
        raise ScenarioError(source, problems(exc, "scenario")) from None
    seed = spec.seed if seed is None else seed
    fleet, duration = spec.fleet, spec.duration
    failures = [_failure(item) for item in spec.failures]
    noise = [_noise(item) for item in spec.noise]
    rng = random.Random(seed)
    repair = None if spec.repair is None else _pair(spec.repair)
    if repair is not None:
        failures = [_repaired(f, rng, repair) for f in failures]
    found: list[str] = []
    failures += _random_failures(found, spec.random.failures, rng, fleet, duration, failures, repair)
    noise += _random_noise(spec.random.noise, rng, fleet, duration)
    found += _overlaps(failures)
    if found:
        raise ScenarioError(source, found)
    work = spec.workload
    return Scenario(
        name=spec.name if spec.name is not None else Path(source).stem,
        seed=seed,
        start=spec.start,
        duration=duration,
        warmup=spec.warmup,
        step=spec.step,
        fused_step=spec.fused_step,
        fleet=fleet,
        workload=Workload(_pair(work.job_nodes), _pair(work.job_duration), _pair(work.idle_gap),
                          work.checkpoint_every, work.checkpoint_duration),
        failures=tuple(failures),
        noise=tuple(noise),
        min_lead=spec.min_lead,
        field_rate=spec.field_rate,
        lemon_window=spec.lemon_window,
    )


def _pair(pair: list[Any]) -> tuple[Any, Any]:
    return pair[0], pair[1]


def _failure(item: FailureSpec) -> Failure:
    sudden = item.kind in SUDDEN_KINDS or item.shape == "none"
    onset = item.failure if sudden or item.onset is None else item.onset
    xid = FAULT_XIDS.get(item.kind, NO_XID)[0] if item.xid is None else item.xid
    shape = "none" if item.kind in SUDDEN_KINDS else item.shape
    return Failure(item.node, item.gpu, item.kind, onset, item.failure, xid, item.strength, shape,
                   item.first_xid, item.repaired)


def _noise(item: NoiseSpec) -> Noise:
    low, high = NOISE_DURATIONS[item.kind]
    length = (low + high) / 2 if item.duration is None else item.duration
    return Noise(item.node, item.kind, item.at, length, item.strength, item.gpu)


def _read(marker: Any, value: Any) -> Any:
    """``value`` as the field's validator reads it, or None when it is invalid (already reported)."""
    try:
        return marker.validate(value)
    except PydanticCustomError:
        return None


def _count(value: Any, minimum: int) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= minimum else None


def _cross_problems(data: dict[str, Any]) -> list[tuple[Location, str]]:
    """The rules that tie a failure or a noise event to the fleet, the duration and its kind. They
    read the raw file and skip a value the field checks refuse, so that every problem is listed once."""
    raw_fleet: dict[str, Any] = data["fleet"] if isinstance(data.get("fleet"), dict) else {}
    nodes = _count(raw_fleet.get("nodes"), 1) or 1
    gpus = _count(raw_fleet.get("gpus_per_node", 8), 1) or 1
    nics = _count(raw_fleet.get("nics_per_node", 0), 0) or 0
    name = raw_fleet.get("node_name", "gpu-{index:03d}")
    try:
        name = _node_name(name)
    except (ValueError, AttributeError):
        name = "gpu-{index:03d}"
    fleet = Fleet.model_construct(nodes=nodes, gpus_per_node=gpus, nics_per_node=nics, node_name=name)
    duration = _read(Seconds(), data.get("duration"))
    found: list[tuple[Location, str]] = []
    for section, check in (("failures", _failure_problems), ("noise", _noise_problems)):
        items = data.get(section)
        for i, item in enumerate(items if isinstance(items, list) else []):
            if isinstance(item, dict):
                found += [((section, i, *loc), message) for loc, message in check(item, fleet, duration)]
    drawn = data["random"].get("failures") if isinstance(data.get("random"), dict) else None
    if isinstance(drawn, dict):
        where = ("random", "failures")
        precursor = drawn.get("precursor", list(DEFAULT_PRECURSOR))
        high = _read(Seconds(), precursor[1]) if isinstance(precursor, list) and len(precursor) == 2 else None
        if duration is not None and high is not None and high + 1800 >= duration:
            found.append(((*where, "precursor"), "the longest precursor does not fit in the duration"))
        kinds: list[Any] = drawn["kinds"] if isinstance(drawn.get("kinds"), list) else []
        if not nics and set(kinds) & set(PORT_KINDS):
            found.append(((*where, "kinds"), "port kinds need NICs: set fleet.nics_per_node"))
        lemons = drawn.get("lemons")
        count = _count(lemons.get("nodes"), 0) if isinstance(lemons, dict) else None
        if count is not None and count > nodes:
            found.append(((*where, "lemons", "nodes"), f"{count} exceeds the fleet's {nodes}"))
    noise = data["random"].get("noise") if isinstance(data.get("random"), dict) else None
    shares: dict[str, Any] = {}
    if isinstance(noise, dict) and isinstance(noise.get("kinds"), dict):
        shares = noise["kinds"]
    if not nics and any(shares.get(k) for k in (*PORT_KINDS, "switch_reboot")):
        found.append((("random", "noise", "kinds"), "port kinds need NICs: set fleet.nics_per_node"))
    return found


def _location_problems(item: dict[str, Any], fleet: Fleet, gpu_required: bool) -> list[tuple[Location, str]]:
    found: list[tuple[Location, str]] = []
    if isinstance(item.get("node"), str) and item["node"] not in fleet.node_names:
        found.append((("node",), f"{item['node']!r} is not a node of the fleet "
                                 f"({fleet.node(0)} .. {fleet.node(fleet.nodes - 1)})"))
    gpu = _count(item.get("gpu"), 0)
    if gpu is not None and gpu >= fleet.gpus_per_node:
        found.append((("gpu",), f"expected a GPU index 0..{fleet.gpus_per_node - 1}, got {gpu!r}"))
    elif gpu_required and item.get("gpu") is None:
        found.append((("gpu",), f"{item.get('kind')} is about one GPU; give gpu"))
    return found


def _failure_problems(
    item: dict[str, Any], fleet: Fleet, duration: float | None
) -> list[tuple[Location, str]]:
    found = _location_problems(item, fleet, gpu_required=False)
    kind = item.get("kind") if item.get("kind") in FAULT_KINDS else None
    if kind is None:
        return found
    found += _port_problems(item, fleet)
    sudden = kind in SUDDEN_KINDS or item.get("shape") == "none"
    failure = _read(Seconds(), item.get("failure"))
    onset = _read(Seconds(positive=False), item.get("onset")) if "onset" in item else None
    if sudden and "onset" in item:
        what = kind if kind in SUDDEN_KINDS else f"{kind} with shape none"
        found.append((("onset",), f"{what} has no precursor; leave onset out"))
    elif not sudden and "onset" not in item:
        found.append((("onset",), "required"))
    if sudden:
        onset = failure
    first_xid = _read(Seconds(positive=False), item.get("first_xid")) if "first_xid" in item else None
    if (first_xid is not None and onset is not None and failure is not None
            and not onset <= first_xid <= failure):
        found.append((("first_xid",), "must lie between onset and failure"))
    if onset is not None and failure is not None and onset > failure:
        found.append(((), f"onset {item.get('onset')} is after failure {item.get('failure')}"))
    if failure is not None and duration is not None and failure >= duration:
        found.append((("failure",), f"{item.get('failure')} is not within the scenario duration"))
    repaired = _read(Seconds(), item.get("repaired")) if "repaired" in item else None
    if repaired is not None and failure is not None and repaired <= failure + HANG_MAX:
        found.append((("repaired",), "must be more than 30m after the failure"))
    if kind not in FAULT_XIDS:
        if "xid" in item:
            found.append((("xid",), f"{kind} logs no XID; leave xid out"))
        return found
    xid = item.get("xid", FAULT_XIDS[kind][0])
    if _count(xid, 0) is not None and xid not in FAULT_XIDS[kind]:
        found.append((("xid",), f"{xid!r} is not an XID of {kind} ({', '.join(map(str, FAULT_XIDS[kind]))})"))
    return found


def _port_problems(item: dict[str, Any], fleet: Fleet) -> list[tuple[Location, str]]:
    """A port event needs NICs, and its ``gpu`` names the GPU whose rail NIC it is."""
    if item.get("kind") not in PORT_KINDS and item.get("kind") != "switch_reboot":
        return []
    if not fleet.nics_per_node:
        return [(("kind",), f"{item['kind']} needs NICs: set fleet.nics_per_node")]
    gpu = _count(item.get("gpu"), 0)
    if item.get("kind") in PORT_KINDS and gpu is not None and gpu >= fleet.nics_per_node:
        return [(("gpu",), f"names the port of NIC {gpu}; the fleet has {fleet.nics_per_node} NICs per node")]
    return []


def _noise_problems(
    item: dict[str, Any], fleet: Fleet, duration: float | None
) -> list[tuple[Location, str]]:
    kind = item.get("kind") if item.get("kind") in NOISE_KINDS else None
    found = _location_problems(item, fleet, gpu_required=kind in GPU_NOISE) + _port_problems(item, fleet)
    if kind is not None and item.get("gpu") is not None and kind not in GPU_NOISE + GPU_OPTIONAL_NOISE:
        found.append((("gpu",), f"{kind} is node-wide; leave gpu out"))
    at = _read(Seconds(positive=False), item.get("at"))
    if at is not None and duration is not None and at >= duration:
        found.append((("at",), f"{item.get('at')} is not within the scenario duration"))
    return found


def _loguniform(rng: random.Random, low: float, high: float) -> float:
    return math.exp(rng.uniform(math.log(low), math.log(high))) if low > 0 else rng.uniform(low, high)


def _repaired(failure: Failure, rng: random.Random, repair: tuple[float, float]) -> Failure:
    """A listed failure without ``repaired`` gets a drawn repair delay when the scenario has ``repair``."""
    if failure.repaired is not None:
        return failure
    return replace(failure, repaired=round(failure.failure + HANG_MAX + _loguniform(rng, *repair)))


def _busy(failures: list[Failure]) -> dict[str, list[tuple[float, float]]]:
    """Per node, the spans a failure holds it: from precursor onset until it is back in service."""
    spans: dict[str, list[tuple[float, float]]] = {}
    for f in failures:
        end = math.inf if f.repaired is None else f.repaired
        spans.setdefault(f.node, []).append((f.onset, end))
    return spans


def _random_failures(
    found: list[str],
    section: RandomFailures,
    rng: random.Random,
    fleet: Fleet,
    duration: float,
    fixed: list[Failure],
    repair: tuple[float, float] | None,
) -> list[Failure]:
    """Draw failures where their node is in service for the whole precursor. Without ``mix: field``
    kinds are taken in turn so that every listed kind occurs; with it they are drawn in field shares.
    A problem (no room left) is added to ``found``."""
    count, kinds, mix, shapes = section.count, section.kinds, section.mix, section.shapes
    if not count:
        return []
    low, high = section.precursor
    strength, early = section.strength, section.early_xid
    lemon_count, lemon_weight = section.lemons.nodes, section.lemons.weight
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
            found.append(
                f"scenario.random.failures.count: no room left for {count} failures (nodes stay out of "
                "service from precursor onset until repaired; give repair, fewer failures or a longer "
                "duration)"
            )
            return []
        first = None
        if early and lead and kind in ("hbm_degradation", "nvlink_errors") and rng.random() < early:
            first = round(hard - rng.uniform(0.02, 0.3) * lead)  # an XID logged before the GPU dies
        spans.setdefault(node, []).append((hard - lead, end))
        drawn.append(
            Failure(
                node,
                rng.randrange(fleet.nics_per_node if kind in PORT_KINDS else fleet.gpus_per_node),
                kind,
                round(hard - lead),
                round(hard),
                rng.choice(FAULT_XIDS.get(kind, NO_XID)),
                round(_loguniform(rng, *strength), 2),
                shape,
                first,
                None if back is None else round(back),
            )
        )
    return drawn


def _random_noise(section: RandomNoise, rng: random.Random, fleet: Fleet, duration: float) -> list[Noise]:
    """Benign events in the listed kinds' shares (every listed kind at least once), durations drawn
    log-uniformly from the kind's range."""
    count, shares = section.count, section.kinds
    if not count:
        return []
    kinds = _apportion(shares, count)
    drawn = []
    for kind in kinds:
        low, high = NOISE_DURATIONS[kind]
        length = min(_loguniform(rng, low, high), duration)
        gpus = fleet.nics_per_node if kind in PORT_KINDS else fleet.gpus_per_node
        gpu = rng.randrange(gpus) if kind in GPU_NOISE else None
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


def _overlaps(failures: list[Failure]) -> list[str]:
    """A node is out of service from a failure's precursor onset until its repair (for ever without
    one), so another failure on it must lie outside that span."""
    found = []
    seen: dict[str, list[tuple[int, float, float]]] = {}
    for i, failure in enumerate(failures):
        end = math.inf if failure.repaired is None else failure.repaired
        for j, a, b in seen.get(failure.node, []):
            if not (end <= a or failure.onset >= b):
                found.append(
                    f"scenario.failures[{i}]: {failure.node} is out of service then because of failures[{j}] "
                    "(until repaired; give `repaired` or `repair` to let a node fail again)"
                )
        seen.setdefault(failure.node, []).append((i, failure.onset, end))
    return found
