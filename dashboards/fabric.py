"""The fleet overview's fabric row: InfiniBand/RoCE port health per port, flaps over time, bit errors,
and the leaf-switch view that tells a switch event (a rack's ports down together) from a bad port."""

from __future__ import annotations

from gpuhealth.dashboards.panels import (
    CLUSTER,
    NODE,
    query,
    selector,
    stat_panel,
    state_timeline_panel,
    thresholds,
    timeseries_panel,
    value_text,
)

SCOPE = selector(CLUSTER, NODE)
PORT = "cluster, node, device, port"
BIT_ERRORS = 'error=~"symbol_error|link_error_recovery"'


def panels() -> list:
    up = f"gpuhealth_nic_port_up{SCOPE}"
    downed = f"gpuhealth_nic_port_link_downed_total{SCOPE}"
    errors = "gpuhealth_nic_port_errors_total" + selector(CLUSTER, NODE, BIT_ERRORS)
    info = f"gpuhealth_nic_port_info{SCOPE}"
    carrier = f"gpuhealth_netdev_carrier_changes_total{SCOPE}"
    roce = "gpuhealth_nic_port_info" + selector(CLUSTER, NODE, 'netdev!=""')
    slow = (f"gpuhealth_nic_port_rate_bytes_per_second{SCOPE} "
            f"< on ({PORT}) gpuhealth_nic_port_expected_rate_bytes_per_second{SCOPE}")
    return [
        state_timeline_panel(
            "NIC ports by node",
            "Every InfiniBand/RoCE port over time, one row per port: up (ACTIVE and LinkUp) or down. A row "
            "of short gaps is a flapping port; gaps on every port of a rack at once are its leaf switch.",
            [query(f"min by ({PORT}) ({up})", "{{node}} {{device}}/{{port}}")],
            w=24, h=10, steps=thresholds((None, "red"), (1, "green")),
            mappings=value_text({"0": ("down", "red"), "1": ("up", "green")})),
        timeseries_panel(
            "Port flaps",
            "Link losses per port (InfiniBand: sysfs link_downed; RoCE: half the netdev's carrier changes): "
            "one at boot is routine; two within an hour drain the node (GPUHealthNicPortFlapping) unless "
            "its switch was rebooting.",
            # one query for both link layers (a RoCE port's link_downed stays 0), so it has data on any fleet
            [query(f"sum by (node, device) ((increase({downed}[$__rate_interval]) unless on ({PORT}) {roce}) "
                   f"or increase({carrier}[$__rate_interval]) / 2 "
                   f"* on (cluster, node, netdev) group_right () group by ({PORT}, netdev) ({roce}))",
                   "{{node}} {{device}}")],
            w=12, h=8, bars=True, stacked=True, unit="short", min_val=0),
        timeseries_panel(
            "Symbol errors and link error recoveries",
            "Bit errors per second by port: a link whose error rate rises goes down next. Above 10 an hour "
            "(infiniband-diags' threshold) it is network evidence of the failure risk.",
            [query(f"sum by (node, device) (rate({errors}[$__rate_interval]))", "{{node}} {{device}}")],
            w=12, h=8, unit="short", min_val=0),
        timeseries_panel(
            "Ports down by leaf switch",
            "Ports down per leaf switch (the inventory's switch label; blank where none is named). Most of "
            "a switch's ports down together is a switch event (GPUHealthFabricSwitchEvent): no node is "
            "drained.",
            [query(f"sum by (switch) ((1 - {up}) * on ({PORT}) group_left (switch) {info})", "{{switch}}")],
            w=12, h=8, bars=True, stacked=True, unit="short", min_val=0),
        stat_panel(
            "Ports below expected rate",
            "Ports that are up but trained below the rate the exporter's configuration expects: each drains "
            "its node at once (GPUHealthNicRateDegraded), as a link keeps the rate it trained at.",
            [query(f"count({slow}) or vector(0)", "ports", instant=True)],
            w=12, h=8, steps=thresholds((None, "green"), (1, "orange"))),
    ]
