"""Every threshold, window and selector the dashboards use, in one place.

Each default carries the reason someone would change it. ``Settings`` is immutable so that a
dashboard rendered with one set of values is reproducible byte for byte (``generate --check``).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PeerFeature:
    """One per-GPU feature drawn against the band of its peers in the drill-down.

    A counter (``rate=True``) is shown as its per-second rate. ``matchers`` narrows the metric (for
    example to corrected ECC errors); the series are summed by (node, gpu), so per-link or per-type
    series add up to one value per GPU.
    """

    title: str
    metric: str
    unit: str
    description: str
    matchers: str = ""
    rate: bool = False


@dataclass(frozen=True)
class XidClass:
    """XIDs that call for the same response; any XID in no class is drawn as informational."""

    name: str
    xids: tuple[int, ...]


def _default_features() -> tuple[PeerFeature, ...]:
    return (
        PeerFeature("GPU temperature", "gpuhealth_gpu_temperature_celsius", "celsius",
                    "Thermal runaway drifts up against peers at the same load; a hot aisle moves the band."),
        PeerFeature("HBM temperature", "gpuhealth_gpu_memory_temperature_celsius", "celsius",
                    "Memory temperature leads GPU temperature when the HBM stacks lose cooling."),
        PeerFeature("Slowdown margin", "gpuhealth_gpu_temperature_slowdown_margin_celsius", "celsius",
                    "Degrees left before hardware thermal slowdown; low is bad."),
        PeerFeature("Power", "gpuhealth_gpu_power_watts", "watt",
                    "Erratic or capped draw against peers running the same job."),
        PeerFeature("SM clock", "gpuhealth_gpu_sm_clock_hertz", "hertz",
                    "A straggler runs slower clocks than its peers in the same job."),
        PeerFeature("Utilisation", "gpuhealth_gpu_utilization_ratio", "percentunit",
                    "A GPU hung in a collective stops computing while its peers wait."),
        PeerFeature("Corrected ECC errors", "gpuhealth_gpu_ecc_errors_total", "cps",
                    "A steady rise precedes HBM failures; an isolated burst that stops is benign.",
                    matchers='type="corrected", counter="volatile"', rate=True),
        PeerFeature("Correctable remapped rows", "gpuhealth_gpu_remapped_rows", "short",
                    "Rows spent from the spare pool; steps up as HBM degrades.",
                    matchers='type="correctable"'),
        PeerFeature("PCIe replays", "gpuhealth_gpu_pcie_replays_total", "cps",
                    "A rising replay rate precedes a PCIe link failure (XID 79).", rate=True),
        PeerFeature("NVLink errors", "gpuhealth_gpu_nvlink_errors_total", "cps",
                    "CRC, replay and recovery errors summed over links; the NVLink row splits them.",
                    rate=True),
        PeerFeature("NVML latency", "gpuhealth_gpu_nvml_latency_seconds", "s",
                    "Slow NVML answers can precede a GSP timeout (XID 119)."),
    )


def _default_xid_classes() -> tuple[XidClass, ...]:
    # The XID classes the rules derive from NVIDIA's catalogue (rules/xid_catalogue.csv by the buckets
    # and overrides of rules/catalogue.yaml), named by the alert `action` they lead to (`nvlink`: its own
    # pair of alerts); tests/contract/test_xid_classes.py holds the two in step.
    return (
        XidClass("restart_job", (8, 11, 13, 25, 31, 32, 39, 40, 41, 60, 68, 69, 70, 71, 72, 75, 76, 77, 80,
                                 82, 83, 84, 85, 86, 88, 89, 94, 96, 97, 98, 99, 100, 101, 102, 103, 104, 105,
                                 126, 127, 128, 129, 130, 131, 132, 133, 134, 135, 139)),
        XidClass("drain", (54, 165)),
        XidClass("nvlink", (74, 144, 145, 146, 147, 148, 149, 150)),  # restart; drain if the link fails
        XidClass("drain_reset_gpu", (46, 48, 62, 64, 95, 109, 110, 119, 120, 136, 140, 143, 155, 156, 158,
                                     168, 169)),
        XidClass("drain_reboot", (79, 151, 167)),
    )


@dataclass(frozen=True)
class Settings:
    # Grafana colours risk above these; keep the warning in step with the rules' `fusion.threshold`.
    risk_warning: float = 0.6
    risk_critical: float = 0.8
    # Peer band of the drill-down: widen it on fleets with mixed load, narrow it on uniform jobs.
    peer_band: tuple[float, float] = (0.1, 0.9)
    # How many GPUs the "riskiest" table lists, and how many signals it shows for each.
    top_gpus: int = 10
    top_signals: int = 3
    # How many nodes the lemon-node panel ranks.
    lemon_nodes: int = 10
    # Quantiles of the alert-to-action latency; add 0.999 when the tail matters more than the bulk.
    latency_quantiles: tuple[float, ...] = (0.5, 0.9, 0.99)
    # NFS operation whose client-side queueing stalls checkpoints (WRITE for saves, READ for loads).
    nfs_op: str = "WRITE"
    # Metric whose label values fill the cluster/node/gpu pickers; any per-GPU exporter metric works.
    inventory_metric: str = "gpuhealth_gpu_up"
    # Default time range and refresh of every dashboard.
    time_from: str = "now-24h"
    refresh: str = "1m"
    # Tag that groups the dashboards in Grafana's browser and links them to each other.
    tag: str = "gpuhealth"
    features: tuple[PeerFeature, ...] = field(default_factory=_default_features)
    xid_classes: tuple[XidClass, ...] = field(default_factory=_default_xid_classes)
