"""What the exporter knows about the node's GPUs, shared by the collectors.

Identity is read once per GPU and kept after the GPU vanishes, so a kernel-log XID 79 for a GPU that
fell off the bus still maps to its index.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
    gpus: dict[int, GpuIdentity] = field(default_factory=dict)
    processes: dict[int, list[int]] = field(default_factory=dict)  # GPU index -> compute pids

    def add(self, identity: GpuIdentity) -> None:
        self.gpus[identity.index] = identity

    def gpu_for_pci(self, pci_bus_id: str) -> str:
        """The ``gpu`` label for a PCI address: the index, or "unknown" when no known GPU has it."""
        key = _pci_key(pci_bus_id)
        for identity in self.gpus.values():
            if _pci_key(identity.pci_bus_id) == key:
                return str(identity.index)
        return "unknown"
