"""The simulated node as sysfs shows it: GPUs and NICs in the PCI tree, InfiniBand ports, the fabric
manager's pid file; so the exporter's real fabric collector (and GPU count) reads the simulator.

The layout is an HGX baseboard's: four PCIe switches, each below its own CPU root port, each holding
two GPUs and, with eight NICs, two ConnectX-7s (four NICs: one per switch). Switches 0-1 are on NUMA
node 0, 2-3 on node 1. Port files are rewritten only when their text changes, at most once a second.
"""

from __future__ import annotations

import os
from pathlib import Path

from gpuhealth.exporter.sim.fabric import Fabric, NicState

SWITCHES = 4
ROOT_BUSES = (0x15, 0x37, 0x97, 0xB7)  # the host bridge (and root port) above each switch
NIC_BUSES = (0x1A, 0x2C, 0x3C, 0x5F, 0x9C, 0xAD, 0xBC, 0xDD)
WRITE_EVERY_SECONDS = 1.0
PID_FILE = "run/nvidia-fabricmanager/nv-fabricmanager.pid"
STATE_NAMES = {1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE"}
PHYS_NAMES = {2: "Polling", 3: "Disabled", 5: "LinkUp"}
SPEEDS = {400.0: "4X NDR", 200.0: "4X HDR", 100.0: "4X EDR", 50.0: "2X HDR"}
COUNTERS = ("symbol_error", "link_error_recovery", "link_downed", "port_rcv_errors",
            "port_rcv_remote_physical_errors", "port_xmit_discards", "local_link_integrity_errors",
            "excessive_buffer_overrun_errors", "port_rcv_constraint_errors", "VL15_dropped", "port_xmit_wait")
HW_COUNTERS = ("local_ack_timeout_err", "out_of_sequence", "packet_seq_err", "rnr_nak_retry_err")


def _switch_of(index: int, count: int) -> int:
    """GPUs (and NICs) spread evenly over the switches in index order: 8 GPUs, two per switch."""
    return index * SWITCHES // count


def _downstream_port(switch: int, slot: int) -> str:
    """``devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:<slot>.0``: host bridge, root port, the
    switch's upstream port, the downstream port the device hangs from."""
    root = ROOT_BUSES[switch]
    return (f"devices/pci0000:{root:02x}/0000:{root:02x}:01.0/0000:{root + 1:02x}:00.0/"
            f"0000:{root + 2:02x}:{slot:02x}.0")


class SysfsTree:
    """Writes the tree under ``root`` at start, then the port files as the fabric moves."""

    def __init__(self, root: Path, gpu_pci_bus_ids: list[str], fabric: Fabric, fabric_manager: bool) -> None:
        self.root = Path(root)
        self.fabric = fabric
        self._written: dict[Path, str] = {}
        self._last: float | None = None
        for index, pci in enumerate(gpu_pci_bus_ids):
            self._pci_device(_switch_of(index, len(gpu_pci_bus_ids)), 2 * index, pci.lower()[-12:],
                             "0x10de", "0x030200")
        self._ports: dict[int, Path] = {}
        for nic in fabric.nics:
            bus = NIC_BUSES[nic.index] if nic.index < len(NIC_BUSES) else 0xE0 + nic.index
            device = self._pci_device(_switch_of(nic.index, len(fabric.nics)), 2 * nic.index + 1,
                                      f"0000:{bus:02x}:00.0", "0x15b3", "0x020700")
            self._ports[nic.index] = self._hca(device, nic)
        if fabric_manager:
            self._write(self.root / PID_FILE, f"{os.getpid()}\n")
        self.write(0.0, force=True)
        self._last = None  # the first step writes whatever happened at its start

    @property
    def pid_file(self) -> Path:
        return self.root / PID_FILE

    def _pci_device(self, switch: int, slot: int, address: str, vendor: str, pci_class: str) -> Path:
        relative = f"{_downstream_port(switch, slot)}/{address}"
        device = self.root / relative
        numa_node = switch * 2 // SWITCHES
        for name, text in (("vendor", vendor), ("class", pci_class), ("numa_node", numa_node)):
            self._write(device / name, f"{text}\n")
        self._link(self.root / "bus/pci/devices" / address, "../../../" + relative)
        return device

    def _hca(self, device: Path, nic: NicState) -> Path:
        hca = device / "infiniband" / nic.device
        self._write(hca / "hca_type", "MT4129\n")
        self._write(hca / "fw_ver", "28.39.1002\n")
        self._link(hca / "device", f"../../../{device.name}")
        self._link(self.root / "class/infiniband" / nic.device,
                   "../../" + str(hca.relative_to(self.root)))
        port = hca / "ports" / "1"
        self._write(port / "link_layer", "InfiniBand\n")
        for name in HW_COUNTERS:
            self._write(port / "hw_counters" / name, "0\n")
        return port

    def _write(self, path: Path, text: str) -> None:
        if self._written.get(path) == text:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text)
        tmp.replace(path)  # a reader never sees half a value
        self._written[path] = text

    def _link(self, path: Path, target: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.is_symlink():
            path.symlink_to(target)

    def write(self, t: float, force: bool = False) -> None:
        """The port files as the fabric stands at scenario time ``t``."""
        if not force and self._last is not None and 0 <= t - self._last < WRITE_EVERY_SECONDS:  # <0: reloaded
            return
        self._last = t
        for nic in self.fabric.nics:
            port = self._ports[nic.index]
            state, phys = nic.state
            self._write(port / "state", f"{state}: {STATE_NAMES[state]}\n")
            self._write(port / "phys_state", f"{phys}: {PHYS_NAMES[phys]}\n")
            speed = SPEEDS.get(nic.rate_gbps, "4X")
            self._write(port / "rate", f"{nic.rate_gbps:g} Gb/sec ({speed})\n")
            for name in COUNTERS:
                self._write(port / "counters" / name, f"{int(nic.counters.get(name, 0))}\n")
