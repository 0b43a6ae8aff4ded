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

A subquery re-evaluates the record's whole chain at every one of its steps, for every instant of the
outer query: ``avg_over_time(name[1d])`` at a 10-minute interval costs 144 evaluations of the chain
per instant. Records read under a range selector are therefore written to the TSDB once (see
``stored``) and read there: a range function sees only the samples inside its window, so the stored
samples, at the same instants as the subquery's steps, give the same result. Instant reads keep the
expansion, which honours the staleness a backfilled series would lack.
"""

from __future__ import annotations

import re

from gpuhealth.evaluation.rulefiles import Matcher, Rule, RulesError, RuleSet, Selector, selectors

MARK = "gpuhealth_eval_match"
_EMPTY = "(vector(0) > 1)"  # an empty vector: what a failing rule records
_OFFSET = re.compile(r"\s*offset\s+(-?[0-9a-z]+)")


def _duration_text(seconds: float) -> str:
    return f"{int(seconds)}s" if seconds == int(seconds) else f"{int(seconds * 1000)}ms"


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _set(expr: str, label: str, value: str) -> str:
    return f'label_replace({expr}, {_quote(label)}, {_quote(value)}, "", "")'


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
        self._done: dict[str, list[str]] = {}
        self._active: list[str] = []
        self.broken: dict[str, str] = {}  # recorded name -> Prometheus's error: it records nothing
        self.stored: set[str] = set()  # recorded names whose series the TSDB holds, read under a range

    def store(self, name: str) -> None:
        """``name``'s series are now in the TSDB: its range reads read them instead of a subquery."""
        self.stored.add(name)
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
                name = selector.name
                if name in self.definitions and name not in order:
                    for rule in self.definitions[name]:
                        visit(rule.expr)
                    order.append(name)

        visit(expr)
        return order

    def depends_on_records(self, expr: str) -> bool:
        return any(s.name in self.definitions for s in selectors(expr))

    def definition(self, name: str, matchers: tuple[Matcher, ...] = ()) -> str:
        """The expression ``name{matchers}`` stands for. A rule whose static labels contradict a
        matcher records nothing it selects, so it is left out rather than computed and filtered
        away: a record split over several rules by a static label (shards, types) costs one rule."""
        if name in self.broken:
            return _EMPTY
        parts = []
        for rule, body in zip(self.definitions[name], self._bodies(name), strict=True):
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

    def _bodies(self, name: str) -> list[str]:
        """Each rule recording ``name``, expanded, with its static labels set; memoised."""
        if name in self._done:
            return self._done[name]
        if name in self._active:
            raise RulesError(
                f"recording rules depend on each other in a cycle: {' -> '.join([*self._active, name])}"
            )
        self._active.append(name)
        bodies = []
        for rule in self.definitions[name]:
            body = f"({self.expand(rule.expr)})"
            for label, value in rule.labels:
                body = _set(body, label, value)
            bodies.append(body)
        self._active.pop()
        self._done[name] = bodies
        return bodies

    def interval(self, name: str) -> float:
        return min(rule.interval for rule in self.definitions[name])

    def _by_name(self, selector: Selector) -> tuple[str, float] | None:
        """A ``{__name__=~...}`` selector reaching recorded names: their union, each series named
        again, with the selector itself for any raw series it also matches. A marker label keeps
        series of different names apart while ``or`` merges them (it matches without the name)."""
        names = [m for m in selector.matchers if m.label == "__name__"]
        matched = [r for r in self.definitions if names and all(m.matches({"__name__": r}) for m in names)]
        if not matched:
            return None
        recorded = "|".join(re.escape(r) for r in matched)
        raw = "{" + ", ".join(f"{m.label}{m.op}{_quote(m.value)}" for m in selector.matchers)
        raw += f", __name__!~{_quote(recorded)}}}"
        branches = [(raw, "raw")] + [(_set(self.definition(r), "__name__", r), r) for r in matched]
        union = " or ".join(_set(branch, MARK, tag) for branch, tag in branches)
        body = _set(f"({union})", MARK, "")
        for matcher in selector.matchers:
            if matcher.label != "__name__":
                body = _filter(body, matcher)
        return body, min(self.interval(r) for r in matched)

    def expand(self, expr: str) -> str:
        out: list[str] = []
        pos = 0
        for selector in selectors(expr):
            name = selector.name
            if name is None:
                found = self._by_name(selector)
            elif name in self.definitions and (selector.range_seconds is None or name not in self.stored):
                found = self.definition(name, selector.matchers), self.interval(name)
            else:
                found = None
            if found is None:
                continue
            body, interval = found
            end = selector.end
            offset = _OFFSET.match(expr, end)
            step = _duration_text(interval)
            if selector.range_seconds is not None:
                body = f"{body}[{_duration_text(selector.range_seconds)}:{step}]"
            elif offset:
                body = f"last_over_time({body}[5m:{step}] offset {offset.group(1)})"
                end = offset.end()
            out.append(expr[pos : selector.start])
            out.append(body)
            pos = end
        out.append(expr[pos:])
        return "".join(out)
