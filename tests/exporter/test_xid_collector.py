"""XID counting from NVML events and the kernel log: one count per event, nothing lost, nothing doubled."""

from __future__ import annotations

from pathlib import Path

from exporter_helpers import (
    FakeClock,
    assert_golden,
    make_collector,
    promtool_check,
    samples,
    scrape,
    sim_context,
    value,
)
from gpuhealth.exporter.collectors.xid import MAX_EVENT_SERIES
from gpuhealth.exporter.dedup import MAX_UNPAIRED, XidDeduplicator


def kmsg_context(tmp_path: Path, clock: FakeClock, scenario: dict | None = None):
    ctx = sim_context(scenario or {"gpus": 2, "nvlinks": 0}, clock, kmsg_path=tmp_path / "kmsg")
    make_collector("gpu", ctx).collect().__next__()  # learn the GPUs' PCI ids
    return ctx


def write(ctx, *lines: str) -> None:
    with ctx.kmsg_path.open("a") as fh:
        fh.writelines(f"{line}\n" for line in lines)


LINES = [
    "3,100,5000,-;NVRM: Xid (PCI:0000:18:00): 31, pid='<unknown>', name=<unknown>, Ch 00000008",
    "3,101,5001,-;NVRM: Xid (PCI:0000:18:00): 31, pid=77, name=python, Ch 00000008",
    "3,102,5002,-;NVRM: Xid (0000:2a:00): 13, Graphics Exception",
    "3,103,5003,-;NVRM: Xid (PCI:0000:c1:00): 79, GPU has fallen off the bus.",
    "3,104,5004,-;NVRM: Xid (PCI:0000:2a:00): 154, GPU recovery action changed from 0x0 (None) to 0x2 "
    "(Node Reboot Required)",
    "3,105,5005,-;NVRM: The NVIDIA GPU 0000:2a:00.0 (PCI ID: 10de:2330) installed in this system has fallen "
    "off the bus and is not responding to commands.",
    "3,106,5006,-;nvidia-nvswitch2: SXid (PCI:0000:07:00.0): 20034, Fatal, Link 30 LTSSM Fault Up",
    "4,107,5007,-;nvidia 0000:18:00.0: AER: PCIe Bus Error: severity=Corrected, type=Physical Layer, "
    "(Receiver ID)",
    "4,108,5008,-;pcieport 0000:00:01.0: AER: PCIe Bus Error: severity=Uncorrected (Non-Fatal), "
    "type=Transaction Layer, (Requester ID)",
    "3,109,5009,-;NVRM: Xid (PCI:0000:18:00): ",
    "6,110,5010,-;systemd[1]: Started session 4.",
    "\x00\xff binary junk",
]


def test_kernel_log_golden(tmp_path: Path, clock: FakeClock) -> None:
    ctx = kmsg_context(tmp_path, clock)
    collector = make_collector("xid", ctx)
    scrape(collector)
    write(ctx, *LINES)
    text = scrape(collector)
    assert_golden("xid_kmsg", text)
    promtool_check(text)
    assert value(text, "gpuhealth_xid_events_total", gpu="0", xid="31") == 2  # repeats are not lost
    assert value(text, "gpuhealth_xid_events_total", gpu="1", xid="13") == 1  # legacy format
    assert value(text, "gpuhealth_xid_events_total", gpu="unknown", xid="79") == 1
    gpus = scrape(make_collector("gpu", ctx))  # a driver before R565: XID 154 is the only source
    assert value(gpus, "gpuhealth_gpu_recovery_action", gpu="1", action="node_reboot") == 1
    assert value(gpus, "gpuhealth_gpu_recovery_action", gpu="1", action="none") == 0
    assert value(gpus, "gpuhealth_gpu_recovery_action", gpu="0", action="none") == 1  # always present
    assert value(text, "gpuhealth_gpu_fallen_off_bus_total", gpu="1") == 1
    assert value(text, "gpuhealth_sxid_events_total", device="nvswitch2", sxid="20034", severity="fatal") == 1
    assert value(text, "gpuhealth_pcie_aer_errors_total", pci_bus_id="00000000:18:00.0", severity="corrected",
                 gpu="0") == 1
    assert value(text, "gpuhealth_pcie_aer_errors_total", pci_bus_id="00000000:00:01.0",
                 severity="uncorrected_non_fatal", gpu="") == 1
    assert value(text, "gpuhealth_kmsg_lines_total", result="malformed") == 1
    assert value(text, "gpuhealth_kmsg_lines_total", result="ignored") == 2
    # Event counters appear at their first event: none for a code or GPU that has had none.
    assert samples(text, "gpuhealth_xid_events_total").keys() == {
        (("gpu", "0"), ("xid", "31")), (("gpu", "1"), ("xid", "13")), (("gpu", "1"), ("xid", "154")),
        (("gpu", "unknown"), ("xid", "79"))}
    assert samples(text, "gpuhealth_gpu_fallen_off_bus_total").keys() == {(("gpu", "1"),)}


def test_event_seen_by_nvml_and_kernel_log_counts_once(tmp_path: Path, clock: FakeClock) -> None:
    scenario = {"gpus": 2, "nvlinks": 2, "faults": [{"kind": "nvlink_errors", "gpu": 1, "link": 1,
                                                      "precursor": 10}]}
    ctx = kmsg_context(tmp_path, clock, scenario)
    collector = make_collector("xid", ctx)
    scrape(collector)
    clock.advance(11)
    text = scrape(collector)  # NVML event and kernel line of the same XID 74 arrive together
    assert value(text, "gpuhealth_xid_events_total", gpu="1", xid="74") == 1
    assert "Xid (PCI:0000:2a:00): 74" in ctx.kmsg_path.read_text()


def test_nvml_events_alone_count(clock: FakeClock) -> None:
    ctx = sim_context({"gpus": 2, "faults": [{"kind": "gsp_timeout", "gpu": 0, "start": 1}]}, clock)
    collector = make_collector("xid", ctx)
    scrape(collector)
    clock.advance(2)
    text = scrape(collector)
    assert value(text, "gpuhealth_xid_events_total", gpu="0", xid="119") == 1
    assert samples(text, "gpuhealth_kmsg_lines_total") == {}  # no kernel log configured


def test_fell_off_bus_maps_to_the_lost_gpu(tmp_path: Path, clock: FakeClock) -> None:
    ctx = kmsg_context(tmp_path, clock, {"gpus": 2, "nvlinks": 0,
                                         "faults": [{"kind": "fell_off_bus", "gpu": 1, "start": 3}]})
    collector = make_collector("xid", ctx)
    clock.advance(5)
    text = scrape(collector)
    assert value(text, "gpuhealth_xid_events_total", gpu="1", xid="79") == 1
    assert value(text, "gpuhealth_gpu_fallen_off_bus_total", gpu="1") == 1
    assert value(text, "gpuhealth_kmsg_lines_total", result="fallen_off_bus") == 1


def test_deduplicator_pairs_across_sources_only() -> None:
    dedup = XidDeduplicator(window=10)
    assert dedup.is_new("nvml", "0", 79, 0.0)
    assert not dedup.is_new("kmsg", "0", 79, 1.0)   # the same event, other source
    assert dedup.is_new("kmsg", "0", 79, 2.0)       # a second event
    assert dedup.is_new("kmsg", "0", 79, 3.0)       # repeats from one source always count
    assert not dedup.is_new("nvml", "0", 79, 4.0)
    assert dedup.is_new("nvml", "1", 79, 4.0)       # another GPU
    assert dedup.is_new("kmsg", "1", 79, 20.0)      # too late to pair: a new event


def test_a_flood_of_one_xid_keeps_bounded_state_and_still_pairs() -> None:
    """A kernel log repeating one XID thousands of times (forged, or a driver gone mad) once made
    every line walk every line of the last window: 10,000 lines a run took seconds."""
    dedup = XidDeduplicator(window=10)
    flood = 2 * MAX_UNPAIRED
    assert all(dedup.is_new("kmsg", "0", 31, 1.0 + i * 1e-5) for i in range(flood))
    kept = sum(len(times) for by_source in dedup._unpaired.values() for times in by_source.values())
    assert kept == MAX_UNPAIRED  # the newest reports, not the whole flood
    assert not dedup.is_new("nvml", "0", 31, 2.0)   # NVML's report of one of them still pairs
    assert dedup.is_new("nvml", "0", 31, 30.0)      # the flood left the window


def test_logged_recovery_action_survives_a_restart(tmp_path: Path, clock: FakeClock) -> None:
    ctx = kmsg_context(tmp_path, clock)
    ctx.state_dir = tmp_path
    collector = make_collector("xid", ctx)
    scrape(collector)
    write(ctx, "3,200,6000,-;NVRM: Xid (PCI:0000:2a:00): 154, GPU recovery action changed from 0x0 (None) to "
               "0x1 (GPU Reset Required)")
    scrape(collector)
    collector.close()
    restarted = kmsg_context(tmp_path, clock)  # a new exporter process: the XID 154 line is not read again
    restarted.state_dir = tmp_path
    scrape(make_collector("xid", restarted))
    text = scrape(make_collector("gpu", restarted))
    assert value(text, "gpuhealth_gpu_recovery_action", gpu="1", action="gpu_reset") == 1


def test_simulator_writes_every_real_format_and_each_is_counted(tmp_path: Path, clock: FakeClock) -> None:
    """GPU i gets format i: escaped-newline record, short form, one-line notice; three AER spellings."""
    faults = [{"kind": "fell_off_bus", "gpu": i, "start": 3} for i in range(3)]
    faults += [{"kind": "pcie_degradation", "gpu": i, "precursor": 100} for i in range(3, 6)]
    ctx = kmsg_context(tmp_path, clock, {"gpus": 6, "nvlinks": 0, "faults": faults})
    collector = make_collector("xid", ctx)
    clock.advance(90)
    text = scrape(collector)
    for gpu in ("0", "1", "2"):
        assert value(text, "gpuhealth_gpu_fallen_off_bus_total", gpu=gpu) == 1
    for gpu in ("3", "4", "5"):
        assert sum(v for k, v in samples(text, "gpuhealth_pcie_aer_errors_total").items()
                   if ("gpu", gpu) in k) > 10
    assert value(text, "gpuhealth_kmsg_lines_total", result="malformed") == 0


def test_event_set_failure_never_stops_the_kernel_log(tmp_path: Path, clock: FakeClock) -> None:
    import pynvml

    ctx = kmsg_context(tmp_path, clock)
    ctx.nvml.inject["nvmlEventSetCreate"] = pynvml.NVMLError_Unknown()
    collector = make_collector("xid", ctx)
    scrape(collector)
    write(ctx, LINES[0])
    text = scrape(collector)
    assert value(text, "gpuhealth_xid_events_total", gpu="0", xid="31") == 1
    assert samples(text, "gpuhealth_xid_nvml_registered") == {}
    del ctx.nvml.inject["nvmlEventSetCreate"]
    ctx.nvml.inject["nvmlDeviceRegisterEvents"] = pynvml.NVMLError_NotSupported()
    clock.advance(5)  # past the backoff
    text = scrape(collector)
    assert value(text, "gpuhealth_xid_nvml_registered", gpu="0") == 0
    del ctx.nvml.inject["nvmlDeviceRegisterEvents"]
    clock.advance(60)  # unregistered GPUs are retried
    text = scrape(collector)
    assert value(text, "gpuhealth_xid_nvml_registered", gpu="0") == 1
    assert value(text, "gpuhealth_xid_nvml_registered", gpu="1") == 1


def test_a_lost_gpu_in_the_event_set_does_not_silence_the_others(tmp_path: Path, clock: FakeClock) -> None:
    faults = [{"kind": "fell_off_bus", "gpu": 1, "start": 5},
              {"kind": "hbm_degradation", "gpu": 0, "start": 10, "precursor": 10, "xid": 48}]
    ctx = sim_context({"gpus": 2, "nvlinks": 0, "faults": faults}, clock)  # NVML events only
    collector = make_collector("xid", ctx)
    scrape(collector)
    for _ in range(30):
        clock.advance(1)
        text = scrape(collector)
    assert value(text, "gpuhealth_xid_events_total", gpu="1", xid="79") == 1
    assert value(text, "gpuhealth_xid_nvml_wait_errors_total", error="gpu_is_lost") >= 1
    assert value(text, "gpuhealth_xid_nvml_registered", gpu="1") == 0
    assert value(text, "gpuhealth_xid_events_total", gpu="0", xid="48") == 1  # after the loss


def test_an_event_whose_device_has_no_index_counts_as_unknown(tmp_path: Path, clock: FakeClock) -> None:
    import pynvml

    ctx = sim_context({"gpus": 1, "nvlinks": 0, "faults": [{"kind": "fell_off_bus", "gpu": 0, "start": 2}]},
                      clock)
    collector = make_collector("xid", ctx)
    scrape(collector)
    ctx.nvml.inject["nvmlDeviceGetIndex"] = pynvml.NVMLError_GpuIsLost()
    clock.advance(3)
    text = scrape(collector)
    assert value(text, "gpuhealth_xid_events_total", gpu="unknown", xid="79") == 1


def test_a_notice_split_over_text_log_lines_lands_on_its_gpu(tmp_path: Path, clock: FakeClock) -> None:
    ctx = kmsg_context(tmp_path, clock)
    collector = make_collector("xid", ctx)
    scrape(collector)
    write(ctx, "Dec 01 10:00:00 gpu-a17 kernel: NVRM: The NVIDIA GPU 0000:2a:00.0 (PCI ID: 10de:2330)",
          "Dec 01 10:00:00 gpu-a17 kernel: NVRM: installed in this system has",
          "Dec 01 10:00:00 gpu-a17 kernel: NVRM: fallen off the bus and is not responding to commands.")
    text = scrape(collector)
    assert value(text, "gpuhealth_gpu_fallen_off_bus_total", gpu="1") == 1


def test_records_written_from_user_space_are_not_kernel_events(tmp_path: Path, clock: FakeClock) -> None:
    """Anyone who may write /dev/kmsg (or a container's copy of it) cannot forge an XID: the kernel
    gives what user space writes a facility other than its own (priority 8 and up, LOG_USER = 14)."""
    ctx = kmsg_context(tmp_path, clock)
    collector = make_collector("xid", ctx)
    scrape(collector)
    write(ctx, "12,200,6000,-;NVRM: Xid (PCI:0000:18:00): 79, pid=1, GPU has fallen off the bus.",
          "14,201,6001,-;nvidia-nvswitch0: SXid (PCI:0000:07:00.0): 20034, Fatal, Link 30",
          "13,202,6002,-;nvidia 0000:18:00.0: AER: PCIe Bus Error: severity=Corrected, type=Physical Layer",
          "3,203,6003,-;NVRM: Xid (PCI:0000:18:00): 48, DBE")
    text = scrape(collector)
    assert samples(text, "gpuhealth_xid_events_total") == {(("gpu", "0"), ("xid", "48")): 1}
    assert "gpuhealth_sxid_events_total{" not in text and "gpuhealth_pcie_aer_errors_total{" not in text
    assert value(text, "gpuhealth_kmsg_lines_total", result="not_kernel") == 3
    promtool_check(text)


def test_forged_lines_with_ever_new_devices_and_codes_cannot_grow_the_series_without_bound(
        tmp_path: Path, clock: FakeClock) -> None:
    ctx = kmsg_context(tmp_path, clock)
    collector = make_collector("xid", ctx)
    scrape(collector)
    n = MAX_EVENT_SERIES + 300
    write(ctx, *(f"4,{i},1,-;pcieport {i:08x}:{i % 256:02x}:00.0: AER: PCIe Bus Error: severity=Corrected, "
                 f"type=Physical Layer" for i in range(n)),
          *(f"3,{n + i},1,-;nvidia-nvswitch{i % 64}: SXid (PCI:0000:07:00.0): {i}, Non-fatal, x"
            for i in range(n)),
          *(f"3,{2 * n + i},1,-;NVRM: Xid (PCI:{i:04x}:99:00): {1000 + i}, x" for i in range(n)))
    text = scrape(collector)
    families = ("gpuhealth_pcie_aer_errors_total", "gpuhealth_sxid_events_total",
                "gpuhealth_xid_events_total")
    for family in families:
        assert len(samples(text, family)) == MAX_EVENT_SERIES, family
    assert value(text, "gpuhealth_kmsg_lines_total", result="over_limit") == 3 * 300
    # a series that exists keeps counting at the cap
    write(ctx, f"4,{3 * n},1,-;pcieport 00000000:00:00.0: AER: PCIe Bus Error: severity=Corrected, type=x")
    text = scrape(collector)
    assert value(text, "gpuhealth_pcie_aer_errors_total", pci_bus_id="00000000:00:00.0", severity="corrected",
                 gpu="") == 2
    promtool_check(text)
