"""Load the rule catalogue, merge a site's partial catalogue over it, and check it.

Every problem is collected before reporting, so one run of the generator lists them all instead of
making the operator fix a file one error at a time.
"""

from __future__ import annotations

import copy
import csv
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

import yaml
from gpuhealth.contract.duration import parse_duration
from gpuhealth.rules import catalogue_schema
from gpuhealth.rules.catalogue_schema import (  # noqa: F401  (the catalogue's vocabulary, re-exported)
    ACTIONS,
    GPU_SHARDS,
    GROUPS,
    NVLINK_CLASS,
    RECOVERY_ACTIONS,
    SEVERITIES,
    XID_CLASSES,
)

BUILTIN = Path(__file__).with_name("catalogue.yaml")
XID_TABLE = Path(__file__).with_name("xid_catalogue.csv")
TIERS = ("single", "shard", "global")  # single: one Prometheus runs every group
# What a shard remote-writes to the global tier (a regex on __name__): its recorded series and its
# alerts; raw exporter series stay in the shard, so the global tier holds a few series per GPU.
REMOTE_WRITE_SERIES = "gpuhealth:.+|ALERTS"
MIN_SAMPLES_PER_WINDOW = 4


class CatalogueError(Exception):
    """The catalogue cannot be rendered; ``errors`` lists every problem found."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("\n".join(errors))
        self.errors = errors


@dataclass(frozen=True)
class Catalogue:
    defaults: dict[str, Any]
    alerts: dict[str, dict[str, Any]]
    tiers: dict[str, str]

    def groups(self, tier: str = "single") -> tuple[str, ...]:
        """The rule files ``tier`` evaluates, in render order."""
        return tuple(name for name in GROUPS if tier == "single" or self.tiers[name] == tier)

    def xid_classes(self) -> dict[str, list[int]]:
        """XIDs per action class (and ``none``): each table XID by its bucket, then the overrides."""
        return xid_classes(self.defaults["xid"])


@functools.cache
def xid_table() -> dict[int, str]:
    """NVIDIA's XID catalogue as vendored in rules/xid_catalogue.csv: XID -> resolution bucket."""
    lines = [line for line in XID_TABLE.read_text().splitlines() if not line.startswith("#")]
    return {int(row["xid"]): row["resolution"] for row in csv.DictReader(lines)}


def xid_classes(xid: dict[str, Any]) -> dict[str, list[int]]:
    by_xid = {number: xid["buckets"].get(bucket) for number, bucket in xid_table().items()}
    for klass, xids in xid["overrides"].items():
        by_xid.update(dict.fromkeys(xids, klass))
    classes: dict[str, list[int]] = {klass: [] for klass in (*XID_CLASSES, NVLINK_CLASS, "none")}
    for number, klass in sorted(by_xid.items()):
        if klass in classes:
            classes[klass].append(number)
    return classes


def merge(base: Any, overlay: Any, path: str, errors: list[str]) -> Any:
    """``overlay`` over ``base``: mappings merge by key, anything else replaces; unknown keys are errors."""
    if not isinstance(base, dict):
        return copy.deepcopy(overlay)
    if not isinstance(overlay, dict):
        errors.append(f"{path}: expected a mapping, got {type(overlay).__name__}")
        return copy.deepcopy(base)
    merged = copy.deepcopy(base)
    for key, value in overlay.items():
        where = f"{path}.{key}" if path else str(key)
        if key not in base:
            errors.append(f"{where}: unknown key (not in the built-in catalogue)")
            continue
        merged[key] = merge(base[key], value, where, errors)
    return merged


def _read_yaml(path: Path, errors: list[str]) -> dict[str, Any]:
    try:
        data = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except OSError as exc:
        errors.append(f"{path}: cannot read: {exc.strerror}")
        return {}
    except yaml.YAMLError as exc:
        errors.append(f"{path}: not valid YAML: {exc}")
        return {}
    if not isinstance(data, dict):
        errors.append(f"{path}: expected a mapping at the top level")
        return {}
    return data


def load(overlay: Path | None = None) -> Catalogue:
    """The built-in catalogue, with the file ``overlay`` merged over it, checked; raises CatalogueError."""
    errors: list[str] = []
    data = _read_yaml(Path(overlay), errors) if overlay is not None else {}
    if errors:
        raise CatalogueError(errors)
    return resolve(data)


def resolve(overlay: dict[str, Any]) -> Catalogue:
    """The built-in catalogue with ``overlay`` (parsed YAML) merged over it, checked."""
    errors: list[str] = []
    data = merge(_read_yaml(BUILTIN, errors), overlay, "", errors)
    errors.extend(check(data))
    if errors:
        raise CatalogueError(errors)
    return Catalogue(defaults=data["defaults"], alerts=data["alerts"], tiers=data["tiers"])


def _leaves(node: Any, path: str):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaves(value, f"{path}.{key}")
    else:
        yield path, node


@functools.cache
def schema() -> dict[str, Any]:
    """The JSON Schema of a merged catalogue (``rules/catalogue_schema.py``), from the built-in one."""
    return catalogue_schema.build(_read_yaml(BUILTIN, []))


def check(data: dict[str, Any]) -> list[str]:
    """Every problem with a merged catalogue, as ``path: message`` lines: the schema's, then the rules
    that tie knobs together (each skips a value the schema refused)."""
    errors = list(catalogue_schema.problems(data, schema()))
    _check_tiers(data.get("tiers"), errors)
    d, alerts = data.get("defaults"), data.get("alerts")
    if not isinstance(d, dict) or not isinstance(alerts, dict):
        return errors
    _check_ramps(d, errors)
    _check_windows(d, _seconds(d.get("scrape_interval")) or 15, errors)
    _check_fusion(d, errors)
    _check_xid(d.get("xid") or {}, errors)
    durations: dict[str, Any] = d["for"] if isinstance(d.get("for"), dict) else {}
    errors.extend(f"defaults.for: no entry for alert {name}" for name in alerts if name not in durations)
    errors.extend(f"defaults.for.{name}: no such alert" for name in durations if name not in alerts)
    return errors


def _number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_tiers(tiers: Any, errors: list[str]) -> None:
    if not isinstance(tiers, dict):
        errors.append(f"tiers: must map each rule file to shard or global, got {tiers!r}")
        return
    for name in GROUPS:
        if tiers.get(name) not in TIERS[1:]:
            errors.append(f"tiers.{name}: must be shard or global, got {tiers.get(name)!r}")


def _seconds(value: Any) -> float | None:
    try:
        return parse_duration(value)
    except ValueError:
        return None


def _check_windows(d: dict[str, Any], scrape: float, errors: list[str]) -> None:
    """Range windows need several samples; subquery windows must hold whole steps."""
    minimum = MIN_SAMPLES_PER_WINDOW * scrape
    for section in ("xid", "definitive", "fabric", "evidence", "lemon", "storage"):
        for path, value in _leaves(d.get(section, {}), f"defaults.{section}"):
            key = path.rsplit(".", 1)[1]
            if not key.endswith(("window", "step")):
                continue
            length = _seconds(value)
            if length is not None and length < minimum:
                errors.append(f"{path}: {value} holds fewer than {MIN_SAMPLES_PER_WINDOW} samples at "
                              f"scrape_interval {d.get('scrape_interval')}; use at least {minimum}s")
    for path in ("evidence.ecc_corrected_growth", "evidence.pcie_replay", "lemon",
                 "definitive.repeated_gpus_missing"):
        block = d
        for part in path.split("."):
            block = block.get(part, {}) if isinstance(block, dict) else {}
        window, step = _seconds(block.get("window")), _seconds(block.get("step"))
        if window is None or step is None:
            continue
        if step == 0 or window % step or window <= step:
            errors.append(f"defaults.{path}: window {block['window']} must be a multiple (> 1) of "
                          f"step {block['step']}")


def _check_ramps(d: dict[str, Any], errors: list[str]) -> None:
    for name, knobs in (d.get("evidence") or {}).items():
        if not isinstance(knobs, dict) or "low" not in knobs:
            continue
        low, high = knobs.get("low"), knobs.get("high")
        if not (_number(low) and _number(high)) or low >= high:
            errors.append(f"defaults.evidence.{name}: low ({low!r}) must be a number below high ({high!r})")


def _check_fusion(d: dict[str, Any], errors: list[str]) -> None:
    fusion = d.get("fusion") or {}
    threshold = fusion.get("threshold")
    signals = set(d.get("evidence") or {})
    weights = fusion.get("weights") or {}
    for name, weight in weights.items():
        where = f"defaults.fusion.weights.{name}"
        if name not in signals:
            errors.append(f"{where}: no evidence signal of that name")
        if _number(weight) and _number(threshold) and 0 < threshold <= 1 and threshold <= weight <= 1:
            errors.append(f"{where}: {weight} >= fusion.threshold {threshold}: that signal (and its cause) "
                          "alone would raise GPUHealthGpuFailureRisk; give it its own alert instead")
    for name in sorted(signals - set(weights)):
        errors.append(f"defaults.fusion.weights: no weight for signal {name}")
    home: dict[str, str] = {}
    for cause, members in (fusion.get("causes") or {}).items():
        where = f"defaults.fusion.causes.{cause}"
        for name in members if isinstance(members, list) else []:
            if name not in signals:
                errors.append(f"{where}: no evidence signal {name!r}")
            elif name in home:
                errors.append(f"{where}: {name} is also in cause {home[name]}")
            home.setdefault(name, cause)
    for name in sorted(signals - set(home)):
        errors.append(f"defaults.fusion.causes: signal {name} is in no cause")


def _check_xid(xid: dict[str, Any], errors: list[str]) -> None:
    """NVIDIA's table and the overrides together give each XID exactly one class."""
    buckets = xid.get("buckets") or {}
    for bucket in sorted({b for b in xid_table().values() if b} - set(buckets)):
        errors.append(f"defaults.xid.buckets: no entry for NVIDIA's bucket {bucket} "
                      f"(XIDs {', '.join(str(x) for x, b in xid_table().items() if b == bucket)})")
    seen: dict[int, str] = {}
    for klass, xids in (xid.get("overrides") or {}).items():
        for value in xids if isinstance(xids, list) else []:
            if value in seen:
                errors.append(f"defaults.xid.overrides.{klass}: XID {value} is also in class {seen[value]}")
            seen[value] = klass
    unbucketed = sorted(x for x, b in xid_table().items() if not b and x not in seen)
    if unbucketed:
        errors.append(f"defaults.xid.overrides: XIDs {', '.join(map(str, unbucketed))} have no bucket in "
                      "NVIDIA's catalogue: list each under a class, or under `none`")
