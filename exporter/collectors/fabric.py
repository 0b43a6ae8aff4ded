"""Fabric health: InfiniBand/RoCE ports, their netdevs, which GPUs each NIC serves, the fabric manager.

Collectives run over these NICs, so a port that flaps, trains at a lower rate or collects symbol
errors stalls every GPU of the job. Everything is read from sysfs under ``--path.sysfs``
(``sysfs_fabric``), every READ_EVERY_SECONDS rather than every run: port counters move slowly and a
node has dozens of files per port. The affinity (same PCIe switch, else same NUMA node) lets an
alert on a NIC name the GPUs it starves.
"""

from __future__ import annotations

from collections.abc import Iterator

from gpuhealth.exporter.collector import GPU_IDENTITIES, Context, register
from gpuhealth.exporter.fabric_manager import FabricManagerProbe
from gpuhealth.exporter.metrics import Families, Family
from gpuhealth.exporter.sysfs_fabric import (
    ROCE,
    Placement,
    ReadErrors,
    gpu_pci_entry,
    placement,
    read_netdev,
    read_ports,
)

# Port counters and states, read as often as the GPU collector reads its counters (its full reading).
READ_EVERY_SECONDS = 5.0


@register("fabric", "InfiniBand/RoCE ports, netdevs, GPU-to-NIC affinity and the fabric manager from sysfs",
          needs=[GPU_IDENTITIES])
class FabricCollector:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.errors = ReadErrors()
        self.manager = FabricManagerProbe(ctx.fabric, ctx.procfs, ctx.clock)
        self._families: list[Family] = []
        self._read_at: float | None = None
        # the PCI placement does not change while the devices stay: resolved again only when they do
        self._affinity_key: tuple[object, ...] = ()
        self._affinity_pairs: list[tuple[str, str, str]] = []

    def collect(self) -> Iterator[Family]:
        now = self.ctx.clock()
        if self._read_at is None or now - self._read_at >= READ_EVERY_SECONDS:
            self._read_at = now
            self._families = list(self._read()) if self.ctx.sysfs is not None else []
        yield from self._families
        f = Families()
        up = self.manager.poll()
        if up is not None:
            f.add("gpuhealth_fabric_manager_up", int(up))
        for (device, error), count in sorted((self.errors + self.manager.errors).items()):
            f.add("gpuhealth_fabric_read_errors_total", count, [device, error])
        yield from f

    def _read(self) -> Iterator[Family]:
        sysfs, settings = self.ctx.sysfs, self.ctx.fabric
        assert sysfs is not None
        f = Families()
        ports = read_ports(sysfs, self.errors)
        for port in ports:
            key = [port.device, port.port]
            switch = settings.switches.get(port.device, "")
            f.add("gpuhealth_nic_port_info", 1, [*key, port.link_layer, port.netdev, switch])
            if port.state is not None and port.physical_state is not None:
                f.add("gpuhealth_nic_port_up", int(port.up), key)
            if port.state is not None:
                f.add("gpuhealth_nic_port_state", port.state, key)
            if port.physical_state is not None:
                f.add("gpuhealth_nic_port_physical_state", port.physical_state, key)
            if port.rate is not None:
                f.add("gpuhealth_nic_port_rate_bytes_per_second", port.rate, key)
            if (expected := settings.expected_rate(port.device)) is not None:
                f.add("gpuhealth_nic_port_expected_rate_bytes_per_second", expected, key)
            if "link_downed" in port.counters:
                f.add("gpuhealth_nic_port_link_downed_total", port.counters["link_downed"], key)
            for error, value in port.counters.items():
                if error != "link_downed":
                    f.add("gpuhealth_nic_port_errors_total", value, [*key, error])
            for counter, value in port.hw_counters.items():
                f.add("gpuhealth_nic_port_hw_errors_total", value, [*key, counter])
        for name in sorted({port.netdev for port in ports if port.link_layer == ROCE and port.netdev}):
            netdev = read_netdev(sysfs, name, self.errors)
            if netdev.carrier_changes is not None:
                f.add("gpuhealth_netdev_carrier_changes_total", netdev.carrier_changes, [name])
            if netdev.up is not None:
                f.add("gpuhealth_netdev_up", int(netdev.up), [name])
            if netdev.speed is not None:
                f.add("gpuhealth_netdev_speed_bytes_per_second", netdev.speed, [name])
        devices = sorted({port.device for port in ports})
        gpus = tuple(sorted((i, g.pci_bus_id) for i, g in self.ctx.inventory.gpus.items()))
        placed = (tuple(devices), gpus)
        if placed != self._affinity_key:
            self._affinity_key, self._affinity_pairs = placed, list(self._affinity(devices))
        for device, gpu, scope in self._affinity_pairs:
            f.add("gpuhealth_nic_gpu_affinity_info", 1, [device, gpu, scope])
        yield from f

    def _affinity(self, devices: list[str]) -> Iterator[tuple[str, str, str]]:
        """(HCA, GPU index, closest scope) for each GPU on the NIC's PCIe switch, else its NUMA node."""
        sysfs = self.ctx.sysfs
        assert sysfs is not None
        gpus: dict[str, Placement] = {}
        for index, identity in sorted(self.ctx.inventory.gpus.items()):
            found = placement(sysfs, gpu_pci_entry(sysfs, identity.pci_bus_id), "", self.errors)
            if found is not None:
                gpus[str(index)] = found
        for device in devices:
            nic = placement(sysfs, sysfs / "class" / "infiniband" / device / "device", device, self.errors)
            if nic is None:
                continue
            for gpu, where in gpus.items():
                if nic.shares_switch(where):
                    yield device, gpu, "pcie_switch"
                elif nic.shares_numa_node(where):
                    yield device, gpu, "numa_node"
