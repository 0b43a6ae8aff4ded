"""Hardware profiles for the simulator: what each GPU generation reports and which queries it answers.

Figures are those real GPUs report (H100 SXM 80 GB: 81559 MiB, H200: 143771 MiB). When a device
check has recorded a real node (``bench/device_check.sh`` writes ``nvml_calls.json``), the file
``tests/exporter/fixtures/device/<profile>.json`` overrides the memory size and the unsupported
queries with what that node answered.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

FIXTURES = Path(__file__).parents[2] / "tests" / "exporter" / "fixtures" / "device"
MIB = 1024 * 1024


@dataclass(frozen=True)
class Profile:
    name: str
    model: str
    memory_mib: int
    nvlinks: int
    nvlink_generation: int           # 4: Hopper DL field values; 5: Blackwell NVLink5 counters
    pci_device_id: int
    power_limit_watts: float
    pcie_generation: int
    fabric: bool = True              # NVSwitch fabric registration (nvmlDeviceGetGpuFabricInfoV)
    nics: int = 8                    # ConnectX-7 NICs (400 Gb/s NDR): one per GPU on HGX H100/H200
    fabric_manager: bool = True      # nvidia-fabricmanager on the node (GB200: on the NVLink switch trays)
    unsupported: frozenset[str] = field(default_factory=frozenset)  # NVML function names
    recorded: str = ""               # the device fixture this profile was refined with

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib * MIB


_NO_LEGACY_NVLINK = frozenset({"nvmlDeviceGetNvLinkErrorCounter"})  # removed on Blackwell (NVML 565)
PROFILES = {
    p.name: p for p in (
        Profile("h100-sxm", "NVIDIA H100 80GB HBM3", 81559, 18, 4, 0x233010DE, 700.0, 5),
        Profile("h200", "NVIDIA H200", 143771, 18, 4, 0x233510DE, 700.0, 5),
        Profile("b200", "NVIDIA B200", 183359, 18, 5, 0x290110DE, 1000.0, 6, unsupported=_NO_LEGACY_NVLINK,
                nics=4),
        Profile("gb200", "NVIDIA GB200", 189471, 18, 5, 0x294110DE, 1200.0, 6, unsupported=_NO_LEGACY_NVLINK,
                nics=4, fabric_manager=False),
    )
}
DEFAULT_PROFILE = "h100-sxm"
# Queries that MIG mode inside a container refuses (nvidia-container-toolkit#842) or cannot answer.
MIG_NOT_SUPPORTED = frozenset({"nvmlDeviceGetUtilizationRates"})
MIG_NO_PERMISSION = frozenset({"nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetRemappedRows",
                               "nvmlDeviceGetRowRemapperHistogram", "nvmlDeviceGetMemoryErrorCounter"})


def load_profile(name: str, fixtures: Path = FIXTURES) -> Profile:
    """The named profile, refined by a recorded device fixture when one exists."""
    profile = PROFILES[name]
    path = fixtures / f"{name}.json"
    if not path.is_file():
        return profile
    try:
        recorded = json.loads(path.read_text())
        calls = recorded["calls"]
        memory = next((c["result"]["total"] for c in calls
                       if c["call"] == "nvmlDeviceGetMemoryInfo" and c.get("result")), None)
        refused = {c["call"] for c in calls if c.get("error") in ("not_supported", "function_not_found")}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("device fixture unreadable path=%s error=%s", path, exc)
        return profile
    return dataclasses.replace(profile, memory_mib=int(memory) // MIB if memory else profile.memory_mib,
                               unsupported=frozenset(refused),
                               recorded=str(path.name), model=recorded.get("model", profile.model))
