"""Collectors declare what they need from each other; GPU identities come from a step run before them."""

from __future__ import annotations

from pathlib import Path

import pytest
from exporter_helpers import FakeClock, sim_context, value
from gpuhealth.exporter.collector import (
    GPU_IDENTITIES,
    GPU_PROCESSES,
    Registration,
    assemble,
    load_collectors,
    run_order,
    unmet_needs,
)
from gpuhealth.exporter.sampler import Sampler

XID_LINES = [  # the simulator's GPU 0 is at 0000:18:00, GPU 1 at 0000:2a:00
    "3,100,5000,-;NVRM: Xid (PCI:0000:18:00): 31, pid=77, name=python, Ch 00000008",
    "3,101,5001,-;NVRM: Xid (PCI:0000:2a:00): 79, GPU has fallen off the bus.",
]
ONLY_XID = {"gpu": False, "host": False, "nfs": False, "jobs": False, "fabric": False}


def _sampler(tmp_path: Path, clock: FakeClock, choices: dict[str, bool]) -> tuple[Sampler, Path]:
    ctx = sim_context({"gpus": 2, "nvlinks": 0}, clock, kmsg_path=tmp_path / "kmsg")
    collectors, steps = assemble(ctx, choices)
    return Sampler(collectors, steps=steps, clock=clock), tmp_path / "kmsg"


def test_kernel_xids_map_to_gpus_without_the_gpu_collector(tmp_path: Path, clock: FakeClock) -> None:
    sampler, kmsg = _sampler(tmp_path, clock, ONLY_XID)
    assert list(sampler.collectors) == ["xid"]
    sampler.sample_once()
    with kmsg.open("a") as fh:
        fh.writelines(f"{line}\n" for line in XID_LINES)
    text = sampler.sample_once().decode()
    assert value(text, "gpuhealth_xid_events_total", gpu="0", xid="31") == 1
    assert value(text, "gpuhealth_xid_events_total", gpu="1", xid="79") == 1
    assert value(text, "gpuhealth_xid_events_total", gpu="unknown", xid="79") is None
    assert "gpuhealth_gpu_up" not in text  # the gpu collector stayed off; only the step asked NVML


def test_without_the_step_kernel_xids_are_unknown(tmp_path: Path, clock: FakeClock) -> None:
    """What the step prevents: the xid collector alone cannot name the GPU of a PCI address."""
    sampler, kmsg = _sampler(tmp_path, clock, ONLY_XID)
    sampler.steps = ()
    sampler.sample_once()
    with kmsg.open("a") as fh:
        fh.writelines(f"{line}\n" for line in XID_LINES)
    text = sampler.sample_once().decode()
    assert value(text, "gpuhealth_xid_events_total", gpu="unknown", xid="31") == 1


def test_identities_are_read_once_and_the_gpu_collector_uses_them(tmp_path: Path, clock: FakeClock) -> None:
    sampler, _ = _sampler(tmp_path, clock, {"host": False, "nfs": False})
    calls: list[int] = []
    nvml = sampler.collectors["gpu"].ctx.nvml
    real_uuid = nvml.nvmlDeviceGetUUID
    nvml.nvmlDeviceGetUUID = lambda handle: calls.append(1) or real_uuid(handle)
    for _ in range(3):
        text = sampler.sample_once().decode()
        clock.advance(1)
    assert len(calls) == 2  # one per GPU, by the step; the collector found them known
    assert value(text, "gpuhealth_gpu_up", gpu="1") == 1
    assert 'gpuhealth_gpu_info{' in text


def test_one_gpu_count_per_run_and_the_collector_reads_the_steps(tmp_path: Path, clock: FakeClock) -> None:
    """The step counts the GPUs; the gpu collector samples what it counted without asking again."""
    sampler, _ = _sampler(tmp_path, clock, {"host": False, "nfs": False})
    nvml = sampler.collectors["gpu"].ctx.nvml
    counts: list[int] = []
    real_count = nvml.nvmlDeviceGetCount
    nvml.nvmlDeviceGetCount = lambda: counts.append(1) or real_count()
    for _ in range(3):
        text = sampler.sample_once().decode()
        clock.advance(1)
    assert len(counts) == 3
    assert value(text, "gpuhealth_gpus_visible") == 2 and value(text, "gpuhealth_gpu_up", gpu="1") == 1


def test_a_count_that_finds_nvml_lost_keeps_the_run_down(tmp_path: Path, clock: FakeClock) -> None:
    """NVML lost while counting: this run publishes nvml_up 0; the next run initialises it again."""
    sampler, _ = _sampler(tmp_path, clock, {"host": False, "nfs": False})
    nvml = sampler.collectors["gpu"].ctx.nvml
    assert value(sampler.sample_once().decode(), "gpuhealth_nvml_up") == 1
    real_count = nvml.nvmlDeviceGetCount
    nvml.nvmlDeviceGetCount = lambda: (_ for _ in ()).throw(nvml.NVMLError(nvml.NVML_ERROR_UNINITIALIZED))
    clock.advance(1)
    assert value(sampler.sample_once().decode(), "gpuhealth_nvml_up") == 0
    nvml.nvmlDeviceGetCount = real_count
    clock.advance(1)
    text = sampler.sample_once().decode()
    assert value(text, "gpuhealth_nvml_up") == 1 and value(text, "gpuhealth_gpu_up", gpu="0") == 1


def _reg(name: str, needs: tuple[str, ...] = (), provides: tuple[str, ...] = ()) -> Registration:
    return Registration(name, lambda ctx: None, name, True, frozenset(needs), frozenset(provides))


def test_run_order_follows_needs_not_names() -> None:
    order = run_order([_reg("a", needs=("x",)), _reg("b"), _reg("z", provides=("x",))])
    assert [reg.name for reg in order] == ["b", "z", "a"]
    with pytest.raises(ValueError, match="need each other"):
        run_order([_reg("a", needs=("x",), provides=("y",)), _reg("b", needs=("y",), provides=("x",))])


def test_declared_needs_of_the_shipped_collectors() -> None:
    registrations = load_collectors()
    assert GPU_IDENTITIES in registrations["xid"].needs
    assert GPU_PROCESSES in registrations["jobs"].needs and GPU_PROCESSES in registrations["gpu"].provides
    without_gpu = [reg for name, reg in registrations.items() if name != "gpu"]
    assert unmet_needs(without_gpu, [GPU_IDENTITIES]) == {"jobs": {GPU_PROCESSES}}
    assert unmet_needs(registrations.values(), [GPU_IDENTITIES]) == {}
