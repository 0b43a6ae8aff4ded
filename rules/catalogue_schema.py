"""The rule catalogue's JSON Schema: the built-in catalogue's shape, plus the bounds of each knob.

The catalogue stays a plain mapping (the templates read it as one), so jsonschema checks it rather
than a typed model. The shape comes from ``catalogue.yaml`` itself (a key's type is that of its
built-in value; every duration knob has the Prometheus grammar of ``gpuhealth.contract.duration``),
so a knob added there needs no second declaration here; ``BOUNDS`` adds what a type cannot say.
Rules that tie knobs together (windows and the scrape interval, weights and the threshold, the XID
classes and NVIDIA's table) stay in ``catalogue.check``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import jsonschema  # type: ignore[import-untyped]  # it ships no type information
from gpuhealth.contract.duration import HINT, PATTERN, parse_duration

ACTIONS = ("none", "restart_job", "checkpoint_drain", "checkpoint_drain_reset_gpu", "drain",
           "drain_reset_gpu", "drain_reboot", "replace")
SEVERITIES = ("critical", "warning", "info")
GROUPS = ("xid", "definitive", "fabric", "evidence", "fusion", "lemon", "fleet", "storage", "meta")
XID_CLASSES = ("restart_job", "drain", "drain_reset_gpu", "drain_reboot")  # what an XID alone can ask
NVLINK_CLASS = "nvlink"  # the first restarts the job, a repeat or a link that stays down drains
RECOVERY_ACTIONS = ("none", "gpu_reset", "node_reboot", "drain_p2p", "drain_and_reset")
GPU_SHARDS = (1, 2, 5, 10)  # divisors of 10: shards by the last digit of the GPU index or HCA name
LABEL = "^[a-zA-Z_][a-zA-Z0-9_]*$"

DURATION = {"type": "string", "pattern": PATTERN, "description": f"A Prometheus duration: {HINT}."}
POSITIVE_INTEGER = {"type": "integer", "minimum": 1}
XIDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 1, "maximum": 999}}
TEXT = {"type": "string", "pattern": r"\S", "description": "required text"}
_COUNTS = {"count", "non_fatal_count", "gpus_per_node", "min_nodes", "simultaneous_nodes"}

# Paths under ``defaults`` (``*``: any key) and what their type alone cannot say.
BOUNDS: dict[str, dict[str, Any]] = {
    "selectors.*": {"type": "string", "pattern": r"^(?!\s*\{)",
                    "description": "label matchers without braces, e.g. job=\"x\""},
    "identity_labels": {"type": "array", "items": {"type": "string", "pattern": LABEL}, "uniqueItems": True,
                        "contains": {"const": "node"}, "not": {"contains": {"const": "gpu"}},
                        "description": "must name node (the webhook drains by it), not gpu, each once"},
    "gpu_shards": {"enum": list(GPU_SHARDS)},
    "fabric.hca_shards": {"enum": list(GPU_SHARDS)},
    "busy_utilization": {"type": "number", "minimum": 0, "maximum": 1},
    "xid.buckets.*": {"enum": [*XID_CLASSES, NVLINK_CLASS, "none"]},
    "xid.overrides": {"propertyNames": {"enum": [*XID_CLASSES, "none"]}},
    "xid.overrides.*": {**XIDS, "minItems": 0},
    "xid.fabric_manager.xids": XIDS,
    "xid.recovery_actions": {"propertyNames": {"enum": list(ACTIONS[1:])}},
    "xid.recovery_actions.*": {"type": "array", "items": {"enum": list(RECOVERY_ACTIONS)}},
    "xid.*.xids": XIDS,
    "definitive.uncorrectable_ecc.contained_xids": XIDS,
    "definitive.ecc_storm.min_per_second": {"type": "number", "exclusiveMinimum": 0},
    "definitive.ecc_storm.fleet_quantile": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
    "definitive.ecc_storm.fleet_factor": {"type": "number", "exclusiveMinimum": 0},
    "definitive.nvlink_error_rate.min_fraction": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "definitive.nvlink_error_rate.baseline_factor": {"type": "number", "minimum": 1},
    "definitive.nvlink_error_rate.fleet_quantile": {"type": "number", "exclusiveMinimum": 0,
                                                     "exclusiveMaximum": 1},
    "definitive.nvlink_error_rate.young_slices": POSITIVE_INTEGER,
    "definitive.cooling_failing.steps": POSITIVE_INTEGER,
    "definitive.cooling_failing.min_rise_celsius": {"type": "number", "exclusiveMinimum": 0},
    "fabric.switch_event.min_fraction": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "fusion.threshold": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "fusion.weights.*": {"type": "number", "minimum": 0, "maximum": 1},
    "fusion.causes": {"propertyNames": {"pattern": LABEL}},
    "fusion.causes.*": {"type": "array", "items": {"type": "string"}},
    "lemon.actions": {"type": "array", "items": {"enum": list(ACTIONS)}},
    "lemon.severities": {"type": "array", "items": {"enum": list(SEVERITIES)}},
    "fleet.nodes_at_risk.actions": {"type": "array", "minItems": 1, "items": {"enum": list(ACTIONS[1:])}},
    "fleet.nodes_at_risk.max_share": {"type": "number", "minimum": 0, "exclusiveMaximum": 1},
}


def is_duration(path: str) -> bool:
    key = path.rsplit(".", 1)[-1]
    return (path.startswith("for.") or key.endswith(("window", "_step", "_age")) or key in (
        "scrape_interval", "evaluation_interval", "step", "group_wait", "group_interval", "repeat_interval"))


def _bounds(path: str) -> dict[str, Any] | None:
    for pattern, extra in BOUNDS.items():
        if re.fullmatch(re.escape(pattern).replace(r"\*", "[^.]+"), path):
            return extra
    return None


def _shape(value: Any, path: str) -> dict[str, Any]:
    """The schema of a built-in value: its type, then its bounds; mappings are closed."""
    bounds = _bounds(path)
    if isinstance(value, dict):
        properties = {key: _shape(item, f"{path}.{key}" if path else key) for key, item in value.items()}
        node = {"type": "object", "additionalProperties": False, "properties": properties}
        return {**node, **(bounds or {})}
    if (bounds is not None and "enum" in bounds) or is_duration(path):
        return bounds if bounds is not None else DURATION
    if isinstance(value, bool):
        shape: dict[str, Any] = {"type": "boolean"}
    elif isinstance(value, int | float):
        shape = POSITIVE_INTEGER if path.rsplit(".", 1)[-1] in _COUNTS else {"type": "number"}
    elif isinstance(value, str):
        shape = {"type": "string"}
    else:
        shape = {"type": "array"}
    return {**shape, **(bounds or {})}


def build(builtin: dict[str, Any]) -> dict[str, Any]:
    """The schema of a merged catalogue, from the built-in one."""
    alert = {"type": "object", "required": ["group", "severity", "action", "summary", "description"],
             "properties": {"group": {"enum": list(GROUPS)}, "severity": {"enum": list(SEVERITIES)},
                            "action": {"enum": list(ACTIONS)}, "summary": TEXT, "description": TEXT}}
    return {"title": "gpuhealth rule catalogue (or a site overlay merged over it)", "type": "object",
            "additionalProperties": False, "required": ["defaults", "alerts"],
            "properties": {
                "defaults": _shape(builtin["defaults"], ""),
                # rule file -> shard or global (``catalogue.check`` names the tiers a file may take)
                "tiers": {"type": "object"},
                "alerts": {"type": "object", "additionalProperties": alert,
                           "propertyNames": {"pattern": "^GPUHealth[A-Z][A-Za-z0-9]*$"}}}}


def _message(error: jsonschema.ValidationError) -> str:
    value, kind, expected = error.instance, error.validator, error.validator_value
    if kind == "pattern" and expected == PATTERN:
        try:
            parse_duration(value)
        except ValueError as exc:
            return str(exc)
    if kind == "enum":
        return f"{value!r} is not one of {', '.join(map(str, expected))}"
    if kind == "type":
        return f"expected {'an' if expected == 'integer' else 'a'} {expected}, got {value!r}"
    bounds = {"minimum": ">=", "maximum": "<=", "exclusiveMinimum": ">", "exclusiveMaximum": "<"}
    if kind in bounds:
        return f"expected a number {bounds[kind]} {expected}, got {value!r}"
    if kind == "minItems":
        return f"expected at least {expected} item(s), got {value!r}"
    description = (error.schema or {}).get("description") if isinstance(error.schema, dict) else None
    return f"{description}, got {value!r}" if description else error.message


def problems(data: Any, schema: dict[str, Any]) -> Iterator[str]:
    """Every schema problem of ``data`` as ``location: message``, in document order."""
    validator = jsonschema.Draft202012Validator(schema)
    seen = set()
    for error in validator.iter_errors(data):
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path).lstrip(".")
        line = f"{where}: {_message(error)}"
        if line not in seen:  # one rule broken two ways (identity_labels) is one problem
            seen.add(line)
            yield line
