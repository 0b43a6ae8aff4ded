"""The fleet's workload: multi-node training jobs with periodic checkpoints and idle gaps between them.

Jobs set the baseline every signal moves with (utilisation, power, heat, interrupts, NFS traffic), so
that benign load changes look the same on healthy and failing nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gpuhealth.evaluation.scenario import Scenario


@dataclass
class Timeline:
    """Sample instants of the generated series: ``count`` samples every ``step`` seconds from ``start``."""

    start: float
    step: float
    count: int

    @classmethod
    def of(cls, scenario: Scenario) -> Timeline:
        count = int((scenario.end - scenario.data_start) // scenario.step) + 1
        return cls(scenario.data_start, scenario.step, count)

    def index(self, unix: float) -> int:
        """First sample index at or after ``unix``, clamped to the timeline."""
        return int(min(max(np.ceil((unix - self.start) / self.step), 0), self.count))

    @property
    def unix(self) -> np.ndarray:
        return self.start + self.step * np.arange(self.count)


@dataclass
class Workload:
    """Per node and sample: running job id (-1 idle) and whether a checkpoint is being written."""

    job: np.ndarray  # (nodes, samples) int64
    checkpoint: np.ndarray  # (nodes, samples) bool

    @property
    def busy(self) -> np.ndarray:
        return self.job >= 0


def schedule(scenario: Scenario, timeline: Timeline, rng: np.random.Generator) -> Workload:
    """Greedy scheduler: each job takes the nodes that free up first, runs, then they idle a while."""
    spec = scenario.workload
    nodes = scenario.fleet.nodes
    job = np.full((nodes, timeline.count), -1, dtype=np.int64)
    checkpoint = np.zeros((nodes, timeline.count), dtype=bool)
    free_at = timeline.start + rng.uniform(0, spec.idle_gap[1], nodes)
    end = timeline.start + timeline.step * timeline.count
    job_id = 100000 + int(rng.integers(0, 800000))
    while free_at.min() < end:
        width = int(rng.integers(spec.job_nodes[0], min(spec.job_nodes[1], nodes) + 1))
        members = np.argsort(free_at, kind="stable")[:width]
        begin = float(free_at[members].max())
        length = rng.uniform(*spec.job_duration)
        a, b = timeline.index(begin), timeline.index(begin + length)
        job[members, a:b] = job_id
        for ck in np.arange(begin + spec.checkpoint_every, begin + length, spec.checkpoint_every):
            c0, c1 = timeline.index(ck), timeline.index(ck + spec.checkpoint_duration)
            checkpoint[members, c0 : min(c1, b)] = True
        free_at[members] = begin + length + rng.uniform(*spec.idle_gap, width)
        job_id += 1
    return Workload(job, checkpoint)
