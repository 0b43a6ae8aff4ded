"""What the fabric collector is told about the node's network: expected rates, leaf switches, the
fabric manager. From the ``fabric`` block of the exporter's configuration (the simulator sets its own)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

GBPS = 1e9 / 8  # bytes per second in one Gb/s: sysfs and the configuration speak in Gb/s


@dataclass(frozen=True)
class FabricSettings:
    expected_rate_gbps: float | None = None  # every port, unless the device has its own
    expected_rate_by_device: dict[str, float] = field(default_factory=dict)
    switches: dict[str, str] = field(default_factory=dict)  # HCA -> the leaf switch its cable goes to
    systemctl: tuple[str, ...] = ("systemctl",)  # (): do not ask systemd (containers, the simulator)
    manager_unit: str = "nvidia-fabricmanager.service"
    # where the fabric manager's systemd unit keeps its pid: read when systemd cannot answer
    manager_pid_file: Path | None = Path("/var/run/nvidia-fabricmanager/nv-fabricmanager.pid")

    def expected_rate(self, device: str) -> float | None:
        """Bytes per second the configuration expects of the device's ports, None when it does not say."""
        gbps = self.expected_rate_by_device.get(device, self.expected_rate_gbps)
        return None if gbps is None else gbps * GBPS
