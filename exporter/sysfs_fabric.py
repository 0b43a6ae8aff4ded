"""InfiniBand/RoCE ports, their netdevs and their PCI placement, read from sysfs.

The layout is the kernel's (``class/infiniband/<dev>/ports/<n>/``, ``class/net/<if>/``, the PCI
device tree under ``devices/``). Real nodes differ: a counter file may be missing (older kernels,
RoCE ports), refuse to be read (EINVAL, a permission), or hold ``N/A (no PMA)``. Such a value is
left out and counted by device and error in ``ReadErrors``; nothing here raises on odd input.
"""

from __future__ import annotations

import collections
import errno
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from gpuhealth.contract.metrics import NIC_HW_ERRORS, NIC_PORT_ERRORS
from gpuhealth.exporter.fabric_settings import GBPS
from gpuhealth.exporter.sysfs_attribute import read_attribute

PORT_STATE_ACTIVE = 4      # IB PortState: 1 DOWN, 2 INIT, 3 ARMED, 4 ACTIVE, 5 ACTIVE_DEFER
PHYS_STATE_LINK_UP = 5     # IB PortPhysicalState: 2 Polling, 3 Disabled, 5 LinkUp, 6 LinkErrorRecovery
ROCE = "Ethernet"

ReadErrors = collections.Counter[tuple[str, str]]  # (device, error) -> failed reads
StrPath = str | os.PathLike[str]
MAX_PORTS = 256  # HCA ports read per run: far above a node's NICs, bounding the series they make
NETDEV_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._:@-]{0,14}")  # IFNAMSIZ; never "/", "..", white space


def read_text(path: StrPath, device: str, errors: ReadErrors) -> str | None:
    """The stripped contents of a sysfs file, or None with the failure counted for ``device``.

    One ``open``/``read``/``close`` on a plain path (``read_attribute``): a node has dozens of these
    files per port, read every few seconds, and pathlib's objects and buffered file cost more than the
    reads themselves.
    """
    try:
        return read_attribute(path)
    except FileNotFoundError:
        errors[device, "missing"] += 1
    except PermissionError:
        errors[device, "permission"] += 1
    except OSError as exc:  # EINVAL, EOPNOTSUPP: a counter the port cannot give now; ELOOP, EAGAIN
        errors[device, "missing" if exc.errno == errno.ENOTDIR else "io"] += 1
    return None


def read_number(path: StrPath, device: str, errors: ReadErrors) -> int | None:
    """A decimal counter or gauge; ``N/A (no PMA)`` and other text count as malformed."""
    text = read_text(path, device, errors)
    if text is None:
        return None
    if not text.isdigit():
        errors[device, "malformed"] += 1
        return None
    return int(text)


def parse_state(text: str) -> int | None:
    """``4: ACTIVE`` or ``5: LinkUp`` -> the number."""
    number = text.partition(":")[0].strip()
    return int(number) if text.count(":") == 1 and number.isdigit() else None


def parse_rate(text: str) -> float | None:
    """``400 Gb/sec (4X NDR)`` or ``2.5 Gb/sec (1X SDR)`` -> bytes per second."""
    words = text.split()
    if len(words) < 2 or words[1] != "Gb/sec":
        return None
    try:
        gbps = float(words[0])
    except ValueError:
        return None
    return gbps * GBPS if gbps >= 0 and gbps != float("inf") else None


@dataclass
class Port:
    device: str
    port: str
    link_layer: str = ""
    netdev: str = ""
    state: int | None = None
    physical_state: int | None = None
    rate: float | None = None  # bytes per second
    counters: dict[str, int] = field(default_factory=dict)     # NIC_PORT_ERRORS and link_downed
    hw_counters: dict[str, int] = field(default_factory=dict)  # NIC_HW_ERRORS present on the port

    @property
    def up(self) -> bool:
        return self.state == PORT_STATE_ACTIVE and self.physical_state == PHYS_STATE_LINK_UP


@dataclass
class Netdev:
    name: str
    carrier_changes: int | None = None
    up: bool | None = None
    speed: float | None = None  # bytes per second


def _listing(path: StrPath, device: str, errors: ReadErrors) -> list[str]:
    try:
        return sorted(entry.name for entry in os.scandir(path))
    except FileNotFoundError:
        return []
    except PermissionError:
        errors[device, "permission"] += 1
    except OSError:
        errors[device, "io"] += 1
    return []


def _state(path: StrPath, device: str, errors: ReadErrors) -> int | None:
    text = read_text(path, device, errors)
    if text is None:
        return None
    number = parse_state(text)
    if number is None:
        errors[device, "malformed"] += 1
    return number


def _roce_netdev(hca: Path, port: str, device: str, errors: ReadErrors) -> str:
    """The Ethernet interface of a RoCE port: its first GID's netdev, else the PCI function's one.
    Only a name the kernel could give an interface: it becomes a label and a path under class/net."""
    # an empty GID entry answers EINVAL, older kernels have no gid_attrs: neither is an error
    name = read_text(hca / "ports" / port / "gid_attrs" / "ndevs" / "0", device, ReadErrors()) or ""
    if not name:
        names = _listing(hca / "device" / "net", device, errors)
        name = names[0] if names else ""
    if name and not NETDEV_NAME.fullmatch(name):
        errors[device, "malformed"] += 1
        return ""
    return name


def read_port(hca: Path, port: str, errors: ReadErrors) -> Port:
    device = hca.name
    base = f"{hca}/ports/{port}"  # plain text paths: see read_text
    found = Port(device, port)
    found.link_layer = read_text(f"{base}/link_layer", device, errors) or ""
    if found.link_layer == ROCE:
        found.netdev = _roce_netdev(hca, port, device, errors)
    found.state = _state(f"{base}/state", device, errors)
    found.physical_state = _state(f"{base}/phys_state", device, errors)
    if (rate := read_text(f"{base}/rate", device, errors)) is not None:
        found.rate = parse_rate(rate)
        if found.rate is None:
            errors[device, "malformed"] += 1
    for name in ("link_downed", *NIC_PORT_ERRORS):
        if (value := read_number(f"{base}/counters/{name}", device, errors)) is not None:
            found.counters[name] = value
    present = set(_listing(f"{base}/hw_counters", device, errors))
    for name in sorted(present.intersection(NIC_HW_ERRORS)):
        if (value := read_number(f"{base}/hw_counters/{name}", device, errors)) is not None:
            found.hw_counters[name] = value
    return found


def read_ports(sysfs: Path, errors: ReadErrors) -> list[Port]:
    """Every port of every HCA under ``class/infiniband``, in name order, up to ``MAX_PORTS``: each is a
    dozen series, and a tree with thousands (SR-IOV functions, or a crafted ``--path.sysfs``) must not
    multiply them without bound. Ports past the cap are counted, as ``("", "over_limit")``."""
    root = sysfs / "class" / "infiniband"
    found: list[Port] = []
    for device in _listing(root, "", errors):
        for port in _listing(root / device / "ports", device, errors):
            if len(found) == MAX_PORTS:
                errors["", "over_limit"] += 1
                continue
            found.append(read_port(root / device, port, errors))
    return found


def read_netdev(sysfs: Path, name: str, errors: ReadErrors) -> Netdev:
    base = sysfs / "class" / "net" / name
    found = Netdev(name, carrier_changes=read_number(base / "carrier_changes", name, errors))
    if (state := read_text(base / "operstate", name, errors)) is not None:
        found.up = state == "up"
    text = read_text(base / "speed", name, errors)  # EINVAL while the link is down
    if text is not None:
        if text.lstrip("-").isdigit():
            found.speed = int(text) * 1e6 / 8 if int(text) >= 0 else None  # Mb/s; -1: unknown
        else:
            errors[name, "malformed"] += 1
    return found


@dataclass(frozen=True)
class Placement:
    """Where a PCI device sits: the bridges from its host bridge down to it, and its NUMA node."""

    path: tuple[str, ...]
    numa_node: int | None

    def shares_switch(self, other: Placement) -> bool:
        """A bridge in common below the root port (path[0] the host bridge, path[1] the root port)."""
        common = 0
        for mine, theirs in zip(self.path, other.path, strict=False):
            if mine != theirs:
                break
            common += 1
        return common >= 3

    def shares_numa_node(self, other: Placement) -> bool:
        return self.numa_node is not None and self.numa_node == other.numa_node


def placement(sysfs: Path, device_link: Path, device: str, errors: ReadErrors) -> Placement | None:
    """The placement of the PCI device that ``device_link`` (a ``device`` symlink, or a
    ``bus/pci/devices`` entry) resolves to, None when it is not in the PCI tree."""
    devices = os.path.realpath(sysfs / "devices")
    target = os.path.realpath(device_link)
    if not os.path.isdir(target) or not target.startswith(devices + os.sep):
        return None
    parts = tuple(Path(target).relative_to(devices).parts)
    if not parts or not parts[0].startswith("pci"):
        return None
    numa = read_text(Path(target) / "numa_node", device, errors)
    node = int(numa) if numa is not None and numa.isdigit() else None  # -1: no NUMA affinity
    return Placement(parts, node)


def gpu_pci_entry(sysfs: Path, pci_bus_id: str) -> Path:
    """``bus/pci/devices/0000:18:00.0`` for NVML's ``00000000:18:00.0``."""
    return sysfs / "bus" / "pci" / "devices" / pci_bus_id.lower()[-12:]
