"""Prometheus rule files as data: groups, recording and alerting rules, and the selectors they use.

Only the text of PromQL is handled here (which metric names and label matchers appear, where
recording-rule names occur); every value is computed by Prometheus itself.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from gpuhealth.evaluation.scenario import parse_duration

DEFAULT_INTERVAL = 60.0


class RulesError(ValueError):
    """Rule files that cannot be evaluated; the message lists every problem."""


@dataclass(frozen=True)
class Rule:
    kind: str  # "record" or "alert"
    name: str
    expr: str
    group: str
    interval: float
    for_seconds: float = 0.0
    labels: tuple[tuple[str, str], ...] = ()


@dataclass
class RuleSet:
    rules: list[Rule] = field(default_factory=list)

    @property
    def records(self) -> list[Rule]:
        return [r for r in self.rules if r.kind == "record"]

    @property
    def alerts(self) -> list[Rule]:
        return [r for r in self.rules if r.kind == "alert"]

    @property
    def interval(self) -> float:
        """The shortest group interval: the evaluation step that honours every group."""
        return min((r.interval for r in self.rules), default=DEFAULT_INTERVAL)


def load_rules(path: Path) -> RuleSet:
    """Every ``*.yml``/``*.yaml`` rule file in ``path`` (a file or a directory, not recursive)."""
    path = Path(path)
    files = sorted(p for p in path.iterdir() if p.suffix in (".yml", ".yaml")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise RulesError(f"{path}: no rule files (*.yml) found")
    problems: list[str] = []
    rules: list[Rule] = []
    for file in files:
        try:
            data = yaml.safe_load(file.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            problems.append(f"{file}: {exc}")
            continue
        for g, group in enumerate(data.get("groups") or []):
            try:
                interval = parse_duration(group.get("interval", "1m"))
            except ValueError as exc:
                problems.append(f"{file}: group {g}: {exc}")
                continue
            for r, raw in enumerate(group.get("rules") or []):
                kind = "alert" if "alert" in raw else "record" if "record" in raw else None
                if kind is None or not raw.get("expr"):
                    problems.append(
                        f"{file}: group {group.get('name')} rule {r}: needs record or alert, and expr"
                    )
                    continue
                try:
                    for_seconds = parse_duration(raw.get("for", 0))
                except ValueError as exc:
                    problems.append(f"{file}: {raw[kind]}: {exc}")
                    continue
                rules.append(
                    Rule(
                        kind,
                        str(raw[kind]),
                        str(raw["expr"]),
                        str(group.get("name", g)),
                        interval,
                        for_seconds,
                        tuple(sorted((str(k), str(v)) for k, v in (raw.get("labels") or {}).items())),
                    )
                )
    if problems:
        raise RulesError("rule files have problems:\n" + "\n".join(f"  - {p}" for p in problems))
    return RuleSet(rules)


# ---- lexing ----------------------------------------------------------------------------------------
_TOKEN = re.compile(
    r"""
    (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<comment>\#[^\n]*)
  | (?P<number>(?:0x[0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)(?:[a-z]+\d*)*)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<brace>\{)
  | (?P<bracket>\[[^\]]*\])
  | (?P<other>.)
""",
    re.VERBOSE | re.DOTALL,
)
_MATCHER = re.compile(
    r"""\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*("(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)\s*,?"""
)
SUBQUERY = re.compile(r"\s*\[[^\]:]*:\s*([0-9a-z]*)\s*\]")  # [range:step] text; group 1 the step
_LABEL_LISTS = ("by", "without", "on", "ignoring", "group_left", "group_right")
_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "offset",
    "bool",
    "and",
    "or",
    "unless",
    "atan2",
    "inf",
    "nan",
    "start",
    "end",
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
}


@dataclass(frozen=True)
class Matcher:
    label: str
    op: str
    value: str

    def matches(self, labels: dict[str, str]) -> bool:
        actual = labels.get(self.label, "")
        if self.op in ("=", "!="):
            return (actual == self.value) == (self.op == "=")
        return bool(re.fullmatch(self.value, actual)) == (self.op == "=~")


@dataclass(frozen=True)
class Selector:
    """A vector selector as written: its metric name (None for ``{__name__=~...}``), matchers and the
    range in seconds when it is a range selector (``x[5m]``), None when it is an instant selector."""

    name: str | None
    matchers: tuple[Matcher, ...]
    range_seconds: float | None
    start: int
    end: int  # end of the selector text, range included
    function: str | None = None  # the function it is the direct argument of

    def accepts(self, name: str, labels: dict[str, str]) -> bool:
        if self.name is not None and self.name != name:
            return False
        return all(m.matches({**labels, "__name__": name}) for m in self.matchers)


def _unquote(text: str) -> str:
    if text.startswith("`"):
        return text[1:-1]
    return text[1:-1].encode().decode("unicode_escape")


def _braces_end(expr: str, start: int) -> int:
    """Index just past the ``}`` closing the ``{`` at ``start``, skipping quoted strings."""
    i = start + 1
    while i < len(expr):
        ch = expr[i]
        if ch in "\"'`":
            match = _TOKEN.match(expr, i)
            i = match.end() if match else i + 1
            continue
        if ch == "}":
            return i + 1
        i += 1
    raise RulesError(f"unbalanced '{{' in: {expr[:80]}")


def _matchers(text: str) -> tuple[Matcher, ...]:
    out, pos = [], 0
    while pos < len(text):
        if not text[pos:].strip():
            break
        match = _MATCHER.match(text, pos)
        if not match:
            raise RulesError(f"cannot read label matchers {{{text}}}")
        out.append(Matcher(match.group(1), match.group(2), _unquote(match.group(3))))
        pos = match.end()
    return tuple(out)


def selectors(expr: str) -> Iterator[Selector]:
    """Every vector selector in ``expr`` (metric names, label matchers, range), in order."""
    pos = 0
    history: list[str] = []
    while pos < len(expr):
        match = _TOKEN.match(expr, pos)
        assert match is not None
        kind, text = match.lastgroup, match.group()
        start = pos
        pos = match.end()
        if kind == "ident":
            after = expr[pos:].lstrip()
            if text in _KEYWORDS or after.startswith("(") or _inside_label_list(history):
                history.append(text)
                continue
            matchers: tuple[Matcher, ...] = ()
            rest = pos + len(expr[pos:]) - len(after)
            if after.startswith("{"):
                close = _braces_end(expr, rest)
                matchers = _matchers(expr[rest + 1 : close - 1])
                pos = close
            selector = _finish(expr, text, matchers, start, pos, history)
            pos = selector.end
            yield selector
        elif kind == "brace":
            close = _braces_end(expr, start)
            selector = _finish(expr, None, _matchers(expr[start + 1 : close - 1]), start, close, history)
            pos = selector.end
            yield selector
        elif kind != "comment" and not text.isspace():
            history.append(text)


def subqueries(expr: str) -> list[tuple[int, int, float | None]]:
    """(start, end, step) of each parenthesised subquery ``(...)[range:step]`` in ``expr``; step None
    where it is left to the global evaluation interval. Subqueries directly on a selector are found by
    ``selectors`` (as a selector without range)."""
    spans = []
    opened: list[int] = []
    closed: tuple[int, int] | None = None  # the group just closed, while nothing else followed it
    pos = 0
    while pos < len(expr):
        match = _TOKEN.match(expr, pos)
        assert match is not None
        kind, text = match.lastgroup, match.group()
        if text == "(":
            opened.append(pos)
        elif text == ")" and opened:
            closed = (opened.pop(), match.end())
            pos = match.end()
            continue
        elif kind == "bracket" and closed is not None and (sub := SUBQUERY.fullmatch(text)):
            step = parse_duration(sub.group(1)) if sub.group(1) else None
            spans.append((closed[0], match.end(), step))
        if kind != "comment" and not text.isspace():
            closed = None
        pos = match.end()
    return spans


def _inside_label_list(history: list[str]) -> bool:
    """True inside ``by (...)``/``on (...)`` etc., where identifiers are label names."""
    depth = 0
    for k in range(len(history) - 1, -1, -1):
        token = history[k]
        if token == ")":
            depth += 1
        elif token == "(":
            if depth == 0:
                return k > 0 and history[k - 1] in _LABEL_LISTS
            depth -= 1
    return False


def _finish(
    expr: str, name: str | None, matchers: tuple[Matcher, ...], start: int, pos: int, history: list[str]
) -> Selector:
    range_seconds = None
    after = expr[pos:]
    stripped = after.lstrip()
    if stripped.startswith("[") and ":" not in stripped[: stripped.find("]")]:
        close = stripped.find("]")
        range_seconds = parse_duration(stripped[1:close].strip())
        pos += len(after) - len(stripped) + close + 1
    function = history[-2] if len(history) >= 2 and history[-1] == "(" else None
    return Selector(name, matchers, range_seconds, start, pos, function)


def rule_selectors(rules: RuleSet) -> list[Selector]:
    return [s for rule in rules.rules for s in selectors(rule.expr)]
