"""Stream metric families into OpenMetrics files, one per TSDB block window, for promtool to backfill:
the text form ``blocks.BlockWriter`` is held to, and the thinning both apply.

promtool (2.42) re-reads its whole input once per 2-hour block it creates, so a file per block window
keeps backfilling linear in the data. Samples that no query could tell apart from their neighbours are
dropped (see ``Thinning``), which keeps multi-week fleets within minutes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gpuhealth.evaluation.signals import Family
from gpuhealth.evaluation.workload import Timeline

BLOCK_SECONDS = 7200  # the TSDB's block range: promtool cuts blocks on these boundaries
LOOKBACK_SECONDS = 300  # Prometheus's default lookback for instant selectors


@dataclass(frozen=True)
class Thinning:
    """Which samples of a series may be left out without changing any query result.

    A sample is kept when a value change lies within ``reach`` seconds (so every range window that
    sees a change sees every sample), and on a ``grid`` that leaves at least two samples in every
    window of the shortest range and one within the lookback of every instant. ``reach`` 0 keeps all.
    """

    reach: float
    grid: float

    def keep(self, values: np.ndarray, step: float) -> np.ndarray:
        present = ~np.isnan(values)
        if self.reach <= 0:
            return present
        change = np.ones(values.size, dtype=bool)
        change[1:] = values[1:] != values[:-1]  # NaN != NaN, so appearing and vanishing count as changes
        span = math.ceil(self.reach / step)
        total = np.concatenate(([0], np.cumsum(change)))
        idx = np.arange(values.size)
        near = total[np.minimum(idx + span + 1, values.size)] - total[np.maximum(idx - span, 0)] > 0
        grid = max(1, int(self.grid // step))
        near |= idx % grid == 0
        near[-1] = True
        return near & present


def _value_texts(values: np.ndarray) -> np.ndarray:
    """Shortest exact text of each value; integers without a trailing ``.0``."""
    if np.all(values == np.trunc(values)) and np.all(np.abs(values) < 1e15):
        return values.astype(np.int64).astype(str)
    return values.astype(str)


class BlockFiles:
    """One OpenMetrics file per block window of the timeline, written family by family."""

    def __init__(self, directory: Path, timeline: Timeline) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.timeline = timeline
        unix = timeline.unix
        window = (unix // BLOCK_SECONDS).astype(np.int64)
        self.windows = np.unique(window)
        self.bounds = np.searchsorted(window, self.windows)  # first sample index of each window
        self.stamps = unix.astype(np.int64).astype(str)
        self.paths = [self.directory / f"block-{w * BLOCK_SECONDS}.om" for w in self.windows]
        self.files = [p.open("w", buffering=1 << 18) for p in self.paths]
        self.samples = 0

    def write(self, family: Family, thinning: Thinning) -> None:
        """Append the family to every window's file, series by series (memory stays one series)."""
        base = family.name[: -len("_total")] if family.kind == "counter" else family.name
        for handle in self.files:
            handle.write(f"# TYPE {base} {family.kind}\n")
        step = self.timeline.step
        # Neighbouring series often hold the same values (idle links, flags): format those once.
        last: tuple[bytes, list[int], list[str]] = (b"", [], [])
        for labels, values in family.series:
            key = values.tobytes()
            if key != last[0]:
                idx = np.flatnonzero(thinning.keep(values, step))
                texts = np.strings.add(np.strings.add(_value_texts(values[idx]), " "), self.stamps[idx])
                last = (key, [*np.searchsorted(idx, self.bounds).tolist(), idx.size], texts.tolist())
            _, cuts, pairs = last
            self.samples += len(pairs)
            prefix = f"{family.name}{{{labels}}} "
            separator = "\n" + prefix
            for w, handle in enumerate(self.files):
                if cuts[w] < cuts[w + 1]:
                    handle.write(prefix + separator.join(pairs[cuts[w] : cuts[w + 1]]) + "\n")

    def close(self) -> list[Path]:
        for handle in self.files:
            handle.write("# EOF\n")
            handle.close()
        return self.paths
