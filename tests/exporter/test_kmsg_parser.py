"""Kernel log parser: every format in the domain notes, plus garbage, truncated and binary input."""

from __future__ import annotations

import pytest
from gpuhealth.exporter.kmsg import Event, parse_line, pci_bus_id, split_record
from hypothesis import given
from hypothesis import strategies as st

CASES = [
    ("NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.",
     Event("xid", "00000000:3B:00.0", code=79)),
    ("NVRM: Xid (PCI:0000:01:00): 79, GPU has fallen off the bus.",
     Event("xid", "00000000:01:00.0", code=79)),
    ("NVRM: Xid (0000:03:00): 14, Channel 00000001", Event("xid", "00000000:03:00.0", code=14)),
    ("NVRM: Xid (PCI:0000:18:00): 31, pid='<unknown>', name=<unknown>, Ch 00000008, intr 10000000. "
     "MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f8a_00000000",
     Event("xid", "00000000:18:00.0", code=31)),
    ("NVRM: Xid (PCI:0000:01:00): 154, GPU recovery action changed from 0x0 (None) to 0x1 "
     "(GPU Reset Required)",
     Event("xid", "00000000:01:00.0", code=154, action="gpu_reset")),
    ("NVRM: Xid (PCI:0000:01:00): 154, GPU recovery action changed from 0x1 (GPU Reset Required) to 0x2 "
     "(Node Reboot Required)", Event("xid", "00000000:01:00.0", code=154, action="node_reboot")),
    ("NVRM: The NVIDIA GPU 0000:b3:00.0 (PCI ID: 10de:2330) installed in this system has fallen off the bus "
     "and is not responding to commands.", Event("fallen_off_bus", "00000000:B3:00.0")),
    ("nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 32 egress non-posted PRIV error",
     Event("sxid", "00000000:05:00.0", code=12028, severity="non_fatal", device="nvswitch0")),
    ("nvidia-nvswitch3: SXid (PCI:0000:08:00.0): 24007, Fatal, Link 44 sourcetrack TCEN0 crumbstore ECC DBE",
     Event("sxid", "00000000:08:00.0", code=24007, severity="fatal", device="nvswitch3")),
    ("nvidia 0000:3b:00.0: AER: PCIe Bus Error: severity=Corrected, type=Physical Layer, (Receiver ID)",
     Event("aer", "00000000:3B:00.0", severity="corrected")),
    ("pcieport 0000:00:03.1: AER: PCIe Bus Error: severity=Uncorrected (Non-Fatal), type=Transaction Layer, "
     "(Requester ID)", Event("aer", "00000000:00:03.1", severity="uncorrected_non_fatal")),
    ("nvidia 0000:3b:00.0: AER: PCIe Bus Error: severity=Uncorrected (Fatal), type=Transaction Layer, "
     "(Receiver ID)", Event("aer", "00000000:3B:00.0", severity="uncorrected_fatal")),
    ("pcieport 0000:00:01.0: AER: Corrected error received: 0000:3b:00.0", Event("ignored")),
    # AER across kernel versions: no "AER: " before 4.19 (and an id=), "Correctable"/"Uncorrectable" in
    # current kernels, from the GPU or from its root port
    ("pcieport 0000:00:01.0: PCIe Bus Error: severity=Corrected, type=Physical Layer, id=0008(Receiver ID)",
     Event("aer", "00000000:00:01.0", severity="corrected")),
    ("pcieport 0000:80:01.1: PCIe Bus Error: severity=Uncorrected (Non-Fatal), type=Transaction Layer, "
     "id=0009(Requester ID)", Event("aer", "00000000:80:01.1", severity="uncorrected_non_fatal")),
    ("nvidia 0000:3b:00.0: AER: PCIe Bus Error: severity=Correctable, type=Physical Layer, (Receiver ID)",
     Event("aer", "00000000:3B:00.0", severity="corrected")),
    ("pcieport 0000:00:03.0: AER: PCIe Bus Error: severity=Uncorrectable (Non-Fatal), type=Transaction "
     "Layer, (Requester ID)", Event("aer", "00000000:00:03.0", severity="uncorrected_non_fatal")),
    ("nvidia 0000:3b:00.0: PCIe Bus Error: severity=Uncorrectable (Fatal), type=Inaccessible, "
     "(Unregistered Agent ID)", Event("aer", "00000000:3B:00.0", severity="uncorrected_fatal")),
    ("pcieport 0000:00:03.0: AER:   device [8086:2030] error status/mask=00000001/00002000",
     Event("ignored")),
    # the driver's fallen-off-the-bus notice: one kmsg record, newlines escaped; and the short form
    ("3,812,901234,-;NVRM: The NVIDIA GPU 0000:b3:00.0 (PCI ID: 10de:2330)\\x0aNVRM: installed in this "
     "system has\\x0aNVRM: fallen off the bus and is not responding to commands.",
     Event("fallen_off_bus", "00000000:B3:00.0", seq=812)),
    ("NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.", Event("fallen_off_bus", "00000000:3B:00.0")),
    ("Dec 01 10:00:00 gpu-a17 kernel: NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.",
     Event("fallen_off_bus", "00000000:3B:00.0")),
    ("NVRM: GPU at PCI:0000:3b:00: GPU-4b7a8c4e-9d2f-11ee-8c90-0242ac120002",
     Event("ignored", "00000000:3B:00.0")),
    # the notice as a text log prints it, one line each: the GPU on the first, the fall on the third
    ("NVRM: The NVIDIA GPU 0000:b3:00.0 (PCI ID: 10de:2330)", Event("ignored", "00000000:B3:00.0")),
    ("NVRM: installed in this system has", Event("ignored")),
    ("NVRM: fallen off the bus and is not responding to commands.", Event("fallen_off_bus", "")),
    # journalctl indents the later lines of a multi-line record
    ("                                  NVRM: fallen off the bus and is not responding to commands.",
     Event("fallen_off_bus", "")),
    # the same lines as syslog or journalctl print them
    ("Nov 30 05:22:20 gpu-a17 kernel: [ 1234.5678] NVRM: Xid (PCI:0000:3b:00): 48, pid=9, DBE (0x1,0x2)",
     Event("xid", "00000000:3B:00.0", code=48)),
    ("Nov 30 05:22:21 gpu-a17 kernel: nvidia 0000:3b:00.0: AER: PCIe Bus Error: severity=Corrected, "
     "type=Data Link Layer, (Transmitter ID)", Event("aer", "00000000:3B:00.0", severity="corrected")),
    ("EXT4-fs (nvme0n1p1): mounted filesystem with ordered data mode", Event("ignored")),
    (" SUBSYSTEM=pci", Event("ignored")),
    ("", Event("ignored")),
    ("NVRM: Xid (PCI:0000:3b:00): ", Event("malformed")),
    ("NVRM: Xid (PCI:0000:3b", Event("malformed")),
    ("NVRM: Xid (PCI:0000:01:00): 154, GPU recovery action changed to something", Event("malformed")),
]


@pytest.mark.parametrize(("line", "expected"), CASES, ids=[c[0][:40] for c in CASES])
def test_formats(line: str, expected: Event) -> None:
    assert parse_line(line) == expected


def test_kmsg_record_prefix_carries_sequence() -> None:
    event = parse_line("4,1234,5678901234,-;NVRM: Xid (PCI:0000:01:00): 79, GPU has fallen off the bus.")
    assert (event.kind, event.code, event.seq) == ("xid", 79, 1234)
    assert split_record("6,7,1500000,c;text") == (7, 1.5, "text")
    assert split_record("no prefix") == (None, None, "no prefix")


pci_parts = st.tuples(st.integers(0, 0xFFFF), st.integers(0, 0xFF), st.integers(0, 0x1F))


@given(pci_parts, st.integers(0, 999), st.sampled_from(["", ", pid=77", ", pid='<unknown>', name=<unknown>"]),
       st.booleans(), st.booleans())
def test_any_xid_line_round_trips(pci, xid, pid, pci_prefix, kmsg_prefix) -> None:
    domain, bus, device = pci
    address = f"{'PCI:' if pci_prefix else ''}{domain:04x}:{bus:02x}:{device:02x}"
    text = f"NVRM: Xid ({address}): {xid}{pid}, details"
    if xid == 154:
        text = (f"NVRM: Xid ({address}): 154, GPU recovery action changed from 0x0 (None) "
                "to 0x4 (Drain and Reset)")
    line = f"3,99,123,-;{text}" if kmsg_prefix else text
    event = parse_line(line)
    assert event.kind == "xid" and event.code == xid
    assert event.pci_bus_id == pci_bus_id(f"{domain:x}", f"{bus:x}", f"{device:x}")
    assert event.seq == (99 if kmsg_prefix else None)
    assert event.action == ("drain_and_reset" if xid == 154 else "")


@given(st.text())
def test_arbitrary_text_never_raises(text: str) -> None:
    assert parse_line(text).kind in ("xid", "sxid", "aer", "fallen_off_bus", "ignored", "malformed")


@given(st.binary())
def test_binary_input_never_raises(data: bytes) -> None:
    assert parse_line(data.decode("utf-8", errors="replace")).kind in (
        "xid", "sxid", "aer", "fallen_off_bus", "ignored", "malformed")


@given(st.integers(1, 60))
def test_truncated_xid_lines_are_not_misread(cut: int) -> None:
    full = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus."
    event = parse_line(full[:cut])
    if cut > full.index("79,") + 2:
        assert (event.kind, event.pci_bus_id, event.code) == ("xid", "00000000:3B:00.0", 79)
    else:  # a line cut inside the address or the number must not become another XID
        assert event.kind in ("malformed", "ignored")


def test_record_is_capped_so_parsing_cost_is_bounded() -> None:
    """A 100 kB line is parsed from its first MAX_RECORD_CHARS only: what lies beyond is not read."""
    from gpuhealth.exporter.kmsg import MAX_RECORD_CHARS

    tail = "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus."
    assert parse_line("x" * (MAX_RECORD_CHARS - len(tail)) + tail).kind == "xid"
    assert parse_line("x" * MAX_RECORD_CHARS + tail).kind == "ignored"
    hostile = "nvidia 0000:3b:00.0: " * 5000 + "PCIe Bus Error: severity=Corrected"
    assert parse_line(hostile).kind == "ignored"  # the phrase lies past the cap


@pytest.mark.parametrize("line", [
    "NVRM: Xid (PCI:0000:3b:20): 79, GPU has fallen off the bus.",  # device 0x20: PCI has 32 (0-1f)
    "NVRM: Xid (PCI:0000:3b:ff.0): 79, x",
    "nvidia 0000:18:3f.0: AER: PCIe Bus Error: severity=Corrected, type=Physical Layer",
    "nvidia-nvswitch0: SXid (PCI:0000:07:40.0): 12028, Non-fatal, Link 32",
])
def test_a_pci_device_number_outside_the_bus_range_is_malformed(line: str) -> None:
    assert parse_line(line).kind == "malformed"


def test_a_user_space_record_is_not_a_kernel_event() -> None:
    assert parse_line("12,5,1,-;NVRM: Xid (PCI:0000:3b:00): 79, x").kind == "not_kernel"
    assert parse_line("7,5,1,-;NVRM: Xid (PCI:0000:3b:00): 79, x").kind == "xid"  # facility 0, debug level
