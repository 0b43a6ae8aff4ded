"""Which test file starts first: the longest, by the seconds a previous run measured (tests/conftest.py
applies it; test.sh hands files to the workers in that order)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeVar

T = TypeVar("T")


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def longest_first(items: list[T], nodeid: Callable[[T], str], known: Mapping[str, float]) -> list[T]:
    """``items`` with the longest files first; each file's tests stay together and in their order. A
    file not measured yet counts as the longest, so that a new slow file cannot end up last."""
    unmeasured = max(known.values(), default=0.0)
    return sorted(items, key=lambda item: -known.get(file_of(nodeid(item)), unmeasured))


def merged(known: Mapping[str, float], measured: Mapping[str, float]) -> dict[str, float]:
    """The durations file after a run: the files it ran measured anew, the others kept."""
    return dict(sorted({**known, **{path: round(seconds, 1) for path, seconds in measured.items()}}.items()))
