"""The Python half of bench/device_check.sh: what a real NVIDIA node answers, and what the exporter costs.

Read-only: only queries, never a reset, a clock, a mode or a limit change.

    calls   every NVML call the exporter makes, once per GPU, with its result or error and latency
            (nvml_calls.json, also under device/<profile>.json: the simulator's fixture format)
    scrape  200 timed scrapes, CPU and RSS over a window, sanity checks, one full scrape saved

``--backend sim`` runs both against the simulator, so the script is tested without a GPU.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil
from gpuhealth.exporter.nvml_errors import error_label
from gpuhealth.exporter.nvml_fields import DEVICE_FIELDS, LINK_FIELDS, RECOVERY_ACTION_FIELD
from prometheus_client.parser import text_string_to_metric_families

PROFILE_BY_MODEL = (("GB200", "gb200"), ("B200", "b200"), ("H200", "h200"), ("H100", "h100-sxm"))


def calls_for(nvml: Any, handle: Any) -> list[tuple[str, tuple]]:
    """(function name, arguments after the handle): every query the exporter makes of one GPU."""
    fields = [(getattr(nvml, s.field), 0) for s in (*DEVICE_FIELDS, *LINK_FIELDS)]  # link 0 for links
    fields.append((getattr(nvml, RECOVERY_ACTION_FIELD), 0))
    calls: list[tuple[str, tuple]] = [
        ("nvmlDeviceGetUUID", ()), ("nvmlDeviceGetPciInfo", ()), ("nvmlDeviceGetName", ()),
        ("nvmlDeviceGetSerial", ()), ("nvmlDeviceGetVbiosVersion", ()),
        ("nvmlDeviceGetTemperatureV", (nvml.NVML_TEMPERATURE_GPU,)),
        ("nvmlDeviceGetTemperature", (nvml.NVML_TEMPERATURE_GPU,)),
        *(("nvmlDeviceGetTemperatureThreshold", (t,)) for t in (
            nvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN, nvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN,
            nvml.NVML_TEMPERATURE_THRESHOLD_MEM_MAX)),
        ("nvmlDeviceGetPowerUsage", ()), ("nvmlDeviceGetEnforcedPowerLimit", ()),
        *((fn, (c,)) for fn in ("nvmlDeviceGetClockInfo", "nvmlDeviceGetMaxClockInfo")
          for c in (nvml.NVML_CLOCK_SM, nvml.NVML_CLOCK_MEM)),
        ("nvmlDeviceGetCurrentClocksEventReasons", ()), ("nvmlDeviceGetCurrentClocksThrottleReasons", ()),
        ("nvmlDeviceGetUtilizationRates", ()),
        ("nvmlDeviceGetMemoryInfo", (nvml.nvmlMemory_v2,)), ("nvmlDeviceGetMemoryInfo", ()),
        ("nvmlDeviceGetEccMode", ()),
        *(("nvmlDeviceGetTotalEccErrors", (e, c)) for e in (0, 1) for c in (0, 1)),
        *(("nvmlDeviceGetMemoryErrorCounter", (e, c, loc)) for e in (0, 1) for c in (0, 1)
          for loc in (nvml.NVML_MEMORY_LOCATION_DRAM, nvml.NVML_MEMORY_LOCATION_SRAM)),
        *(("nvmlDeviceGetRetiredPages", (c,)) for c in (
            nvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
            nvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)),
        ("nvmlDeviceGetRetiredPagesPendingStatus", ()), ("nvmlDeviceGetRemappedRows", ()),
        ("nvmlDeviceGetRowRemapperHistogram", ()), ("nvmlDeviceGetPcieReplayCounter", ()),
        ("nvmlDeviceGetCurrPcieLinkGeneration", ()), ("nvmlDeviceGetMaxPcieLinkGeneration", ()),
        ("nvmlDeviceGetCurrPcieLinkWidth", ()), ("nvmlDeviceGetMaxPcieLinkWidth", ()),
        ("nvmlDeviceGetNvLinkState", (0,)),
        ("nvmlDeviceGetNvLinkErrorCounter", (0, nvml.NVML_NVLINK_ERROR_DL_CRC_FLIT)),
        ("nvmlDeviceGetFieldValues", (fields,)),
        ("nvmlDeviceGetGpuFabricInfoV", ("fabric",)),
        ("nvmlDeviceGetComputeRunningProcesses", ()),
    ]
    return calls


def plain(value: Any) -> Any:
    """A JSON-able copy of what pynvml returned: ctypes structures, arrays, friendly objects."""
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    if isinstance(value, ctypes.Array):
        return [plain(v) for v in value]
    if isinstance(value, ctypes.Structure | ctypes.Union):
        return {name: plain(getattr(value, name)) for name, *_ in value._fields_}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if hasattr(value, "__dict__"):
        return {k: plain(v) for k, v in vars(value).items() if not k.startswith("_")}
    return repr(value)


def record_calls(nvml: Any) -> dict[str, Any]:
    nvml.nvmlInit()
    try:
        driver = str(nvml.nvmlSystemGetDriverVersion())
        count = nvml.nvmlDeviceGetCount()
        records = []
        model = ""
        for index in range(count):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            for name, args in calls_for(nvml, handle):
                fabric = None
                if args == ("fabric",):
                    fabric = nvml.c_nvmlGpuFabricInfoV_t()
                    args = (ctypes.byref(fabric),)
                start = time.perf_counter()
                try:
                    result, error = getattr(nvml, name)(handle, *args), None
                except Exception as exc:  # every outcome is data here, a mismatch included
                    result, error = None, error_label(exc)
                latency = time.perf_counter() - start
                if fabric is not None and error is None:
                    result = fabric
                if name == "nvmlDeviceGetName" and error is None:
                    model = plain(result)
                records.append({"call": name, "gpu": index, "args": plain(args if fabric is None else ()),
                                "result": plain(result), "error": error, "latency_seconds": latency})
        return {"model": model, "driver_version": driver, "gpus": count, "calls": records}
    finally:
        nvml.nvmlShutdown()


def profile_name(model: str) -> str | None:
    return next((name for needle, name in PROFILE_BY_MODEL if needle in model), None)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def sanity(text: str) -> list[str]:
    """Problems a healthy node should not show: every GPU up, all expected visible, physical ranges."""
    values: dict[str, list[tuple[dict, float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values.setdefault(sample.name, []).append((sample.labels, sample.value))
    problems = []
    ups = values.get("gpuhealth_gpu_up", [])
    if not ups:
        problems.append("no gpuhealth_gpu_up series")
    problems += [f"gpu {labels['gpu']} is down" for labels, v in ups if v != 1]
    expected = values.get("gpuhealth_gpus_expected", [({}, -1)])[0][1]
    visible = values.get("gpuhealth_gpus_visible", [({}, -2)])[0][1]
    if expected != visible:
        problems.append(f"gpus_expected {expected:g} != gpus_visible {visible:g}")
    ranges = {"gpuhealth_gpu_temperature_celsius": (5, 110),
              "gpuhealth_gpu_memory_temperature_celsius": (5, 120),
              "gpuhealth_gpu_power_watts": (1, 2000), "gpuhealth_gpu_utilization_ratio": (0, 1),
              "gpuhealth_gpu_sm_clock_hertz": (1e7, 4e9),
              "gpuhealth_gpu_memory_total_bytes": (1 << 30, 1 << 40)}
    for name, (low, high) in ranges.items():
        for labels, v in values.get(name, []):
            if not low <= v <= high:
                problems.append(f"{name}{labels} = {v:g} outside [{low:g}, {high:g}]")
    if values.get("gpuhealth_nvml_up", [({}, 0)])[0][1] != 1:
        problems.append("gpuhealth_nvml_up is not 1")
    return problems


def measure(url: str, pid: int, scrapes: int, window: float) -> dict[str, Any]:
    latencies = []
    for _ in range(scrapes):
        start = time.perf_counter()
        with urllib.request.urlopen(url, timeout=10) as resp:
            resp.read()
        latencies.append(time.perf_counter() - start)
    proc = psutil.Process(pid)
    times = proc.cpu_times()
    cpu_start, rss = times.user + times.system, []
    start = time.monotonic()
    while time.monotonic() - start < window:
        rss.append(proc.memory_info().rss / 2**20)
        time.sleep(1.0)
    times = proc.cpu_times()
    cpu = (times.user + times.system - cpu_start) / (time.monotonic() - start)
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    ms = [s * 1000 for s in latencies]
    return {"scrapes": scrapes, "p50_ms": statistics.median(ms), "p99_ms": percentile(ms, 0.99),
            "cpu_percent_of_one_core": cpu * 100, "window_seconds": window,
            "rss_mb_first": rss[0] if rss else None, "rss_mb_last": rss[-1] if rss else None,
            "rss_mb_max": max(rss, default=None), "problems": sanity(text), "exposition": text}


def _nvml(backend: str) -> Any:
    if backend == "sim":
        from gpuhealth.exporter.sim.nvml import SimulatedNvml
        from gpuhealth.exporter.sim.scenario import Scenario

        return SimulatedNvml(Scenario(gpus=2, nvlinks=2))
    import pynvml

    return pynvml


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    calls = sub.add_parser("calls", help="call every NVML query once; write nvml_calls.json")
    calls.add_argument("--backend", choices=("nvml", "sim"), default="nvml")
    calls.add_argument("--out", type=Path, required=True)
    scrape = sub.add_parser("scrape", help="time scrapes of a running exporter; write summary.json")
    scrape.add_argument("--url", required=True)
    scrape.add_argument("--pid", type=int, required=True)
    scrape.add_argument("--scrapes", type=int, default=200)
    scrape.add_argument("--window", type=float, default=60.0, help="seconds of CPU and RSS measurement")
    scrape.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.command == "calls":
        recorded = record_calls(_nvml(args.backend))
        text = json.dumps(recorded, indent=1, sort_keys=True)
        (args.out / "nvml_calls.json").write_text(text)
        name = profile_name(recorded["model"])
        if name is not None:
            (args.out / "device").mkdir(exist_ok=True)
            (args.out / "device" / f"{name}.json").write_text(text)
        failed = sorted({f"{c['call']}: {c['error']}" for c in recorded["calls"] if c["error"]})
        print(f"{recorded['gpus']} GPUs, {recorded['model']}, driver {recorded['driver_version']}, "
              f"{len(recorded['calls'])} calls, profile {name}")
        print("refused: " + ("; ".join(failed) or "none"))
        return 0
    summary = measure(args.url, args.pid, args.scrapes, args.window)
    (args.out / "scrape.prom").write_text(summary.pop("exposition"))
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return 1 if summary["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
