"""Recording rules folded into the expressions that use them, so one range query evaluates an alert.

Prometheus evaluates recording rules only as time passes; over a backfilled past they hold nothing.
Writing every recorded series back into the TSDB costs as much as the raw data again, so instead each
reference to a recorded name is replaced by its defining expression, and Prometheus's own engine
computes the whole chain inside one range query:

- ``name``             -> ``(expr)`` (several rules recording one name: their union with ``or``)
- ``name[5m]``         -> ``(expr)[5m:interval]``, a subquery at the recording group's interval,
  the samples the recorded series would have held
- ``name{l="v"}``      -> the expression filtered on its labels with ``label_replace`` and ``and``
- ``name offset 1h``   -> ``last_over_time((expr)[lookback:interval] offset 1h)``
- ``{__name__=~"a:.+"}`` -> the union of every matching record's expression, each named again
- rule ``labels:``     -> ``label_replace`` wrappers.

PromQL has no common subexpressions: a subquery re-evaluates the record's whole chain at every one
of its steps (``avg_over_time(name[1d])`` at a 10-minute interval: 144 evaluations per instant), and
a record read by several others is evaluated once per copy. Records can therefore be stored in the
TSDB once and read there, in two ways that give what the expansion gives:

- ``store``: the record's series at its group's interval, read under range selectors. A range function
  sees only the samples inside its window, at the same instants as the subquery's steps.
- ``store_on_grid``: the record's series at the instants of an aligned grid (multiples of its step),
  read at an instant ``t`` of that grid as ``last_over_time(name[step - 1ms])``: the sample at ``t``
  and no older one, so where the record returned nothing at ``t`` the read returns nothing too (a
  plain ``name`` would find an older sample within the 5-minute lookback, where rule evaluation writes
  a staleness marker). Such a read is used only where the instants evaluated are on the grid: the
  caller's step (``expand(expr, step)``) or a subquery's step is a multiple of the grid's; elsewhere
  (offsets, subqueries off the grid, unknown steps) the record is expanded.
"""

from __future__ import annotations

import re

from gpuhealth.evaluation.rulefiles import (
    SUBQUERY,
    Matcher,
    Rule,
    RulesError,
    RuleSet,
    Selector,
    selectors,
    subqueries,
)
from gpuhealth.evaluation.scenario import parse_duration

MARK = "gpuhealth_eval_match"
_EMPTY = "(vector(0) > 1)"  # an empty vector: what a failing rule records
_OFFSET = re.compile(r"\s*offset\s+(-?[0-9a-z]+)")


def _duration_text(seconds: float) -> str:
    return f"{int(seconds)}s" if seconds == int(seconds) else f"{round(seconds * 1000)}ms"


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _set(expr: str, label: str, value: str) -> str:
    return f'label_replace({expr}, {_quote(label)}, {_quote(value)}, "", "")'


def _on_grid(step: float | None, grid: float) -> bool:
    """Instants ``step`` apart (aligned multiples) all lie on an aligned grid of ``grid``."""
    return step is not None and round(step * 1000) % round(grid * 1000) == 0


def _selector_text(name: str, matchers: tuple[Matcher, ...]) -> str:
    return name + "{" + ", ".join(f"{m.label}{m.op}{_quote(m.value)}" for m in matchers) + "}"


def _filter(expr: str, matcher: Matcher) -> str:
    """Keep the series of ``expr`` whose label matches, using only label_replace and set operators."""
    pattern = re.escape(matcher.value) if matcher.op in ("=", "!=") else matcher.value
    marked = f'label_replace({expr}, {_quote(MARK)}, "1", {_quote(matcher.label)}, {_quote(pattern)})'
    keep = "and" if matcher.op in ("=", "=~") else "unless"
    one = f'label_replace(vector(1), {_quote(MARK)}, "1", "", "")'
    return _set(f"({marked} {keep} on ({MARK}) {one})", MARK, "")


class Expander:
    """Expands recorded names recursively; definitions are memoised and cycles reported."""

    def __init__(self, rules: RuleSet) -> None:
        self.definitions: dict[str, list[Rule]] = {}
        for rule in rules.records:
            self.definitions.setdefault(rule.name, []).append(rule)
        self._done: dict[tuple[str, float | None], list[str]] = {}
        self._active: list[str] = []
        self.broken: dict[str, str] = {}  # recorded name -> Prometheus's error: it records nothing
        self.stored: set[str] = set()  # recorded names the TSDB holds at their interval, read under a range
        self.on_grid: dict[str, float] = {}  # recorded name -> the grid step the TSDB holds it at

    def store(self, name: str) -> None:
        """``name``'s series are now in the TSDB: its range reads read them instead of a subquery."""
        self.stored.add(name)
        self._done.clear()

    def store_on_grid(self, name: str, step: float) -> None:
        """``name``'s series are now in the TSDB at the multiples of ``step``: instant reads at those
        instants read them instead of the expansion."""
        self.on_grid[name] = step
        self._done.clear()

    def ranged_records(self, expr: str) -> list[str]:
        """Recorded names read under a range selector (``name[1d]``) by ``expr`` or by the records it
        reads, dependencies first: the reads a subquery would make costly."""
        used = self.records_used(expr)
        texts = [expr, *(rule.expr for name in used for rule in self.definitions[name])]
        ranged = {s.name for t in texts for s in selectors(t) if s.range_seconds is not None}
        return [name for name in used if name in ranged]

    def mark_broken(self, name: str, error: str) -> None:
        self.broken[name] = error
        self._done.clear()

    def records_used(self, expr: str) -> list[str]:
        """Recorded names ``expr`` reads, directly or through other records, dependencies first."""
        order: list[str] = []

        def visit(text: str) -> None:
            for selector in selectors(text):
                for name in self.names_read(selector):
                    if name not in order:
                        for rule in self.definitions[name]:
                            visit(rule.expr)
                        order.append(name)

        visit(expr)
        return order

    def names_read(self, selector: Selector) -> list[str]:
        """The recorded names ``selector`` reads: its name, or those its ``__name__`` matchers match."""
        if selector.name is not None:
            return [selector.name] if selector.name in self.definitions else []
        names = [m for m in selector.matchers if m.label == "__name__"]
        return [r for r in self.definitions if names and all(m.matches({"__name__": r}) for m in names)]

    def depends_on_records(self, expr: str) -> bool:
        return any(s.name in self.definitions for s in selectors(expr))

    def definition(self, name: str, matchers: tuple[Matcher, ...] = (), step: float | None = None) -> str:
        """The expression ``name{matchers}`` stands for at instants ``step`` apart (aligned; None:
        unknown). A rule whose static labels contradict a matcher records nothing it selects, so it
        is left out rather than computed and filtered away: a record split over several rules by a
        static label (shards, types) costs one rule."""
        if name in self.broken:
            return _EMPTY
        if name in self.on_grid and _on_grid(step, self.on_grid[name]):
            window = _duration_text(self.on_grid[name] - 0.001)  # the sample at the instant, no older one
            return f"last_over_time({_selector_text(name, matchers)}[{window}])"
        parts = []
        for rule, body in zip(self.definitions[name], self._bodies(name, step), strict=True):
            static = dict(rule.labels)
            if any(m.label in static and not m.matches(static) for m in matchers):
                continue
            for matcher in matchers:
                if matcher.label not in static:
                    body = _filter(body, matcher)
            parts.append(body)
        if not parts:
            return _EMPTY
        return parts[0] if len(parts) == 1 else "(" + " or ".join(parts) + ")"

    def _bodies(self, name: str, step: float | None) -> list[str]:
        """Each rule recording ``name``, expanded for instants ``step`` apart, with its static labels
        set; memoised."""
        if (name, step) in self._done:
            return self._done[name, step]
        if name in self._active:
            raise RulesError(
                f"recording rules depend on each other in a cycle: {' -> '.join([*self._active, name])}"
            )
        self._active.append(name)
        bodies = []
        for rule in self.definitions[name]:
            body = f"({self.expand(rule.expr, step)})"
            for label, value in rule.labels:
                body = _set(body, label, value)
            bodies.append(body)
        self._active.pop()
        self._done[name, step] = bodies
        return bodies

    def interval(self, name: str) -> float:
        return min(rule.interval for rule in self.definitions[name])

    def _by_name(self, selector: Selector, step: float | None) -> tuple[str, float] | None:
        """A ``{__name__=~...}`` selector reaching recorded names: their union, each series named
        again, with the selector itself for any raw series it also matches. A marker label keeps
        series of different names apart while ``or`` merges them (it matches without the name)."""
        matched = self.names_read(selector)
        if not matched:
            return None
        recorded = "|".join(re.escape(r) for r in matched)
        raw = "{" + ", ".join(f"{m.label}{m.op}{_quote(m.value)}" for m in selector.matchers)
        raw += f", __name__!~{_quote(recorded)}}}"
        branches = [(raw, "raw")] + [(_set(self.definition(r, (), step), "__name__", r), r) for r in matched]
        union = " or ".join(_set(branch, MARK, tag) for branch, tag in branches)
        body = _set(f"({union})", MARK, "")
        for matcher in selector.matchers:
            if matcher.label != "__name__":
                body = _filter(body, matcher)
        return body, min(self.interval(r) for r in matched)

    def expand(self, expr: str, step: float | None = None) -> str:
        """``expr`` with every recorded name it reads expanded or read from the TSDB, for evaluation at
        instants ``step`` apart (aligned multiples; None: unknown, nothing read on a grid)."""
        spans = subqueries(expr)
        out: list[str] = []
        pos = 0
        for selector in selectors(expr):
            name = selector.name
            end = selector.end
            # instants the selector is evaluated at: the innermost subquery's steps, else the caller's
            inner = [(b - a, s) for a, b, s in spans if a <= selector.start < b]
            at = min(inner)[1] if inner else step
            offset = _OFFSET.match(expr, end)
            if selector.range_seconds is None and (sub := SUBQUERY.match(expr, end)):
                at = parse_duration(sub.group(1)) if sub.group(1) else None
            if name is None:
                found = self._by_name(selector, None if offset or selector.range_seconds else at)
            elif name not in self.definitions or (selector.range_seconds is not None and name in self.stored):
                found = None
            elif selector.range_seconds is not None or offset:  # a subquery at the record's interval
                found = self.definition(name, selector.matchers, self.interval(name)), self.interval(name)
            else:
                found = self.definition(name, selector.matchers, at), self.interval(name)
            if found is None:
                continue
            body, interval = found
            interval_text = _duration_text(interval)
            if selector.range_seconds is not None:
                body = f"{body}[{_duration_text(selector.range_seconds)}:{interval_text}]"
            elif offset:
                body = f"last_over_time({body}[5m:{interval_text}] offset {offset.group(1)})"
                end = offset.end()
            out.append(expr[pos : selector.start])
            out.append(body)
            pos = end
        out.append(expr[pos:])
        return "".join(out)
