"""Load the rule catalogue, merge a site's partial catalogue over it, and check it.

Every problem is collected before reporting, so one run of the generator lists them all instead of
making the operator fix a file one error at a time.
"""

from __future__ import annotations

import copy
import csv
import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

import yaml
from gpuhealth.contract.duration import parse_duration

BUILTIN = Path(__file__).with_name("catalogue.yaml")
XID_TABLE = Path(__file__).with_name("xid_catalogue.csv")
ACTIONS = ("none", "restart_job", "checkpoint_drain", "drain", "drain_reset_gpu", "drain_reboot",
           "replace")
SEVERITIES = ("critical", "warning", "info")
GROUPS = ("xid", "definitive", "evidence", "fusion", "lemon", "storage", "meta")
TIERS = ("single", "shard", "global")  # single: one Prometheus runs every group
# What a shard remote-writes to the global tier (a regex on __name__): its recorded series and its
# alerts; raw exporter series stay in the shard, so the global tier holds a few series per GPU.
REMOTE_WRITE_SERIES = "gpuhealth:.+|ALERTS"
XID_CLASSES = ("restart_job", "drain", "drain_reset_gpu", "drain_reboot")  # what an XID alone can ask
# NVLink errors: the first restarts the job, a repeat or a link that stays down drains (xid.nvlink).
NVLINK_CLASS = "nvlink"
RECOVERY_ACTIONS = ("none", "gpu_reset", "node_reboot", "drain_p2p", "drain_and_reset")
MIN_SAMPLES_PER_WINDOW = 4
GPU_SHARDS = (1, 2, 5, 10)  # divisors of 10: shards by the last digit of the GPU index

_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


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


def _get(data: dict[str, Any], path: str, errors: list[str]) -> Any:
    node: Any = data
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            errors.append(f"{path}: missing")
            return None
        node = node[part]
    return node


def _number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check(data: dict[str, Any]) -> list[str]:
    """Every problem with a merged catalogue, as ``path: message`` lines."""
    errors: list[str] = []
    d = _get(data, "defaults", errors)
    alerts = _get(data, "alerts", errors)
    _check_tiers(_get(data, "tiers", errors), errors)
    if not isinstance(d, dict) or not isinstance(alerts, dict):
        return errors
    scrape = _check_durations(d, errors)
    _check_ramps(d, errors)
    _check_windows(d, scrape, errors)
    _check_fusion(d, errors)
    _check_xid(d, errors)
    _check_alerts(d, alerts, errors)
    busy = d.get("busy_utilization")
    if not _number(busy) or not 0 <= busy <= 1:
        errors.append(f"defaults.busy_utilization: must be a number in 0..1, got {busy!r}")
    if d.get("gpu_shards") not in GPU_SHARDS:
        errors.append(f"defaults.gpu_shards: must be one of {', '.join(map(str, GPU_SHARDS))} (shards by the "
                      f"last digit of the GPU index), got {d.get('gpu_shards')!r}")
    _check_identity(d.get("identity_labels"), errors)
    _check_definitive(d.get("definitive") or {}, errors)
    if not isinstance(d.get("gpus_per_node"), int) or d["gpus_per_node"] < 1:
        errors.append(f"defaults.gpus_per_node: must be a positive integer, got {d.get('gpus_per_node')!r}")
    for path, value in _leaves(d.get("selectors", {}), "defaults.selectors"):
        if not isinstance(value, str) or value.strip().startswith("{"):
            errors.append(f"{path}: must be label matchers without braces, e.g. 'job=\"x\"', got {value!r}")
    return errors


def _check_tiers(tiers: Any, errors: list[str]) -> None:
    if not isinstance(tiers, dict):
        errors.append(f"tiers: must map each rule file to shard or global, got {tiers!r}")
        return
    for name in GROUPS:
        if tiers.get(name) not in TIERS[1:]:
            errors.append(f"tiers.{name}: must be shard or global, got {tiers.get(name)!r}")


def _check_definitive(k: dict[str, Any], errors: list[str]) -> None:
    storm = k.get("ecc_storm") or {}
    for key, low, high in (("min_per_second", 0, None), ("fleet_quantile", 0, 1), ("fleet_factor", 0, None)):
        value = storm.get(key)
        if not _number(value) or value <= low or (high is not None and value >= high):
            bounds = f"in ({low}, {high})" if high is not None else f"above {low}"
            errors.append(f"defaults.definitive.ecc_storm.{key}: must be a number {bounds}, got {value!r}")
    _xid_list((k.get("uncorrectable_ecc") or {}).get("contained_xids"),
              "defaults.definitive.uncorrectable_ecc.contained_xids", errors)
    for path in ("nvswitch.non_fatal_count", "repeated_gpus_missing.count"):
        block, key = path.split(".")
        value = (k.get(block) or {}).get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            errors.append(f"defaults.definitive.{path}: must be a positive integer, got {value!r}")


def _check_identity(labels: Any, errors: list[str]) -> None:
    where = "defaults.identity_labels"
    if not isinstance(labels, list) or not all(isinstance(x, str) and _LABEL.fullmatch(x) for x in labels):
        errors.append(f"{where}: must be a list of label names, got {labels!r}")
    elif "node" not in labels or "gpu" in labels or len(set(labels)) != len(labels):
        errors.append(f"{where}: must name `node` (the webhook drains by it), not `gpu`, each once; "
                      f"got {labels!r}")


def _is_duration_key(key: str) -> bool:
    return key in ("scrape_interval", "evaluation_interval", "step", "group_wait", "group_interval",
                   "repeat_interval") or key.endswith("window")


def _check_durations(d: dict[str, Any], errors: list[str]) -> float:
    """Parse every duration knob; return the scrape interval in seconds (15 when it is unusable)."""
    for path, value in _leaves(d, "defaults"):
        key = path.rsplit(".", 1)[1]
        if _is_duration_key(key) or path.startswith("defaults.for."):
            try:
                parse_duration(value)
            except ValueError as exc:
                errors.append(f"{path}: {exc}")
    try:
        scrape = parse_duration(d.get("scrape_interval", ""))
    except ValueError:
        return 15
    return scrape if scrape > 0 else 15


def _check_windows(d: dict[str, Any], scrape: float, errors: list[str]) -> None:
    """Range windows need several samples; subquery windows must hold whole steps."""
    minimum = MIN_SAMPLES_PER_WINDOW * scrape
    for section in ("xid", "definitive", "evidence", "lemon", "storage"):
        for path, value in _leaves(d.get(section, {}), f"defaults.{section}"):
            key = path.rsplit(".", 1)[1]
            if not (key.endswith("window") or key == "step"):
                continue
            try:
                length = parse_duration(value)
            except ValueError:
                continue
            if length < minimum:
                errors.append(f"{path}: {value} holds fewer than {MIN_SAMPLES_PER_WINDOW} samples at "
                              f"scrape_interval {d.get('scrape_interval')}; use at least {minimum}s")
    for path in ("evidence.ecc_corrected_growth", "evidence.pcie_replay", "lemon",
                 "definitive.repeated_gpus_missing"):
        block = d
        for part in path.split("."):
            block = block.get(part, {}) if isinstance(block, dict) else {}
        try:
            window, step = parse_duration(block["window"]), parse_duration(block["step"])
        except (KeyError, ValueError):
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
    if not _number(threshold) or not 0 < threshold <= 1:
        errors.append(f"defaults.fusion.threshold: must be a number in (0, 1], got {threshold!r}")
        threshold = None
    signals = set(d.get("evidence") or {})
    weights = fusion.get("weights") or {}
    for name, weight in weights.items():
        where = f"defaults.fusion.weights.{name}"
        if name not in signals:
            errors.append(f"{where}: no evidence signal of that name")
        if not _number(weight) or not 0 <= weight <= 1:
            errors.append(f"{where}: must be a number in 0..1, got {weight!r}")
        elif threshold is not None and weight >= threshold:
            errors.append(f"{where}: {weight} >= fusion.threshold {threshold}: that signal (and its cause) "
                          "alone would raise GPUHealthGpuFailureRisk; give it its own alert instead")
    for name in sorted(signals - set(weights)):
        errors.append(f"defaults.fusion.weights: no weight for signal {name}")
    home: dict[str, str] = {}
    for cause, members in (fusion.get("causes") or {}).items():
        where = f"defaults.fusion.causes.{cause}"
        if not _LABEL.fullmatch(str(cause)) or not isinstance(members, list):
            errors.append(f"{where}: must be a list of signals under a label-safe cause name")
            continue
        for name in members:
            if name not in signals:
                errors.append(f"{where}: no evidence signal {name!r}")
            elif name in home:
                errors.append(f"{where}: {name} is also in cause {home[name]}")
            home.setdefault(name, cause)
    for name in sorted(signals - set(home)):
        errors.append(f"defaults.fusion.causes: signal {name} is in no cause")


def _check_xid(d: dict[str, Any], errors: list[str]) -> None:
    xid = d.get("xid") or {}
    classes = (*XID_CLASSES, NVLINK_CLASS, "none")
    buckets = xid.get("buckets") or {}
    for bucket, klass in buckets.items():
        if klass not in classes:
            errors.append(f"defaults.xid.buckets.{bucket}: {klass!r} is not one of {', '.join(classes)}")
    for bucket in sorted({b for b in xid_table().values() if b} - set(buckets)):
        errors.append(f"defaults.xid.buckets: no entry for NVIDIA's bucket {bucket} "
                      f"(XIDs {', '.join(str(x) for x, b in xid_table().items() if b == bucket)})")
    seen: dict[int, str] = {}
    for klass, xids in (xid.get("overrides") or {}).items():
        where = f"defaults.xid.overrides.{klass}"
        for value in _xid_list(xids, where, errors, empty=True):
            if value in seen:
                errors.append(f"{where}: XID {value} is also in class {seen[value]}")
            seen[value] = klass
    unbucketed = sorted(x for x, b in xid_table().items() if not b and x not in seen)
    if unbucketed:
        errors.append(f"defaults.xid.overrides: XIDs {', '.join(map(str, unbucketed))} have no bucket in "
                      "NVIDIA's catalogue: list each under a class, or under `none`")
    _xid_list((xid.get("fabric_manager") or {}).get("xids"), "defaults.xid.fabric_manager.xids", errors)
    for klass, actions in (xid.get("recovery_actions") or {}).items():
        where = f"defaults.xid.recovery_actions.{klass}"
        if klass not in ACTIONS or klass == "none":
            errors.append(f"{where}: not an action ({', '.join(ACTIONS[1:])})")
        if not isinstance(actions, list) or any(a not in RECOVERY_ACTIONS for a in actions):
            errors.append(f"{where}: must list recovery actions from {', '.join(RECOVERY_ACTIONS)}")
    for name in ("repeated_app_fault", "repeated_remap_failure", "repeated_fall_off_bus", "nvlink"):
        block = xid.get(name) or {}
        if name != "nvlink":
            _xid_list(block.get("xids"), f"defaults.xid.{name}.xids", errors)
        count = block.get("count")
        if not isinstance(count, int) or count < 1:
            errors.append(f"defaults.xid.{name}.count: must be a positive integer, got {count!r}")
    lemon = d.get("lemon") or {}
    if not isinstance(lemon.get("actions"), list) or any(a not in ACTIONS for a in lemon["actions"]):
        errors.append(f"defaults.lemon.actions: must list actions from {', '.join(ACTIONS)}")
    if not isinstance(lemon.get("severities"), list) or any(s not in SEVERITIES for s in lemon["severities"]):
        errors.append(f"defaults.lemon.severities: must list severities from {', '.join(SEVERITIES)}")
    if not isinstance(lemon.get("count"), int) or lemon["count"] < 1:
        errors.append(f"defaults.lemon.count: must be a positive integer, got {lemon.get('count')!r}")


def _xid_list(xids: Any, where: str, errors: list[str], empty: bool = False) -> list[int]:
    if not isinstance(xids, list) or not (xids or empty) or not all(
            isinstance(x, int) and not isinstance(x, bool) and 0 < x < 1000 for x in xids):
        errors.append(f"{where}: must be a {'' if empty else 'non-empty '}list of XID numbers, got {xids!r}")
        return []
    return xids


def _check_alerts(d: dict[str, Any], alerts: dict[str, Any], errors: list[str]) -> None:
    durations = d.get("for") or {}
    for name, alert in alerts.items():
        where = f"alerts.{name}"
        if not re.fullmatch(r"GPUHealth[A-Z][A-Za-z0-9]*", str(name)):
            errors.append(f"{where}: alert names are CamelCase and start with GPUHealth")
        if not isinstance(alert, dict):
            errors.append(f"{where}: expected a mapping")
            continue
        for key, allowed in (("severity", SEVERITIES), ("action", ACTIONS), ("group", GROUPS)):
            if alert.get(key) not in allowed:
                errors.append(f"{where}.{key}: must be one of {', '.join(allowed)}, got {alert.get(key)!r}")
        for key in ("summary", "description"):
            if not isinstance(alert.get(key), str) or not alert[key].strip():
                errors.append(f"{where}.{key}: required text")
        if name not in durations:
            errors.append(f"defaults.for: no entry for alert {name}")
    for name in durations:
        if name not in alerts:
            errors.append(f"defaults.for.{name}: no such alert")
