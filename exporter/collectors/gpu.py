"""Per-GPU NVML telemetry plus the features only high-rate sampling can give.

Each GPU is sampled on its own guarded worker with its own deadline, so a hung or lost GPU is marked
down while the others keep reporting. The GPUs are sampled one after another (together once one has
missed its deadline), so a scrape meets one busy sampling thread rather than one per GPU. When every
GPU misses its deadline at once, that is a stall of the driver (a GSP timeout usually stalls NVML
node-wide), reported as ``gpuhealth_nvml_stalled`` rather than as every GPU lost. Window maxima
(temperature, NVML latency) cover the last ``window_seconds``, about one scrape interval, so a spike
between scrapes is not lost.
"""

from __future__ import annotations

import collections
import functools
import logging
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from gpuhealth.exporter.collector import GPU_IDENTITIES, GPU_PROCESSES, Context, register
from gpuhealth.exporter.guard import DeadlineExceeded, GuardedWorker
from gpuhealth.exporter.inventory import GpuIdentity, nvidia_gpus_on_pci
from gpuhealth.exporter.metrics import RECOVERY_ACTIONS, Families, Family, Series
from gpuhealth.exporter.nvml_errors import GpuDown, NvmlDown, error_label
from gpuhealth.exporter.nvml_reader import CLOCK_EVENT_REASONS, GpuReading

log = logging.getLogger(__name__)

PREINITIALISED_ERRORS = ("gpu_is_lost", "timeout", "unknown")
# Counters, health fields and link state move slowly and cost most of a sample: read them every few
# seconds (still several times per 15 s scrape), the temperatures, clocks and load every second.
FULL_EVERY_SECONDS = 5.0
SAMPLE = "sample"  # the query label of errors that marked the GPU down
Outcome = tuple[GpuIdentity | None, GpuReading, float] | BaseException  # one GPU's sample, or why none


def _by_family(gpu: str, samples: list[tuple[str, tuple[str, ...], float]]) -> dict[str, list[Series]]:
    """A reading's samples as ready series by family (the reader's labels are text already): a
    full reading's are published unchanged for several runs (FULL_EVERY_SECONDS), so they are
    labelled once, not added one by one at every run."""
    families: dict[str, list[Series]] = {}
    for name, labels, value in samples:
        families.setdefault(name, []).append(((gpu, *labels), value))
    return families


@functools.cache
def _labels(gpu: str) -> tuple[tuple[tuple[str, str], ...], dict[str, tuple[str, str]]]:
    """The label values of a GPU's series that every run publishes for each recovery action and
    clock-event reason: built once per GPU, not at every run."""
    return tuple((gpu, action) for action in RECOVERY_ACTIONS), {r: (gpu, r) for r in CLOCK_EVENT_REASONS}


@dataclass
class GpuTrack:
    """What the collector remembers about one GPU between samples."""

    up: bool = False
    visible: bool = True
    errors: collections.Counter[tuple[str, str]] = field(default_factory=lambda: collections.Counter(
        {(error, SAMPLE): 0 for error in PREINITIALISED_ERRORS}))
    # (t, temperature, latency)
    window: collections.deque[tuple[float, float | None, float]] = field(default_factory=collections.deque)
    clock_event_seconds: dict[str, float] = field(default_factory=dict)
    last_sample: float | None = None
    reading: GpuReading | None = None
    fast: dict[str, list[Series]] = field(default_factory=dict)  # the last reading's, by family
    slow: dict[str, list[Series]] = field(default_factory=dict)  # the last full reading's, by family
    slowdown_threshold: float | None = None
    driver_clock_event_reasons: set[str] = field(default_factory=set)
    last_full: float | None = None
    recovery_action: str | None = None  # last polled from NVML


@register("gpu", "NVML per-GPU telemetry, identity and derived features", needs=[GPU_IDENTITIES],
          provides=[GPU_PROCESSES])
class GpuCollector:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.reader = ctx.reader
        self.tracks: dict[int, GpuTrack] = {}
        self.expected = ctx.gpus_expected
        self.stalled = False

    def _sample(self, index: int, known: bool, full: bool) -> tuple[GpuIdentity | None, GpuReading, float]:
        """Runs on the GPU's worker; shared state is only updated by the sampling thread. The identity
        is read here only when the inventory step could not (no step in tests, or it failed)."""
        start = self.ctx.clock()
        identity = None if known else self.reader.identity(index)
        reading = self.reader.read(index, full)
        return identity, reading, self.ctx.clock() - start

    def _full_due(self, index: int) -> bool:
        track = self.tracks.get(index)
        return track is None or track.last_full is None or \
            self.ctx.clock() - track.last_full >= FULL_EVERY_SECONDS

    def collect(self) -> Iterator[Family]:
        ctx, session = self.ctx, self.ctx.nvml_session
        if self.expected is None and ctx.sysfs is not None:
            self.expected = nvidia_gpus_on_pci(ctx.sysfs) or None  # none on the bus: ask NVML
        if not session.up:  # the inventory step, run first, initialises NVML or notices it lost
            yield from self._families(sorted(self.tracks), nvml_up=False)
            return
        count = ctx.inventory.count  # counted by the inventory step, which runs first
        if self.expected is None:  # no readable sysfs: the count NVML sees first
            self.expected = count
        indices = sorted(set(range(count)) | set(ctx.inventory.gpus) | set(self.tracks))
        outcomes = self._sample_all(indices)
        timed_out = [i for i, o in outcomes.items() if isinstance(o, DeadlineExceeded)]
        stalled = len(indices) > 1 and len(timed_out) == len(indices)
        if stalled != self.stalled:
            log.warning("nvml stall %s gpus=%d", "began" if stalled else "ended", len(indices))
        self.stalled = stalled
        for index, outcome in outcomes.items():
            track = self.tracks.get(index) or self.tracks.setdefault(index, GpuTrack())  # not built per run
            if isinstance(outcome, NvmlDown):
                session.lost(outcome.error)
                self._down(index, track, outcome, index < count)
            elif stalled:
                track.reading, track.fast, track.slow = None, {}, {}  # no fresh data; not a lost GPU either
                self._remember(track, ctx.clock(), None, ctx.nvml_timeout_seconds)
            elif isinstance(outcome, BaseException):
                self._down(index, track, outcome, index < count)
            else:
                identity, reading, latency = outcome
                if identity is not None:
                    ctx.inventory.add(identity)
                self._up(index, track, reading, latency)
        yield from self._families(indices, nvml_up=session.up)

    def _sample_all(self, indices: list[int]) -> dict[int, Outcome]:
        """Each GPU on its own worker with its own deadline (``--nvml.timeout``), one GPU at a time:
        only one worker then competes for the GIL with a scrape. When a GPU misses its deadline, the
        rest start together and their deadlines overlap, so a run waits two timeouts at most however
        many GPUs hang, and a node-wide stall is still every GPU missing its deadline in one run."""
        ctx = self.ctx
        outcomes: dict[int, Outcome] = {}
        overlapping: dict[int, tuple[Future[Any], float]] = {}
        for index in indices:
            future = ctx.worker(f"gpu{index}").submit(
                functools.partial(self._sample, index, index in ctx.inventory.gpus, self._full_due(index)))
            deadline = time.monotonic() + ctx.nvml_timeout_seconds  # from the submission, in real time
            if overlapping or any(isinstance(o, DeadlineExceeded) for o in outcomes.values()):
                overlapping[index] = (future, deadline)
            else:
                outcomes[index] = self._outcome(future, deadline)
        for index, (future, deadline) in overlapping.items():
            outcomes[index] = self._outcome(future, deadline)
        return outcomes

    @staticmethod
    def _outcome(future: Future[Any], deadline: float) -> Outcome:
        try:
            result: Outcome = GuardedWorker.result(future, deadline - time.monotonic())
        except (DeadlineExceeded, GpuDown) as exc:
            return exc
        return result

    def _down(self, index: int, track: GpuTrack, exc: BaseException, enumerated: bool) -> None:
        error = error_label(exc)
        if track.up or track.last_sample is None:
            log.warning("gpu down gpu=%d error=%s detail=%s", index, error, exc)
        track.up = False
        track.visible = enumerated and error != "gpu_is_lost"
        track.errors[(error, SAMPLE)] += 1
        track.reading, track.fast, track.slow, track.last_full = None, {}, {}, None
        self.ctx.inventory.processes.pop(index, None)
        now = self.ctx.clock()
        latency = self.ctx.nvml_timeout_seconds if error == "timeout" else 0.0
        self._remember(track, now, None, latency)

    def _up(self, index: int, track: GpuTrack, reading: GpuReading, latency: float) -> None:
        now = self.ctx.clock()
        if not track.up and track.last_sample is not None:
            log.info("gpu up gpu=%d", index)
        if reading.full:
            track.slow, track.last_full = _by_family(str(index), reading.slow), now
            track.slowdown_threshold = reading.slowdown_threshold
            track.driver_clock_event_reasons = reading.driver_clock_event_reasons
        for reason, active in reading.clock_events.items():
            if reason in track.driver_clock_event_reasons:
                continue  # the driver's own counter is exact
            seconds = track.clock_event_seconds.setdefault(reason, 0.0)
            if active and track.up and track.last_sample is not None:
                track.clock_event_seconds[reason] = seconds + (now - track.last_sample)
        track.errors.update(reading.errors)
        if reading.recovery_action is not None:
            track.recovery_action = reading.recovery_action
        track.up, track.visible, track.reading = True, True, reading
        track.fast = _by_family(str(index), reading.samples)
        self.ctx.inventory.processes[index] = reading.pids
        self._remember(track, now, reading.temperature, latency)

    def _remember(self, track: GpuTrack, now: float, temperature: float | None, latency: float) -> None:
        track.last_sample = now
        track.window.append((now, temperature, latency))
        while track.window and track.window[0][0] < now - self.ctx.window_seconds:
            track.window.popleft()

    def _families(self, indices: list[int], nvml_up: bool) -> Iterator[Family]:
        f = Families()
        session = self.ctx.nvml_session
        f.add("gpuhealth_nvml_up", int(nvml_up))
        f.add("gpuhealth_nvml_stalled", int(self.stalled and nvml_up))
        for error, count in sorted(session.init_errors.items()):
            f.add("gpuhealth_nvml_init_errors_total", count, [error])
        f.add("gpuhealth_gpus_expected", self.expected or 0)
        f.add("gpuhealth_gpus_visible", sum(self.tracks[i].visible for i in indices) if nvml_up else 0)
        inventory = self.ctx.inventory
        for index in indices:
            gpu, track = str(index), self.tracks[index]
            action_labels, reason_labels = _labels(gpu)
            identity = inventory.gpus.get(index)
            if identity is not None:
                f.add("gpuhealth_gpu_info", 1, [gpu, identity.uuid, identity.pci_bus_id, identity.model,
                                                identity.serial, inventory.driver_version,
                                                identity.vbios_version])
            f.add("gpuhealth_gpu_up", int(track.up and nvml_up), [gpu])
            for (error, query), count in sorted(track.errors.items()):
                f.add("gpuhealth_gpu_nvml_errors_total", count, [gpu, error, query])
            if track.window:
                f.add("gpuhealth_gpu_nvml_latency_seconds", max(latency for _, _, latency in track.window),
                      [gpu])
            requested = track.recovery_action or inventory.logged_recovery.get(gpu, "none")
            f.extend("gpuhealth_gpu_recovery_action",
                     [(labels, float(labels[1] == requested)) for labels in action_labels])
            if track.reading is None:
                continue
            for name, series in track.fast.items():
                f.extend(name, series)
            for name, series in track.slow.items():
                f.extend(name, series)
            temperatures = [t for _, t, _ in track.window if t is not None]
            if temperatures:
                f.add("gpuhealth_gpu_temperature_max_celsius", max(temperatures), [gpu])
                if track.slowdown_threshold is not None:
                    f.add("gpuhealth_gpu_temperature_slowdown_margin_celsius",
                          track.slowdown_threshold - max(temperatures), [gpu])
            seconds = track.clock_event_seconds
            f.extend("gpuhealth_gpu_clock_event_seconds_total",
                     [(labels, seconds[reason]) for reason, labels in reason_labels.items()
                      if reason in seconds])
        yield from f
