"""Where the exporter's sampling CPU goes: CPU per sampling run, and how much of it the simulator is.

``bench/exporter.py`` measures the whole process (sampling, scrapes and the simulated NVML together).
This runs the exporter's collectors in-process on the simulator, once a second in real time as the
exporter does, and splits the process CPU into what was spent inside simulated NVML calls (on a
real node: the driver's own cost, which the simulator stands in for) and everything else (the
exporter's own work). Run it once per collector choice to see what a collector adds.

    .venv/bin/python bench/exporter_profile.py --sim-profile b200 --runs 60
    .venv/bin/python bench/exporter_profile.py --sim-profile b200 --no-collector fabric
    .venv/bin/python bench/exporter_profile.py --sim-profile b200 --baseline main   # then the same at main

A simulated call is timed by the thread's CPU clock around its outermost entry. The timing itself
(two clock reads per call, a few hundred calls a run) is measured on an empty call before the runs
and printed apart, taken out of the exporter's share.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import gzip
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpuhealth.exporter.collector import Context, assemble, load_collectors
from gpuhealth.exporter.fabric_settings import FabricSettings
from gpuhealth.exporter.sampler import Sampler
from gpuhealth.exporter.sim.fabric import NIC_RATE_GBPS
from gpuhealth.exporter.sim.nvml import SimulatedNvml
from gpuhealth.exporter.sim.nvml_current import NvmlCurrent
from gpuhealth.exporter.sim.profiles import PROFILES, load_profile
from gpuhealth.exporter.sim.scenario import load_scenario


class SimClock:
    """CPU seconds spent inside simulated NVML calls, by every thread."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._inside = threading.local()
        self._lock = threading.Lock()

    def timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._inside, "depth", 0):  # a simulated call made by another one
                return fn(*args, **kwargs)
            self._inside.depth = 1
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.thread_time() - start
                self._inside.depth = 0
                with self._lock:
                    self.seconds += spent
                    self.calls += 1
        return call

    def overhead(self, calls: int = 20000) -> float:
        """CPU seconds the timing adds to one call, from an empty function timed and not."""
        def empty() -> None:
            return None
        timed = self.timed(empty)
        start = time.process_time()
        for _ in range(calls):
            empty()
        bare = time.process_time() - start
        start = time.process_time()
        for _ in range(calls):
            timed()
        cost = (time.process_time() - start - bare) / calls
        self.seconds, self.calls = 0.0, 0
        return max(cost, 0.0)


def timed_simulator(clock: SimClock) -> type[SimulatedNvml]:
    """A subclass of the simulator whose every NVML entry point is timed."""
    members = {name: member for cls in (NvmlCurrent, SimulatedNvml) for name, member in vars(cls).items()
               if name.startswith("nvml") and callable(member)}
    return type("TimedSimulatedNvml", (SimulatedNvml,), {name: clock.timed(m) for name, m in members.items()})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sim-profile", default="h100-sxm", choices=sorted(PROFILES))
    parser.add_argument("--runs", type=int, default=60, help="sampling runs, one a second (default 60)")
    parser.add_argument("--no-collector", action="append", default=[], metavar="NAME",
                        choices=sorted(load_collectors()), help="leave a collector out (repeatable)")
    parser.add_argument("--baseline", metavar="REF", help="then measure the exporter as it was at this git "
                        "commit or branch the same way (its exporter/ and gpuhealth/ trees, this venv)")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="gpuhealth-profile-"))
    try:
        status = profile(args, workdir)
        if args.baseline:
            from exporter import baseline_tree  # bench/exporter.py, beside this script

            tree = baseline_tree(args.baseline, workdir)
            argv = [a for a in sys.argv[1:] if a != "--baseline" and not a.startswith("--baseline=")
                    and a != args.baseline]
            print(f"at {args.baseline}:", flush=True)
            # from the tree, which then comes before this checkout on the path
            script = str(Path(__file__).resolve())
            status = subprocess.run([sys.executable, script, *argv], check=False, cwd=tree,
                                    env={**os.environ, "PYTHONPATH": str(tree)}).returncode
        return status
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def switch_interval() -> float:
    """The exporter's GIL switch interval, as the code measured (a ``--baseline`` tree's own: 0.2 ms before
    the sampler module named it)."""
    return float(getattr(sys.modules[Sampler.__module__], "SWITCH_INTERVAL_SECONDS", 0.0002))


def simulated_sampler(profile_name: str, workdir: Path, no_collector: list[str],
                      nvml_class: type[SimulatedNvml] = SimulatedNvml) -> Sampler:
    """The exporter's sampler over 8 simulated GPUs of ``profile_name``, wired as ``--backend sim`` does."""
    hardware = load_profile(profile_name)
    scenario = dataclasses.replace(load_scenario(None), model=hardware.model, nvlinks=hardware.nvlinks)
    nvml = nvml_class(scenario, workdir / "kmsg", profile=hardware, sysfs=workdir / "sys")
    fabric = FabricSettings(systemctl=(), manager_pid_file=nvml.fabric_manager_pid_file,
                            expected_rate_gbps=NIC_RATE_GBPS)
    ctx = Context(nvml=nvml, sysfs=workdir / "sys", kmsg_path=workdir / "kmsg", fabric=fabric)
    collectors, steps = assemble(ctx, dict.fromkeys(no_collector, False))
    if hasattr(ctx, "priority"):  # a --baseline whose sampling gave way to scrapes (17b0bf1 to e4feac5)
        return Sampler(collectors, steps=steps, priority=ctx.priority)
    return Sampler(collectors, steps=steps)


def profile(args: argparse.Namespace, workdir: Path) -> int:
    sim_clock = SimClock()
    sampler = simulated_sampler(args.sim_profile, workdir, args.no_collector, timed_simulator(sim_clock))
    collectors = sampler.collectors
    sys.setswitchinterval(switch_interval())  # as the exporter runs
    sampler.sample_once()
    gc.freeze()
    load_start = os.getloadavg()[0]
    per_call = sim_clock.overhead()
    cpu_start = time.process_time()
    next_run = time.monotonic()
    for _ in range(args.runs):
        sampler.sample_once()
        next_run += 1.0
        time.sleep(max(0.0, next_run - time.monotonic()))
    cpu = (time.process_time() - cpu_start) / args.runs
    simulated = sim_clock.seconds / args.runs
    timing = sim_clock.calls * per_call / args.runs
    sampler.stop()
    print(f"exporter code from {Path(sys.modules[Sampler.__module__].__file__ or '').parent}")
    print(f"profile {args.sim_profile}, collectors {','.join(collectors)}, {args.runs} runs a second apart, "
          f"load average {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end "
          f"({os.cpu_count()} CPUs), {len(sampler.exposition) // 1024} KB exposition")
    cpu -= timing
    print(f"CPU per sampling run {cpu * 1000:.2f} ms ({cpu * 100:.2f} % of one core): "
          f"exporter {(cpu - simulated) * 1000:.2f} ms, simulated NVML {simulated * 1000:.2f} ms "
          f"({simulated / cpu * 100:.0f} %); the timing's own {timing * 1000:.2f} ms "
          f"({sim_clock.calls / args.runs:.0f} calls a run) left out")
    level = getattr(sys.modules[Sampler.__module__], "GZIP_LEVEL", None)  # None: before 17b0bf1
    if level is not None:
        start, body = time.process_time(), sampler.exposition
        for _ in range(20):
            zipped = gzip.compress(body, level, mtime=0)
        print(f"gzip at level {level}: {(time.process_time() - start) / 20 * 1000:.2f} ms "
              f"({len(body) // 1024} KB to {len(zipped) // 1024} KB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
