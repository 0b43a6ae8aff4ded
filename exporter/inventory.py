"""What the exporter knows about the node's GPUs, shared by the collectors.

Identity is read once per GPU and kept after the GPU vanishes, so a kernel-log XID 79 for a GPU that
fell off the bus still maps to its index.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from gpuhealth.exporter.sysfs_attribute import read_attribute

# far above any node built (4 to 16 GPUs): a larger count is a typo that would keep the missing-GPU
# alert firing, and one past a float's range would break every scrape
GPUS_PER_NODE_MAX = 64


@dataclass(frozen=True)
class GpuIdentity:
    index: int
    uuid: str
    pci_bus_id: str
    model: str
    serial: str
    vbios_version: str


def _pci_key(pci_bus_id: str) -> str:
    """Domain, bus and device: kernel XID lines omit the PCI function."""
    return pci_bus_id.upper().rsplit(".", 1)[0]


@dataclass
class Inventory:
    driver_version: str = ""
    count: int = 0  # GPUs NVML enumerated at the last count that answered (the inventory step's)
    gpus: dict[int, GpuIdentity] = field(default_factory=dict)
    processes: dict[int, list[int]] = field(default_factory=dict)  # GPU index -> compute pids
    logged_recovery: dict[str, str] = field(default_factory=dict)  # gpu -> action from XID 154

    def add(self, identity: GpuIdentity) -> None:
        self.gpus[identity.index] = identity

    def gpu_for_pci(self, pci_bus_id: str) -> str:
        """The ``gpu`` label for a PCI address: the index, or "unknown" when no known GPU has it."""
        key = _pci_key(pci_bus_id)
        for identity in self.gpus.values():
            if _pci_key(identity.pci_bus_id) == key:
                return str(identity.index)
        return "unknown"


NVIDIA_VENDOR = "0x10de"
GPU_CLASSES = ("0x0300", "0x0302")  # VGA and 3D controllers; NVSwitches are bridges (0x0680)


def nvidia_gpus_on_pci(sysfs: Path) -> int | None:
    """NVIDIA GPUs the PCI bus enumerates (``<sysfs>/bus/pci/devices``), whatever NVML sees.

    The PCI bus lists a GPU whose driver failed to attach, so a GPU missing at boot still counts as
    expected. None when the directory cannot be read.
    """
    try:
        devices = list((sysfs / "bus" / "pci" / "devices").iterdir())
    except OSError:
        return None
    count = 0
    for device in devices:
        try:
            vendor = read_attribute(device / "vendor").lower()
            pci_class = read_attribute(device / "class").lower()
        except OSError:
            continue
        count += vendor == NVIDIA_VENDOR and pci_class.startswith(GPU_CLASSES)
    return count
