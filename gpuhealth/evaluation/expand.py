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
- rule ``labels:``     -> ``label_replace`` wrappers.
"""

from __future__ import annotations

import re

from gpuhealth.evaluation.rulefiles import Matcher, Rule, RulesError, RuleSet, selectors

MARK = "gpuhealth_eval_match"
_OFFSET = re.compile(r"\s*offset\s+(-?[0-9a-z]+)")


def _duration_text(seconds: float) -> str:
    return f"{int(seconds)}s" if seconds == int(seconds) else f"{int(seconds * 1000)}ms"


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _filter(expr: str, matcher: Matcher) -> str:
    """Keep the series of ``expr`` whose label matches, using only label_replace and set operators."""
    pattern = re.escape(matcher.value) if matcher.op in ("=", "!=") else matcher.value
    marked = f'label_replace({expr}, {_quote(MARK)}, "1", {_quote(matcher.label)}, {_quote(pattern)})'
    keep = "and" if matcher.op in ("=", "=~") else "unless"
    one = f'label_replace(vector(1), {_quote(MARK)}, "1", "", "")'
    return f'label_replace(({marked} {keep} on ({MARK}) {one}), {_quote(MARK)}, "", "", "")'


class Expander:
    """Expands recorded names recursively; definitions are memoised and cycles reported."""

    def __init__(self, rules: RuleSet) -> None:
        self.definitions: dict[str, list[Rule]] = {}
        for rule in rules.records:
            self.definitions.setdefault(rule.name, []).append(rule)
        self._done: dict[str, str] = {}
        self._active: list[str] = []
        self.broken: dict[str, str] = {}  # recorded name -> Prometheus's error: it records nothing

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

    def definition(self, name: str) -> str:
        if name in self.broken:
            return "(vector(0) > 1)"  # an empty vector: what a failing rule records
        if name in self._done:
            return self._done[name]
        if name in self._active:
            raise RulesError(
                f"recording rules depend on each other in a cycle: {' -> '.join([*self._active, name])}"
            )
        self._active.append(name)
        parts = []
        for rule in self.definitions[name]:
            body = f"({self.expand(rule.expr)})"
            for label, value in rule.labels:
                body = f'label_replace({body}, {_quote(label)}, {_quote(value)}, "", "")'
            parts.append(body)
        self._active.pop()
        self._done[name] = parts[0] if len(parts) == 1 else "(" + " or ".join(parts) + ")"
        return self._done[name]

    def interval(self, name: str) -> float:
        return min(rule.interval for rule in self.definitions[name])

    def expand(self, expr: str) -> str:
        out: list[str] = []
        pos = 0
        for selector in selectors(expr):
            name = selector.name
            if name is None and any(
                m.label == "__name__" and m.matches({"__name__": r})
                for m in selector.matchers
                for r in self.definitions
            ):
                text = expr[selector.start : selector.end]
                raise RulesError(f"cannot expand a selector on recorded names by __name__: {text}")
            if name not in self.definitions:
                continue
            body = self.definition(name)
            for matcher in selector.matchers:
                body = _filter(body, matcher)
            end = selector.end
            offset = _OFFSET.match(expr, end)
            step = _duration_text(self.interval(name))
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
