"""The fabric of a fleet with NICs (``fleet.nics_per_node``): InfiniBand ports and NVSwitch SXIDs,
under the names of the exporter's ``fabric`` collector (docs/contract.md).

Port ``mlx5_<i>`` of a node is GPU ``i``'s rail NIC (same PCIe switch, as on an H100/H200 HGX
board), so an event's ``gpu`` names the port. Each rack has one leaf switch (``leaf-r<rack>``) that
serves every port of its nodes; ``fleet.switch_names: false`` leaves the inventory's ``switch``
label empty, so that the rules must find a switch's event by simultaneity. A fleet without NICs (every
scenario written before them) publishes none of these series, so its other series stay what they were.

``fleet.nic_link_layer: Ethernet`` makes every port a RoCE port, as the exporter publishes one: the
same port series with ``link_layer="Ethernet"`` and the port's netdev (``ens<i>np0``), plus the
netdev's carrier changes, operstate and speed. A RoCE port's link losses show in its carrier changes
(one per transition, two per flap); its InfiniBand ``link_downed`` and error counters stay at zero
(the Ethernet PHY's errors are in ethtool statistics, which the exporter does not read), so a RoCE
link whose bit error rate worsens shows nothing until it goes down.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from gpuhealth.contract.faults import FABRIC_FAULT_KINDS, FABRIC_NOISE_KINDS

if TYPE_CHECKING:
    from gpuhealth.evaluation.signals import Family, FleetSignals

RATE_BYTES = 5e10  # NDR: 400 Gb/s, as the exporter turns sysfs "400 Gb/sec" into bytes per second
ERRORS = ("symbol_error", "link_error_recovery", "port_rcv_errors")
BACKGROUND_SYMBOL_ERRORS_PER_MINUTE = 0.0005  # a healthy link: about one a day after FEC
PORT_ACTIVE, PORT_DOWN = 4.0, 1.0  # IB PortState
PHYS_LINK_UP, PHYS_POLLING = 5.0, 2.0  # IB PortPhysicalState
SXIDS = {"fatal": 12028, "non_fatal": 11004}  # an NVSwitch SXID number of each severity
BOOT_CARRIER_CHANGES = 2.0  # a RoCE netdev's carrier went down and up once as the driver brought it up
NETDEV_FAMILIES = ("gpuhealth_netdev_carrier_changes_total", "gpuhealth_netdev_up",
                   "gpuhealth_netdev_speed_bytes_per_second")


@dataclass
class NicPorts:
    """Every port's state over the timeline, rows ``node * nics_per_node + nic``; the hooks of
    ``Effects.nic_ports`` change them in place."""

    up: np.ndarray  # bool: ACTIVE and LinkUp
    downs: np.ndarray  # link_downed increments
    symbol: np.ndarray  # symbol_error increments
    recovery: np.ndarray  # link_error_recovery increments
    rate: np.ndarray  # bytes per second as trained
    sxid: dict[str, np.ndarray]  # severity -> (nodes, T) NVSwitch SXID increments

    def flap(self, row: int, at: int, length: int = 1) -> None:
        """The port loses its link at ``at`` for ``length`` samples (counted once) and retrains."""
        if at < self.up.shape[1]:
            self.up[row, at : at + max(length, 1)] = False
            self.downs[row, at] += 1


def has_fabric(signals: FleetSignals) -> bool:
    """NICs in the fleet, or a fabric event (an NVSwitch fault needs no NIC) in the scenario."""
    kinds = {*FABRIC_FAULT_KINDS, *FABRIC_NOISE_KINDS}
    named = {f.kind for f in signals.scenario.failures} | {n.kind for n in signals.scenario.noise}
    return signals.fleet.nics_per_node > 0 or bool(named & kinds)


class Fabric:
    """Builds the fabric families of one fleet."""

    def __init__(self, signals: FleetSignals) -> None:
        self.signals = signals
        self.nics = signals.fleet.nics_per_node
        self.roce = signals.fleet.nic_link_layer == "Ethernet"

    def port_row(self, node: str, nic: int | None) -> int:
        if nic is None or not 0 <= nic < self.nics:
            raise ValueError(f"an event on a port of {node} names no NIC index below {self.nics}")
        return self.signals.node_index(node) * self.nics + nic

    def switch(self, node: int) -> str:
        """The leaf switch of the node's rack, as the inventory names it ("" when it names none)."""
        if not self.signals.fleet.switch_names:
            return ""
        return f"leaf-r{node // self.signals.fleet.rack_nodes:02d}"

    def rack_ports(self, node: str) -> list[int]:
        """Rows of every port of the nodes in ``node``'s rack (what its leaf switch serves)."""
        return [n * self.nics + i for n in self.signals.rack(node) for i in range(self.nics)]

    @cached_property
    def ports(self) -> NicPorts:
        s = self.signals
        shape = (s.fleet.nodes * self.nics, s.timeline.count)
        minutes = s.timeline.step / 60
        ports = NicPorts(
            up=np.ones(shape, dtype=bool),
            downs=np.zeros(shape),
            symbol=s.rng("nic-symbol").poisson(BACKGROUND_SYMBOL_ERRORS_PER_MINUTE * minutes, shape) * 1.0,
            recovery=np.zeros(shape),
            rate=np.full(shape, RATE_BYTES),
            sxid={severity: np.zeros((s.fleet.nodes, s.timeline.count)) for severity in SXIDS},
        )
        rng = s.rng("nic-events")
        for event in s.events:
            event.nic_ports(ports, rng)
        return ports

    def builders(self) -> dict[str, Callable[[], Iterator[Family]]]:
        names: tuple[str, ...] = (
            "gpuhealth_nic_port_info", "gpuhealth_nic_port_up", "gpuhealth_nic_port_state",
            "gpuhealth_nic_port_physical_state", "gpuhealth_nic_port_rate_bytes_per_second",
            "gpuhealth_nic_port_expected_rate_bytes_per_second", "gpuhealth_nic_port_link_downed_total",
            "gpuhealth_nic_port_errors_total", "gpuhealth_nic_gpu_affinity_info")
        names += NETDEV_FAMILIES if self.roce else ()
        out: dict[str, Callable[[], Iterator[Family]]] = {name: self._ports for name in names if self.nics}
        out["gpuhealth_fabric_manager_up"] = self._fabric_manager
        out["gpuhealth_sxid_events_total"] = self._sxids
        return out

    def _port_labels(self) -> list[str]:
        return [f'device="mlx5_{i}",port="1",{labels}' for labels in self.signals.node_labels
                for i in range(self.nics)]

    def _masked(self, values: np.ndarray) -> np.ndarray:
        """No sample while the node's exporter does not answer (a reboot)."""
        return np.where(np.repeat(self.signals.down, self.nics, axis=0), np.nan, values)

    def _ports(self) -> Iterator[Family]:
        s, p, labels = self.signals, self.ports, self._port_labels()
        ones = np.ones(s.timeline.count)

        def family(name: str, values: np.ndarray, extra: str = "") -> list[tuple[str, np.ndarray]]:
            masked = self._masked(values)
            return [(f"{extra}{label}", masked[i]) for i, label in enumerate(labels)]

        info = []
        layer = self.signals.fleet.nic_link_layer
        for row, label in enumerate(labels):
            node, netdev = row // self.nics, f"ens{row % self.nics}np0" if self.roce else ""
            where = f'link_layer="{layer}",netdev="{netdev}",switch="{self.switch(node)}"'
            info.append((f"{where},{label}", ones))
        yield s._family("gpuhealth_nic_port_info", info)
        if self.roce:
            yield from self._netdevs()
        downs = np.zeros(p.downs.shape) if self.roce else p.downs
        gauges = {
            "gpuhealth_nic_port_up": p.up.astype(float),
            "gpuhealth_nic_port_state": np.where(p.up, PORT_ACTIVE, PORT_DOWN),
            "gpuhealth_nic_port_physical_state": np.where(p.up, PHYS_LINK_UP, PHYS_POLLING),
            "gpuhealth_nic_port_rate_bytes_per_second": p.rate,
            "gpuhealth_nic_port_expected_rate_bytes_per_second": np.full(p.rate.shape, RATE_BYTES),
            "gpuhealth_nic_port_link_downed_total": np.cumsum(downs, axis=1),
        }
        for name, values in gauges.items():
            yield s._family(name, family(name, values))
        zeros = np.zeros(p.rate.shape)
        counters = {"symbol_error": zeros if self.roce else p.symbol,
                    "link_error_recovery": zeros if self.roce else p.recovery, "port_rcv_errors": zeros}
        yield s._family("gpuhealth_nic_port_errors_total", [
            row for error in ERRORS
            for row in family(error, np.cumsum(counters[error], axis=1), f'error="{error}",')])
        yield s._family("gpuhealth_nic_gpu_affinity_info", [
            (f'device="mlx5_{i}",gpu="{i}",scope="pcie_switch",{node}', ones)
            for node in s.node_labels for i in range(min(self.nics, s.fleet.gpus_per_node))])

    def _netdevs(self) -> Iterator[Family]:
        """Each RoCE port's netdev: a carrier change at every transition of the port's link, the
        operstate, and the speed, absent while the link is down (the kernel answers EINVAL)."""
        s, p = self.signals, self.ports
        labels = [f'netdev="ens{i}np0",{node}' for node in s.node_labels for i in range(self.nics)]
        changes = np.zeros(p.up.shape)
        changes[:, 1:] = p.up[:, 1:] != p.up[:, :-1]
        changes[:, 0] = BOOT_CARRIER_CHANGES + ~p.up[:, 0]
        values = {"gpuhealth_netdev_carrier_changes_total": np.cumsum(changes, axis=1),
                  "gpuhealth_netdev_up": p.up.astype(float),
                  "gpuhealth_netdev_speed_bytes_per_second": np.where(p.up, p.rate, np.nan)}
        for name, series in values.items():
            masked = self._masked(series)
            yield s._family(name, [(label, masked[i]) for i, label in enumerate(labels)])

    def _fabric_manager(self) -> Iterator[Family]:
        s = self.signals
        yield s._series("gpuhealth_fabric_manager_up", np.where(s.down, np.nan, 1.0), node=True)

    def _sxids(self) -> Iterator[Family]:
        """A node's SXID counter appears with its first SXID of that severity, as the exporter's."""
        s, rows = self.signals, []
        for severity, sxid in SXIDS.items():
            for node, increments in enumerate(self.ports.sxid[severity]):
                if increments.any():
                    values = np.cumsum(increments)
                    rows.append((f'device="0000:05:00.0",severity="{severity}",sxid="{sxid}",'
                                 f"{s.node_labels[node]}", np.where(values == 0, np.nan, values)))
        yield s._family("gpuhealth_sxid_events_total", rows)
