"""The exporter's metric families and their exposition, built from the shared metric table.

The table (names, types, labels, help) lives in ``gpuhealth.contract.metrics`` because the detection
benchmark publishes the same names. Collectors add samples by name through ``Families``; a name
missing from the table is a programming error caught by the tests, and docs/contract.md is checked
against it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from gpuhealth.contract.metrics import (
    KMSG_RESULTS,
    LEGACY_NVLINK_ERROR_TYPES,
    RECOVERY_ACTIONS,
    REMAP_AVAILABILITY,
    SPECS,
    Spec,
)
from prometheus_client.core import Metric
from prometheus_client.samples import Sample

__all__ = ["KMSG_RESULTS", "LEGACY_NVLINK_ERROR_TYPES", "RECOVERY_ACTIONS", "REMAP_AVAILABILITY", "SPECS",
           "Families", "Renderer", "render"]


Series = tuple[tuple[str, ...], float]  # label values (as text, in SPECS order) and value


class Family:
    """One family of ``SPECS`` with its samples kept as (label values, value) pairs.

    Every family is rendered once per sampling run, so prometheus_client's families (a ``Sample``
    and a label dict per series) cost more than the rendering itself; the renderer reads these pairs
    directly. ``samples`` builds prometheus_client's form for whoever asks.
    """

    __slots__ = ("documentation", "label_names", "name", "pairs", "sample_name", "type")

    def __init__(self, name: str, spec: Spec) -> None:
        self.sample_name = name
        self.name = name.removesuffix("_total") if spec.kind == "counter" else name  # as prometheus_client
        self.documentation, self.type, self.label_names = spec.help, spec.kind, spec.labels
        self.pairs: list[Series] = []

    @property
    def samples(self) -> list[Sample]:
        return [Sample(self.sample_name, dict(zip(self.label_names, values, strict=False)), value)
                for values, value in self.pairs]


Exposed = Family | Metric  # what collectors yield: Family from Families, Metric from prometheus_client


class Families:
    """Collects samples by metric name and yields families in first-use order."""

    def __init__(self) -> None:
        self._families: dict[str, Family] = {}

    def _family(self, name: str) -> Family:
        family = self._families.get(name)
        if family is None:
            family = self._families[name] = Family(name, SPECS[name])
        return family

    def add(self, name: str, value: float, labels: Sequence[object] = ()) -> None:
        self._family(name).pairs.append((tuple(map(str, labels)), float(value)))

    def extend(self, name: str, series: Iterable[Series]) -> None:
        """Series already in the form ``add`` stores: label values as text, the value a float."""
        self._family(name).pairs.extend(series)

    def __iter__(self) -> Iterator[Family]:
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


_INFINITIES = {float("inf"): "+Inf", float("-inf"): "-Inf"}


def _format_value(value: float) -> str:
    if value != value:
        return "NaN"
    return _INFINITIES.get(value) or repr(float(value))


_SeriesKey = tuple[str, ...] | tuple[tuple[str, str], ...]  # a Family's label values, a Sample's items


class _Line:
    """A series' rendered line, kept with its value: most series hold their value from one run to
    the next (counters change every few seconds, health gauges rarely), so their line is reused."""

    __slots__ = ("prefix", "text", "value")

    def __init__(self, prefix: str) -> None:
        self.prefix, self.text, self.value = prefix, "", float("nan")  # NaN equals nothing: first update

    def update(self, value: float) -> str:
        self.value, self.text = value, self.prefix + _format_value(value)
        return self.text


class Renderer:
    """Prometheus text format, rendered every sampling run: the exporter's hottest loop.

    Two caches make it cheap. A family whose series and values all equal the previous run's (most
    of them: counters and link state are read every few seconds, health gauges rarely change) reuses
    its whole encoded block, found by one comparison of its pairs. Within a family that changed, each
    series' name-and-labels prefix is built once and found by the label values alone (a family's
    label names are fixed by ``SPECS``), and a series whose value held keeps its line.
    """

    def __init__(self) -> None:
        self._series_lines: dict[str, dict[_SeriesKey, _Line]] = {}  # sample name -> label values -> line
        self._cached = 0
        self._headers: dict[tuple[str, str, str], str] = {}
        self._blocks: dict[str, tuple[list[Series], bytes]] = {}  # sample name -> last pairs, their block

    def _prefix(self, name: str, labels: dict[str, str]) -> str:
        inner = ",".join(f'{k}="{_utf8(str(v)).translate(_ESCAPES)}"' for k, v in sorted(labels.items()))
        return f"{name}{{{inner}}} " if inner else f"{name} "

    def _series(self, name: str) -> dict[_SeriesKey, _Line]:
        if self._cached > MAX_CACHED_SERIES:  # label values churned (jobs come and go)
            self._series_lines.clear()
            self._cached = 0
        return self._series_lines.setdefault(name, {})

    def _header(self, family: Exposed) -> str:
        header_key = (family.name, family.type, family.documentation)
        header = self._headers.get(header_key)
        if header is None:
            name = family.name + ("_total" if family.type == "counter" else "")
            doc = family.documentation.replace("\\", "\\\\").replace("\n", "\\n")
            header = self._headers[header_key] = f"# HELP {name} {doc}\n# TYPE {name} {family.type}"
        return header

    def _family_block(self, family: Family) -> bytes:
        kept = self._blocks.get(family.sample_name)
        if kept is not None and kept[0] == family.pairs:
            return kept[1]
        lines = [self._header(family)]
        series = self._series(family.sample_name)
        for values, value in family.pairs:
            line = series.get(values)
            if line is None:
                labels = dict(zip(family.label_names, values, strict=False))
                line = series[values] = _Line(self._prefix(family.sample_name, labels))
                self._cached += 1
            lines.append(line.text if line.value == value else line.update(value))
        lines.append("")
        block = "\n".join(lines).encode()
        self._blocks[family.sample_name] = (family.pairs.copy(), block)  # a collector may reuse its list
        return block

    def _metric_block(self, family: Metric) -> bytes:
        lines = [self._header(family)]
        for sample in family.samples:
            series = self._series(sample.name)
            key = tuple(sorted(sample.labels.items()))  # pairs: never equal to a Family's values
            line = series.get(key)
            if line is None:
                line = series[key] = _Line(self._prefix(sample.name, sample.labels))
                self._cached += 1
            lines.append(line.update(sample.value))
        lines.append("")
        return "\n".join(lines).encode()

    def render(self, families: Iterable[Exposed]) -> bytes:
        return b"".join(self._family_block(f) if isinstance(f, Family) else self._metric_block(f)
                        for f in families)


def render(families: Iterable[Exposed]) -> bytes:
    """Prometheus text exposition of ``families`` (one-off; the sampler keeps a ``Renderer``)."""
    return Renderer().render(families)
