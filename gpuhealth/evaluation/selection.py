"""Which series to write, and how densely, so that the rules see exactly what a full scrape would give.

A two-week fleet at one sample a minute is billions of samples; the rules read a small part of it.
A series is written only when a selector of the rules can select it (plus a few identity series);
its samples are thinned where the values stand still, with ``Thinning`` sized from the rules' range
windows so that every query result is unchanged.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Protocol

from gpuhealth.evaluation.openmetrics import LOOKBACK_SECONDS, Thinning
from gpuhealth.evaluation.rulefiles import RuleSet, Selector, rule_selectors
from gpuhealth.evaluation.signals import Family

# Written whatever the rules read: what the fleet is, and whether its GPUs are there.
IDENTITY = (
    "up",
    "gpuhealth_gpu_info",
    "gpuhealth_gpu_up",
    "gpuhealth_gpus_expected",
    "gpuhealth_gpus_visible",
)
# Functions whose result depends on how many samples a window holds, not only on their values.
SAMPLE_COUNTING = ("count_over_time", "sum_over_time")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
# Without rules (dashboards): thinning that keeps every range window up to an hour exact.
UNRULED = Thinning(reach=3600, grid=120)


class SeriesWriter(Protocol):
    """Where series go: TSDB blocks (``blocks.BlockWriter``), or promtool's input (``BlockFiles``)."""

    def write(self, family: Family, thinning: Thinning) -> None: ...


def label_dict(text: str) -> dict[str, str]:
    return dict(_LABEL.findall(text))


@dataclass
class Selection:
    """The write plan: ``None`` selectors means no rules, so every series is written."""

    step: float
    selectors: list[Selector] | None = None
    _cache: dict[str, list[Selector]] = field(default_factory=dict)

    @classmethod
    def for_rules(cls, rules: RuleSet | None, step: float) -> Selection:
        return cls(step, rule_selectors(rules) if rules is not None else None)

    def relevant(self, name: str) -> list[Selector]:
        if self.selectors is None:
            return []
        if name not in self._cache:
            self._cache[name] = [s for s in self.selectors if s.name == name or _name_only(s, name)]
        return self._cache[name]

    def family_wanted(self, name: str) -> bool:
        return self.selectors is None or name in IDENTITY or bool(self.relevant(name))

    def series_wanted(self, name: str, labels: str) -> bool:
        if self.selectors is None or name in IDENTITY:
            return True
        parsed = label_dict(labels)
        return any(s.accepts(name, parsed) for s in self.relevant(name))

    def write(self, family: Family, writer: SeriesWriter) -> None:
        """Hand ``writer`` the series of ``family`` this plan wants, with the family's thinning."""
        rows = [row for row in family.series if self.series_wanted(family.name, row[0])]
        writer.write(Family(family.name, family.kind, rows), self.thinning(family.name))

    def thinning(self, name: str) -> Thinning:
        if self.selectors is None:
            return UNRULED
        used = self.relevant(name)
        if any(s.function in SAMPLE_COUNTING and s.range_seconds for s in used):
            return Thinning(0, 0)
        ranges = [s.range_seconds for s in used if s.range_seconds]
        instant = not used or any(s.range_seconds is None for s in used)
        grid = min([LOOKBACK_SECONDS * 0.8] * instant + [r / 2 for r in ranges])
        return Thinning(reach=max([self.step, *ranges]), grid=grid)


def _name_only(selector: Selector, name: str) -> bool:
    """A ``{__name__=~...}`` selector: decide on the name matchers alone (the labels come per series)."""
    if selector.name is not None:
        return False
    name_matchers = [m for m in selector.matchers if m.label == "__name__"]
    return bool(name_matchers) and all(m.matches({"__name__": name}) for m in name_matchers)
