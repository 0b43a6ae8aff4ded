"""Per-GPU NVML telemetry plus the features only high-rate sampling can give.

Each GPU is sampled on its own guarded worker with a deadline, so a hung or lost GPU is marked down
while the others keep reporting. Window maxima (temperature, NVML latency) cover the last
``window_seconds``, about one scrape interval, so a spike between scrapes is not lost.
"""

from __future__ import annotations

import collections
import functools
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

from gpuhealth.exporter.collector import Context, register
from gpuhealth.exporter.guard import DeadlineExceeded, GuardedWorker
from gpuhealth.exporter.inventory import GpuIdentity
from gpuhealth.exporter.metrics import Families
from gpuhealth.exporter.nvml_reader import CLOCK_EVENT_REASONS, GpuReading, NvmlReader
from prometheus_client.core import Metric

log = logging.getLogger(__name__)

PREINITIALISED_ERRORS = ("gpu_is_lost", "timeout", "unknown")


def error_label(exc: BaseException) -> str:
    """``NVMLError_GpuIsLost`` -> ``gpu_is_lost``; a missed deadline -> ``timeout``."""
    if isinstance(exc, DeadlineExceeded):
        return "timeout"
    name = type(exc).__name__.removeprefix("NVMLError_").removeprefix("NVMLError")
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower() or "unknown"


@dataclass
class GpuTrack:
    """What the collector remembers about one GPU between samples."""

    up: bool = False
    visible: bool = True
    errors: collections.Counter = field(default_factory=lambda: collections.Counter(
        dict.fromkeys(PREINITIALISED_ERRORS, 0)))
    window: collections.deque = field(default_factory=collections.deque)  # (t, temperature, latency)
    clock_event_seconds: dict[str, float] = field(default_factory=dict)
    last_sample: float | None = None
    reading: GpuReading | None = None


@register("gpu", "NVML per-GPU telemetry, identity and derived features")
class GpuCollector:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.reader = NvmlReader(ctx.nvml)
        self.workers: dict[int, GuardedWorker] = {}
        self.tracks: dict[int, GpuTrack] = {}
        self.expected = ctx.gpus_expected
        self.node_worker = GuardedWorker("nvml-node")
        self.count = 0

    def _worker(self, index: int) -> GuardedWorker:
        if index not in self.workers:
            self.workers[index] = GuardedWorker(f"nvml-gpu{index}")
        return self.workers[index]

    def _sample(self, index: int, known: bool) -> tuple[GpuIdentity | None, GpuReading, float]:
        """Runs on the GPU's worker; shared state is only updated by the sampling thread."""
        start = self.ctx.clock()
        identity = None if known else self.reader.identity(index)
        reading = self.reader.read(index)
        return identity, reading, self.ctx.clock() - start

    def collect(self) -> Iterator[Metric]:
        nvml, ctx = self.ctx.nvml, self.ctx
        try:
            self.count = GuardedWorker.result(self.node_worker.submit(nvml.nvmlDeviceGetCount),
                                              ctx.nvml_timeout_seconds)
        except (DeadlineExceeded, nvml.NVMLError) as exc:  # keep sampling the GPUs known so far
            log.warning("gpu count failed error=%s", error_label(exc))
        count = self.count
        if self.expected is None:
            self.expected = count
        indices = sorted(set(range(count)) | set(ctx.inventory.gpus) | set(self.tracks))
        started = ctx.clock()
        futures = {i: self._worker(i).submit(functools.partial(self._sample, i, i in ctx.inventory.gpus))
                   for i in indices}
        for index, future in futures.items():
            track = self.tracks.setdefault(index, GpuTrack())
            remaining = ctx.nvml_timeout_seconds - (ctx.clock() - started)
            try:
                identity, reading, latency = GuardedWorker.result(future, remaining)
            except (DeadlineExceeded, nvml.NVMLError) as exc:
                self._down(index, track, exc, index < count)
                continue
            if identity is not None:
                ctx.inventory.add(identity)
            self._up(index, track, reading, latency)
        yield from self._families(indices)

    def _down(self, index: int, track: GpuTrack, exc: BaseException, enumerated: bool) -> None:
        error = error_label(exc)
        if track.up or track.last_sample is None:
            log.warning("gpu down gpu=%d error=%s detail=%s", index, error, exc)
        track.up = False
        track.visible = enumerated and error != "gpu_is_lost"
        track.errors[error] += 1
        track.reading = None
        self.ctx.inventory.processes.pop(index, None)
        now = self.ctx.clock()
        latency = self.ctx.nvml_timeout_seconds if error == "timeout" else 0.0
        self._remember(track, now, None, latency)

    def _up(self, index: int, track: GpuTrack, reading: GpuReading, latency: float) -> None:
        now = self.ctx.clock()
        if not track.up and track.last_sample is not None:
            log.info("gpu up gpu=%d", index)
        for reason, active in reading.clock_events.items():
            seconds = track.clock_event_seconds.setdefault(reason, 0.0)
            if active and track.up and track.last_sample is not None:
                track.clock_event_seconds[reason] = seconds + (now - track.last_sample)
        track.up, track.visible, track.reading = True, True, reading
        self.ctx.inventory.processes[index] = reading.pids
        self._remember(track, now, reading.temperature, latency)

    def _remember(self, track: GpuTrack, now: float, temperature: float | None, latency: float) -> None:
        track.last_sample = now
        track.window.append((now, temperature, latency))
        while track.window and track.window[0][0] < now - self.ctx.window_seconds:
            track.window.popleft()

    def _families(self, indices: list[int]) -> Iterator[Metric]:
        f = Families()
        f.add("gpuhealth_gpus_expected", self.expected or 0)
        f.add("gpuhealth_gpus_visible", sum(self.tracks[i].visible for i in indices))
        inventory = self.ctx.inventory
        for index in indices:
            gpu, track = str(index), self.tracks[index]
            identity = inventory.gpus.get(index)
            if identity is not None:
                f.add("gpuhealth_gpu_info", 1, [gpu, identity.uuid, identity.pci_bus_id, identity.model,
                                                identity.serial, inventory.driver_version,
                                                identity.vbios_version])
            f.add("gpuhealth_gpu_up", int(track.up), [gpu])
            for error, count in sorted(track.errors.items()):
                f.add("gpuhealth_gpu_nvml_errors_total", count, [gpu, error])
            f.add("gpuhealth_gpu_nvml_latency_seconds", max(latency for _, _, latency in track.window), [gpu])
            if track.reading is None:
                continue
            for name, labels, value in track.reading.samples:
                f.add(name, value, [gpu, *labels])
            temperatures = [t for _, t, _ in track.window if t is not None]
            if temperatures:
                f.add("gpuhealth_gpu_temperature_max_celsius", max(temperatures), [gpu])
                if track.reading.slowdown_threshold is not None:
                    f.add("gpuhealth_gpu_temperature_slowdown_margin_celsius",
                          track.reading.slowdown_threshold - max(temperatures), [gpu])
            for reason in CLOCK_EVENT_REASONS:
                if reason in track.clock_event_seconds:
                    f.add("gpuhealth_gpu_clock_event_seconds_total", track.clock_event_seconds[reason],
                          [gpu, reason])
        yield from f
