"""What one fault or benign event can do to the fleet's signals: one hook per shared signal.

Every kind is one class (``faults.py``, ``noise.py``) that overrides the hooks of the signals its
physics moves, so a kind is read in one place. ``FleetSignals`` builds each signal once and folds
every event's hook into it, in ``FOLD_ORDER``. Hooks change the arrays they are given; the default
changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

import numpy as np

if TYPE_CHECKING:
    from gpuhealth.evaluation.nics import NicPorts
    from gpuhealth.evaluation.signals import FleetSignals

# add(gpu row, XID, sample index, count): one more logged XID
AddXid = Callable[[int, int, int, float], None]
# (GPU row, link) -> values over the timeline
PerLink = dict[tuple[int, int], np.ndarray]

# The order in which events fold into the signals they share: a later event overwrites an earlier
# one's level (a checkpoint storm over a node's own checkpoint burst) and adds after it; the kinds of
# one tuple fold in scenario order (faults of one tuple draw from one random stream).
FOLD_ORDER = (
    ("gsp_timeout",),
    ("nvlink_errors",),
    ("pcie_degradation",),
    ("idle_node", "reboot_loop"),
    ("boot_replay_burst",),
    ("pcie_replay_steady",),
    ("sbe_burst", "sbe_chatter"),
    ("benign_remap", "contained_xid94", "xid63"),
    ("app_xid",),
    ("nvlink_flap",),
    ("checkpoint_burst",),
    ("checkpoint_storm",),
    ("load_imbalance",),
    ("power_cap",),
    ("power_brake",),
    ("slow_nvml",),
    ("hot_aisle", "rack_cooling"),
    ("warm_gpu",),
    ("thermal_runaway",),
    ("hbm_degradation", "sram_uncorrectable"),
    ("fell_off_bus",),
    ("switch_reboot",),
    ("ib_boot_flap",),
    ("ib_symbol_errors", "ib_link_flap", "ib_rate_downgrade", "nvswitch_fatal"),
)


class Effects:
    """One event's effects; ``signals`` gives the shared state (timeline, workload, fleet layout)."""

    kind: ClassVar[str]

    def __init__(self, signals: FleetSignals) -> None:
        self.signals = signals

    # node and workload
    def offline(self, down: np.ndarray) -> None:
        """(nodes, T) bool: the node's exporter does not answer."""

    def restarts(self) -> list[float]:
        """Instants (offsets from the start) at which the node boots again."""
        return []

    def no_job(self, job: np.ndarray) -> None:
        """(nodes, T) job ids: set -1 where the node runs no job."""

    def checkpoint(self, load: np.ndarray) -> None:
        """(nodes, T) checkpoint write intensity."""

    def storage_stress(self, stress: np.ndarray) -> None:
        """(nodes, T) 0..1: the host stalls (paging, slow NFS metadata)."""

    # GPU load, power and heat
    def utilization(self, util: np.ndarray) -> None:
        """(GPUs, T) 0..1."""

    def power_limit(self, limit: np.ndarray) -> None:
        """(GPUs, T) watts."""

    def power_brake(self, brake: np.ndarray) -> None:
        """(GPUs, T) bool: HW power brake slowdown."""

    def heat(self, offset: np.ndarray) -> None:
        """(GPUs, T) degrees above what the load explains."""

    def nvml_latency(self, latency: np.ndarray) -> None:
        """(GPUs, T) seconds NVML takes for one sample."""

    # errors
    def memory_errors(self, hbm: dict[str, np.ndarray], rng: np.random.Generator) -> None:
        """Increments of ``corrected``/``uncorrected`` ECC, ``remapped``/``uncorrectable`` rows; the
        ``pending`` and ``failure`` remap flags."""

    def replays(self, replays: np.ndarray, rng: np.random.Generator) -> None:
        """(GPUs, T) PCIe replay increments."""

    def aer(self, out: dict[int, np.ndarray], rng: np.random.Generator) -> None:
        """Corrected AER increments by GPU row."""

    def pcie_link(self, width: np.ndarray, generation: np.ndarray) -> None:
        """(GPUs, T) the link's width (lanes) and generation."""

    def nvlink(self, flits: PerLink, down: PerLink, rng: np.random.Generator) -> None:
        """CRC flit increments and down masks by (GPU row, link)."""

    def xids(self, add: AddXid) -> None:
        """XIDs the kernel logs."""

    # fabric (``nics.py``)
    def nic_ports(self, ports: NicPorts, rng: np.random.Generator) -> None:
        """InfiniBand port state, counters and rate, and NVSwitch SXIDs."""
