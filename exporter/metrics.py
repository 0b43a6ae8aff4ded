"""The exporter's metric families and their exposition, built from the shared metric table.

The table (names, types, labels, help) lives in ``gpuhealth.contract.metrics`` because the detection
benchmark publishes the same names. Collectors add samples by name through ``Families``; a name
missing from the table is a programming error caught by the tests, and docs/contract.md is checked
against it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from gpuhealth.contract.metrics import (
    KMSG_RESULTS,
    LEGACY_NVLINK_ERROR_TYPES,
    RECOVERY_ACTIONS,
    REMAP_AVAILABILITY,
    SPECS,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

__all__ = ["KMSG_RESULTS", "LEGACY_NVLINK_ERROR_TYPES", "RECOVERY_ACTIONS", "REMAP_AVAILABILITY", "SPECS",
           "Families", "Renderer", "render"]


class Families:
    """Collects samples by metric name and yields prometheus_client families in first-use order."""

    def __init__(self) -> None:
        self._families: dict[str, Metric] = {}

    def add(self, name: str, value: float, labels: Sequence[str] = ()) -> None:
        family = self._families.get(name)
        if family is None:
            spec = SPECS[name]
            cls = CounterMetricFamily if spec.kind == "counter" else GaugeMetricFamily
            family = cls(name, spec.help, labels=spec.labels)
            self._families[name] = family
        family.add_metric([str(v) for v in labels], float(value))

    def __iter__(self):
        return iter(self._families.values())


MAX_CACHED_SERIES = 100_000
_ESCAPES = str.maketrans({"\\": "\\\\", "\n": "\\n", '"': '\\"'})


def _utf8(value: str) -> str:
    """A label value the exposition can carry: the kernel's names are bytes, read with surrogateescape,
    and a byte that is not UTF-8 is shown as ``\\xff`` instead of failing the whole scrape."""
    try:
        value.encode()
        return value
    except UnicodeEncodeError:
        pass
    try:
        return value.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a surrogate that no byte escaped
        return value.encode("utf-8", "backslashreplace").decode()


def _format_value(value: float) -> str:
    if value != value:
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


class Renderer:
    """Prometheus text format, with each series' name-and-labels prefix built once and reused.

    The exposition is rendered every sampling run, so this is the exporter's hottest loop; series
    are stable from one run to the next, so nearly every prefix comes from the cache.
    """

    def __init__(self) -> None:
        self._prefixes: dict[tuple[str, tuple[tuple[str, str], ...]], str] = {}
        self._headers: dict[tuple[str, str, str], str] = {}

    def _prefix(self, name: str, labels: dict[str, str]) -> str:
        key = (name, tuple(labels.items()))
        prefix = self._prefixes.get(key)
        if prefix is None:
            if len(self._prefixes) > MAX_CACHED_SERIES:  # label values churned (jobs come and go)
                self._prefixes.clear()
            inner = ",".join(f'{k}="{_utf8(str(v)).translate(_ESCAPES)}"' for k, v in sorted(labels.items()))
            prefix = self._prefixes[key] = f"{name}{{{inner}}} " if inner else f"{name} "
        return prefix

    def render(self, families: Iterable[Metric]) -> bytes:
        lines: list[str] = []
        for family in families:
            header_key = (family.name, family.type, family.documentation)
            header = self._headers.get(header_key)
            if header is None:
                name = family.name + ("_total" if family.type == "counter" else "")
                doc = family.documentation.replace("\\", "\\\\").replace("\n", "\\n")
                header = self._headers[header_key] = f"# HELP {name} {doc}\n# TYPE {name} {family.type}"
            lines.append(header)
            lines.extend(self._prefix(s.name, s.labels) + _format_value(s.value) for s in family.samples)
        lines.append("")
        return "\n".join(lines).encode()


def render(families: Iterable[Metric]) -> bytes:
    """Prometheus text exposition of ``families`` (one-off; the sampler keeps a ``Renderer``)."""
    return Renderer().render(families)
