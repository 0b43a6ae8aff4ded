"""The fault vocabulary: what the exporter's simulator injects and what ``gpuhealth eval`` measures.

One list, so that a fault modelled live on one node is the fault the benchmark scores on a fleet
(docs/contract.md describes each kind). Both simulators read it; neither imports the other.
"""

from __future__ import annotations

# Kinds on the node's fabric (its InfiniBand NICs, its NVSwitches) rather than on one GPU; on fleets
# with NICs an event's GPU index names that GPU's rail NIC. They log no XID: the hard signal of
# ib_link_flap and ib_symbol_errors is the port going down for good, of ib_rate_downgrade the rate
# drop, of nvswitch_fatal a fatal SXID.
FABRIC_FAULT_KINDS = ("ib_link_flap", "ib_symbol_errors", "ib_rate_downgrade", "nvswitch_fatal")
FABRIC_NOISE_KINDS = ("ib_boot_flap", "switch_reboot")
FABRIC_KINDS = (*FABRIC_FAULT_KINDS, *FABRIC_NOISE_KINDS)
# Fabric kinds about one port (the event names the GPU whose rail NIC it is).
PORT_KINDS = ("ib_link_flap", "ib_symbol_errors", "ib_rate_downgrade", "ib_boot_flap")
# Faults end in a hard failure.
FAULT_KINDS = (
    "hbm_degradation",
    "thermal_runaway",
    "pcie_degradation",
    "nvlink_errors",
    "gsp_timeout",
    "fell_off_bus",
    "sram_uncorrectable",
    *FABRIC_FAULT_KINDS,
)
# Benign noise: must not raise a predictive alert, and each kind can fool a naive rule.
NOISE_KINDS = (
    "sbe_burst",
    "hot_aisle",
    "boot_replay_burst",
    "power_cap",
    "idle_node",
    "checkpoint_burst",
    "sbe_chatter",
    "benign_remap",
    "contained_xid94",
    "app_xid",
    "xid63",
    "nvlink_flap",
    "pcie_replay_steady",
    "load_imbalance",
    "warm_gpu",
    "slow_nvml",
    "power_brake",
    "rack_cooling",
    "reboot_loop",
    "checkpoint_storm",
    *FABRIC_NOISE_KINDS,
)
# Noise that needs a fleet (racks, jobs over nodes, a shared filesystem, reboots): the exporter's
# simulator of one node implements the others, ``NODE_NOISE_KINDS``.
FLEET_NOISE_KINDS = ("checkpoint_burst", "load_imbalance", "rack_cooling", "reboot_loop", "checkpoint_storm",
                     "switch_reboot")
NODE_NOISE_KINDS = tuple(kind for kind in NOISE_KINDS if kind not in FLEET_NOISE_KINDS)
# Noise one node's simulator plays: the node kinds and its share of a switch reboot (its own ports
# down together; the rack's other nodes play theirs).
SIMULATED_NODE_NOISE_KINDS = (*NODE_NOISE_KINDS, "switch_reboot")
# Faults that never give warning: no precursor before the hard failure (a port retrains at a lower
# rate without warning).
SUDDEN_KINDS = ("gsp_timeout", "fell_off_bus", "sram_uncorrectable", "ib_rate_downgrade")
# XIDs the kernel logs at the hard failure; the first is the default.
FAULT_XIDS = {
    "hbm_degradation": (64, 94, 95, 48),
    "thermal_runaway": (79,),
    "pcie_degradation": (79,),
    "nvlink_errors": (74,),
    "gsp_timeout": (119, 120),
    "fell_off_bus": (79,),
    "sram_uncorrectable": (95, 94, 48),
}
# Faults whose GPU falls off the bus at the hard failure: NVML loses it, the kernel logs the fall.
FALLS_OFF_BUS_KINDS = ("thermal_runaway", "pcie_degradation", "fell_off_bus")
# Faults a GPU reset (``nvidia-smi -r``) repairs, struck or still in their precursor: it reloads the
# GPU's firmware (GSP) and clears a contained SRAM error. It applies the pending row remaps that retire
# HBM rows already bad, but a wearing HBM stack goes on producing new ones, and it retrains NVLinks
# whose errors come from the link's physics (connector, cable, SerDes), which it does not mend: those
# faults go on after a reset, as do an overheating GPU and a degraded PCIe link. It cannot reach a GPU
# that fell off the bus (FALLS_OFF_BUS_KINDS: the node reboots).
RESET_REPAIRS_KINDS = ("sram_uncorrectable", "gsp_timeout")
# Noise that lasts until the next GPU reset: a row marked for remapping stays pending until then.
RESET_ENDS_NOISE_KINDS = ("benign_remap", "contained_xid94")
# XID 154: the driver announces the recovery action it now requires (here a GPU reset).
RECOVERY_ACTION_XID = 154
# Faults after whose hard failure the driver asks for a GPU reset through XID 154.
RECOVERY_ACTION_KINDS = ("hbm_degradation", "sram_uncorrectable")
# What a buggy job makes the driver log (``app_xid``): graphics exception, page fault, channel reset,
# preemptive cleanup.
APP_XIDS = (13, 31, 43, 45)
