"""GPU drill-down: one GPU's every feature against the band of its peers, and its hardware detail.

A GPU is suspect when it leaves the band its peers draw, not when it crosses a fixed line: a hot
aisle warms every GPU together and moves the band, a failing GPU drifts out of it alone.
"""

from __future__ import annotations

from gpuhealth.dashboards.build import new_dashboard, with_sections
from gpuhealth.dashboards.fleet import gpu_evidence
from gpuhealth.dashboards.panels import (
    CLUSTER,
    GPU,
    NODE,
    band,
    bargauge_panel,
    events,
    fixed_colour,
    query,
    selector,
    state_timeline_panel,
    table_panel,
    thresholds,
    timeseries_panel,
    value_text,
)
from gpuhealth.dashboards.settings import PeerFeature, Settings
from grafana_foundation_sdk.builders import dashboard

UID = "gpuhealth-gpu"
THIS_GPU = selector(CLUSTER, NODE, GPU)
PEERS = selector(CLUSTER)
ON_OFF = value_text({"0": ("off", "transparent"), "1": ("on", "orange")})


def feature_series(feature: PeerFeature, scope: str) -> str:
    """One series per (node, gpu) of ``feature`` within ``scope`` (a selector's matchers)."""
    matchers = selector(feature.matchers, scope[1:-1])
    inner = (f"rate({feature.metric}{matchers}[$__rate_interval])" if feature.rate
             else f"{feature.metric}{matchers}")
    return f"sum by (node, gpu) ({inner})"


def _percent(q: float) -> str:
    return f"p{q * 100:g}"


def peer_panel(feature: PeerFeature, settings: Settings):
    low, high = settings.peer_band
    peers = feature_series(feature, PEERS)
    panel = timeseries_panel(
        feature.title, feature.description + f" Band: {_percent(low)}-{_percent(high)} of the GPUs in the "
        "cluster; blue line: their median.",
        [query(feature_series(feature, THIS_GPU), "this GPU"),
         query(f"quantile(0.5, {peers})", "peer median"),
         query(f"quantile({low}, {peers})", f"peer {_percent(low)}"),
         query(f"quantile({high}, {peers})", f"peer {_percent(high)}")],
        w=8, h=7, unit=feature.unit)
    panel = band(panel, f"peer {_percent(low)}", f"peer {_percent(high)}", "#8AB8FF")
    return fixed_colour(fixed_colour(panel, "this GPU", "#F2495C", 2), "peer median", "#5794F2")


def _overview(settings: Settings) -> list:
    return [
        table_panel(
            "Identity", "What NVML reports about this GPU: identity, model, firmware and driver.",
            [query(f"gpuhealth_gpu_info{THIS_GPU}", instant=True, table_format=True)],
            w=24, h=3, hide=("__name__", "Value", "job", "instance", "cluster", "node", "gpu")),
        timeseries_panel(
            "Failure risk and evidence",
            "The fused failure risk of this GPU and each evidence signal behind it (all 0..1; a signal "
            "is drawn only while above 0).",
            [query(f"gpuhealth:gpu_failure_risk:score{THIS_GPU}", "risk"),
             query(gpu_evidence(THIS_GPU), "{{signal}}")],
            w=24, h=8, unit="percentunit", min_val=0, legend_right=True),
    ]


def _clocks(settings: Settings) -> list:
    return [
        state_timeline_panel(
            "Clock event reasons",
            "Why the clocks are held down; thermal and power-brake slowdowns on one GPU are precursors, "
            "an operator power cap is not.",
            [query(f"max by (reason) (gpuhealth_gpu_clock_event_active{THIS_GPU})", "{{reason}}")],
            w=12, h=8, mappings=ON_OFF, steps=thresholds((None, "transparent"), (1, "orange"))),
        timeseries_panel(
            "Time in clock events", "Share of time spent in each clock event reason (high-rate sampling).",
            [query(f"sum by (reason) (rate(gpuhealth_gpu_clock_event_seconds_total{THIS_GPU}"
                   "[$__rate_interval]))", "{{reason}}")],
            w=12, h=8, unit="percentunit", min_val=0),
    ]


def _memory(settings: Settings) -> list:
    return [
        timeseries_panel(
            "ECC errors", "Error rate by type and counter; uncorrected errors end jobs.",
            [query(f"sum by (type, counter) (rate(gpuhealth_gpu_ecc_errors_total{THIS_GPU}"
                   "[$__rate_interval]))", "{{type}} {{counter}}")],
            w=8, h=8, unit="cps", min_val=0),
        timeseries_panel(
            "Remapped rows",
            "HBM spare rows used, by type (Ampere and later remap rows instead of retiring pages); "
            "uncorrectable remaps mean the GPU should be reset, then replaced if they recur.",
            [query(f"sum by (type) (gpuhealth_gpu_remapped_rows{THIS_GPU})", "{{type}}")],
            w=8, h=8, unit="short", min_val=0),
        state_timeline_panel(
            "Remap pending and failure",
            "A pending remap needs a GPU reset to take effect; a remap failure means the spare rows ran "
            "out.",
            [query(f"max(gpuhealth_gpu_remap_pending{THIS_GPU})", "remap pending"),
             query(f"max(gpuhealth_gpu_remap_failure{THIS_GPU})", "remap failure")],
            w=8, h=8, mappings=value_text({"0": ("no", "green"), "1": ("yes", "red")}),
            steps=thresholds((None, "green"), (1, "red"))),
    ]


def _nvlink(settings: Settings) -> list:
    return [
        timeseries_panel(
            "NVLink errors per link", "CRC, replay and recovery errors summed per link; one link rising "
            "alone points at that link or its NVSwitch port.",
            [query(f"sum by (link) (rate(gpuhealth_gpu_nvlink_errors_total{THIS_GPU}[$__rate_interval]))",
                   "link {{link}}")],
            w=12, h=8, unit="cps", min_val=0, legend_right=True),
        state_timeline_panel(
            "NVLink state per link", "Each link up (green) or down (red).",
            [query(f"max by (link) (gpuhealth_gpu_nvlink_up{THIS_GPU})", "link {{link}}")],
            w=12, h=8, mappings=value_text({"0": ("down", "red"), "1": ("up", "green")}),
            steps=thresholds((None, "red"), (1, "green"))),
    ]


def _pcie(settings: Settings) -> list:
    return [
        timeseries_panel(
            "PCIe link", "Current link generation and width against their maximum; a drop below the "
            "maximum is a degraded link.",
            [query(f"max(gpuhealth_gpu_pcie_link_generation{THIS_GPU})", "generation"),
             query(f"max(gpuhealth_gpu_pcie_link_generation_max{THIS_GPU})", "max generation"),
             query(f"max(gpuhealth_gpu_pcie_link_width_lanes{THIS_GPU})", "width (lanes)"),
             query(f"max(gpuhealth_gpu_pcie_link_width_max_lanes{THIS_GPU})", "max width (lanes)")],
            w=8, h=8, unit="short", min_val=0),
        timeseries_panel(
            "PCIe replays and AER errors", "Replay rate of this GPU and AER errors its PCIe device reported.",
            [query(f"sum(rate(gpuhealth_gpu_pcie_replays_total{THIS_GPU}[$__rate_interval]))", "replays"),
             query(f"sum by (severity) (rate(gpuhealth_pcie_aer_errors_total{THIS_GPU}[$__rate_interval]))",
                   "AER {{severity}}")],
            w=8, h=8, unit="cps", min_val=0),
        bargauge_panel(
            "XID events", "XIDs this GPU logged over the time range, by XID number.",
            [query(f"sort_desc({events(f'gpuhealth_xid_events_total{THIS_GPU}', '$__range', 'xid')})",
                   "XID {{xid}}", instant=True)],
            w=8, h=8, unit="short", steps=thresholds((None, "orange"))),
    ]


def build(settings: Settings) -> dashboard.Dashboard:
    dash = new_dashboard(UID, "gpuhealth / GPU drill-down",
                         "One GPU's features against the band of its peers, with clock events, memory "
                         "errors, NVLink and PCIe detail.", settings, node="single", gpu=True)
    sections = [("Failure risk", _overview(settings)),
                ("Against its peers", [peer_panel(f, settings) for f in settings.features]),
                ("Clock events", _clocks(settings)), ("Memory", _memory(settings)),
                ("NVLink", _nvlink(settings)), ("PCIe and XIDs", _pcie(settings))]
    return with_sections(dash, sections)
