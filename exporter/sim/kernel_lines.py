"""Kernel log lines as real kernels and drivers print them, in every format the parser must read.

The format of each line is chosen by the GPU's index, so one scenario exercises several: PCIe AER as
kernels before 4.19 (no ``AER:`` prefix), 4.19 to 6.x (``Corrected``) and current ones
(``Correctable``) print it; the driver's fallen-off-the-bus notice as one /dev/kmsg record with its
newlines escaped, or the short form of newer drivers.
"""

from __future__ import annotations

AER_FORMATS = (
    "nvidia {pci}: AER: PCIe Bus Error: severity=Corrected, type=Physical Layer, (Receiver ID)",
    "nvidia {pci}: PCIe Bus Error: severity=Corrected, type=Physical Layer, id=3a00(Receiver ID)",
    "nvidia {pci}: AER: PCIe Bus Error: severity=Correctable, type=Physical Layer, (Receiver ID)",
)
FALLEN_FORMATS = (
    "NVRM: The NVIDIA GPU {pci} (PCI ID: 10de:2330)\\x0aNVRM: installed in this system has\\x0a"
    "NVRM: fallen off the bus and is not responding to commands.",
    "NVRM: GPU {pci}: GPU has fallen off the bus.",
    "NVRM: The NVIDIA GPU {pci} (PCI ID: 10de:2330) installed in this system has fallen off the bus and is "
    "not responding to commands.",
)


def kernel_pci(pci_bus_id: str) -> str:
    """``00000000:3B:00.0`` as the kernel prints it, ``0000:3b:00.0``."""
    return pci_bus_id.lower()[4:]


def aer_corrected(index: int, pci_bus_id: str) -> str:
    return AER_FORMATS[index % len(AER_FORMATS)].format(pci=kernel_pci(pci_bus_id))


def fallen_off_bus(index: int, pci_bus_id: str) -> str:
    return FALLEN_FORMATS[index % len(FALLEN_FORMATS)].format(pci=kernel_pci(pci_bus_id))


NVSWITCH_PCI = "0000:{bus:02x}:00.0"  # HGX H100/H200 baseboards: NVSwitches on buses 05 to 08


def sxid_non_fatal(switch: int, link: int) -> str:
    return (f"nvidia-nvswitch{switch}: SXid (PCI:{NVSWITCH_PCI.format(bus=5 + switch)}): 12028, Non-fatal, "
            f"Link {link} egress non-posted PRIV error")


def sxid_fatal(switch: int, link: int) -> str:
    return (f"nvidia-nvswitch{switch}: SXid (PCI:{NVSWITCH_PCI.format(bus=5 + switch)}): 20034, Fatal, "
            f"Link {link} LTSSM Fault Up")
