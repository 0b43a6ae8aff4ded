"""Benign events, one class per noise kind of the shared vocabulary (``gpuhealth.contract.faults``).

Each moves the very signals faults move, so a naive rule is fooled by it. Every event draws from its
own random stream, so its draws never depend on which other events the scenario holds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from gpuhealth.contract.faults import APP_XIDS
from gpuhealth.evaluation.effects import AddXid, Effects, PerLink
from gpuhealth.evaluation.hardware import POWER_LIMIT_W

if TYPE_CHECKING:
    from gpuhealth.evaluation.nics import NicPorts
    from gpuhealth.evaluation.scenario import Noise
    from gpuhealth.evaluation.signals import FleetSignals


class NoiseEffects(Effects):
    """One benign event: on one GPU, one node, or the nodes it reaches."""

    def __init__(self, signals: FleetSignals, noise: Noise, position: int) -> None:
        super().__init__(signals)
        self.event = noise
        self.position = position
        self.node = signals.node_index(noise.node)

    def draw(self) -> np.random.Generator:
        """The event's own random stream, from its start (each signal reads it afresh)."""
        return self.signals.rng(f"noise-{self.position}-{self.event.kind}")

    @property
    def row(self) -> int:
        """The event's GPU (kinds that name one)."""
        return self.signals.gpu_index(self.event.node, self.event.gpu)

    @property
    def where(self) -> slice:
        return self.signals.span(self.event.at, self.event.duration)

    def envelope(self, rise: float = 900.0) -> tuple[slice, np.ndarray]:
        """The event's span and a 0..1 envelope rising and falling over ``rise`` seconds."""
        where = self.where
        n = where.stop - where.start
        ramp = np.minimum(np.arange(n) + 1, np.arange(n)[::-1] + 1) * self.signals.timeline.step / rise
        return where, np.minimum(1, ramp)

    def reach(self) -> list[str]:
        """The nodes the event touches: its own node unless the kind says otherwise."""
        return [self.event.node]

    def rack_nodes(self) -> list[str]:
        return [self.signals.fleet.node(n) for n in self.signals.rack(self.event.node)]


class SbeBurst(NoiseEffects):
    """An isolated burst of corrected ECC errors that stops."""

    kind = "sbe_burst"

    def memory_errors(self, hbm: dict[str, np.ndarray], rng: np.random.Generator) -> None:
        where = self.where
        n = where.stop - where.start
        hbm["corrected"][self.row, where] += self.draw().poisson((20 + 280 * self.event.strength) / n, n)


class SbeChatter(NoiseEffects):
    """Corrected ECC errors at a low steady rate for hours to days: 1 to 30 an hour."""

    kind = "sbe_chatter"

    def memory_errors(self, hbm: dict[str, np.ndarray], rng: np.random.Generator) -> None:
        where, minutes = self.where, self.signals.timeline.step / 60
        n = where.stop - where.start
        rate = (1 + 29 * self.event.strength) / 60 * minutes
        hbm["corrected"][self.row, where] += self.draw().poisson(rate, n)


class RowRemap(NoiseEffects):
    """One row remapped (XID 63, logged from the remap count); ``pending`` until the next GPU reset."""

    pending = True

    def remap(self, hbm: dict[str, np.ndarray], at: int) -> None:
        hbm["remapped"][self.row, at] += 1

    def memory_errors(self, hbm: dict[str, np.ndarray], rng: np.random.Generator) -> None:
        at = self.signals.at(self.event.at)
        if at >= self.signals.timeline.count:
            return
        self.remap(hbm, at)
        if self.pending:  # the remap takes effect at the next GPU reset
            hbm["pending"][self.row, self.where] = 1


class BenignRemap(RowRemap):
    """One row remapped, remap pending until the next GPU reset."""

    kind = "benign_remap"


class Xid63(RowRemap):
    """A remap recorded (XID 63), nothing else."""

    kind = "xid63"
    pending = False


class ContainedXid94(RowRemap):
    """One contained uncorrectable error (XID 94), its row remapped, pending until the reset."""

    kind = "contained_xid94"

    def remap(self, hbm: dict[str, np.ndarray], at: int) -> None:
        hbm["uncorrected"][self.row, at] += 1
        hbm["uncorrectable"][self.row, at] += 1

    def xids(self, add: AddXid) -> None:
        add(self.row, 94, self.signals.at(self.event.at), 1.0)


class AppXid(NoiseEffects):
    """A buggy job: the same application XID again and again on every node of the job."""

    kind = "app_xid"

    def reach(self) -> list[str]:
        return [self.signals.fleet.node(int(n)) for n in self.signals.job_nodes(self.event)]

    def xids(self, add: AddXid) -> None:
        s, noise, rng = self.signals, self.event, self.draw()
        gpus = s.fleet.gpus_per_node
        xid = int(rng.choice(list(APP_XIDS), p=[0.35, 0.35, 0.15, 0.15]))
        for node in s.job_nodes(noise):
            t = noise.at + rng.uniform(0, 600)
            while t < noise.at + noise.duration:
                for gpu in rng.choice(gpus, int(rng.integers(1, 9)), replace=False):
                    add(node * gpus + int(gpu), xid, s.at(t), 1.0)
                    if xid == 13 and rng.random() < 0.5:
                        add(node * gpus + int(gpu), 43, s.at(t), 1.0)
                t += np.exp(rng.uniform(np.log(300), np.log(2 * 3600)))


class NvlinkFlap(NoiseEffects):
    """CRC errors in bursts on one link; strong ones drop the link, which retrains within a couple of
    minutes (and log XID 74), then heal."""

    kind = "nvlink_flap"

    def nvlink(self, flits: PerLink, down: PerLink, rng: np.random.Generator) -> None:
        s, noise, draw = self.signals, self.event, self.draw()
        key = (self.row, int(draw.integers(max(s.fleet.nvlinks, 1))))
        where = self.where
        n = where.stop - where.start
        bursty = draw.random(n) < 0.3
        increments = np.zeros(s.timeline.count)
        increments[where] = draw.poisson((5 + 400 * noise.strength) * (s.timeline.step / 60) * bursty)
        flits[key] = flits.get(key, 0) + increments
        if noise.strength > 0.4:
            mask = down.setdefault(key, np.zeros(s.timeline.count, dtype=bool))
            mask[s.span(noise.at + noise.duration / 2, 120)] = True

    def xids(self, add: AddXid) -> None:
        if self.event.strength > 0.5:
            add(self.row, 74, self.signals.at(self.event.at + self.event.duration / 2), 1.0)


class PcieReplaySteady(NoiseEffects):
    """A healthy link that replays steadily for days; half of them log AER corrected errors too."""

    kind = "pcie_replay_steady"

    def replays(self, replays: np.ndarray, rng: np.random.Generator) -> None:
        where = self.where
        rate = (0.05 + 3 * self.event.strength) * self.signals.timeline.step / 60
        replays[self.row, where] += self.draw().poisson(rate, where.stop - where.start)

    def aer(self, out: dict[int, np.ndarray], rng: np.random.Generator) -> None:
        if self.draw().random() < 0.5:
            out[self.row] = out.get(self.row, 0) + np.floor(self.signals.replays[self.row] / 3)


class BootReplayBurst(NoiseEffects):
    """The node reboots, then its links replay in a burst over the first minutes."""

    kind = "boot_replay_burst"

    def no_job(self, job: np.ndarray) -> None:
        s = self.signals
        job[self.node, s.at(self.event.at - 600) : s.at(self.event.at)] = -1

    def replays(self, replays: np.ndarray, rng: np.random.Generator) -> None:
        s, noise, draw = self.signals, self.event, self.draw()
        gpus = [noise.gpu] if noise.gpu is not None else range(s.fleet.gpus_per_node)
        where = self.where
        n = where.stop - where.start
        for gpu in gpus:
            replays[s.gpu_index(noise.node, gpu), where] += draw.poisson((50 + 450 * noise.strength) / n, n)


class RebootLoop(NoiseEffects):
    """The node reboots two to eight times: no job, its exporter does not answer for a few minutes
    before each boot, and every boot retrains one GPU's link (a replay burst)."""

    kind = "reboot_loop"

    def boots(self, rng: np.random.Generator) -> np.ndarray:
        noise = self.event
        return np.sort(noise.at + rng.uniform(0, noise.duration, int(rng.integers(2, 9))))

    def restarts(self) -> list[float]:
        return self.boots(self.draw()).tolist()

    def offline(self, down: np.ndarray) -> None:
        rng = self.draw()
        for boot in self.boots(rng):
            down[self.node, self.signals.span(boot - rng.uniform(180, 600), 0)] = True

    def no_job(self, job: np.ndarray) -> None:
        job[self.node, self.where] = -1

    def replays(self, replays: np.ndarray, rng: np.random.Generator) -> None:
        s, draw = self.signals, self.draw()
        for boot in self.boots(draw):
            gpu = int(draw.integers(s.fleet.gpus_per_node))
            at = s.at(boot)
            if at < s.timeline.count:
                replays[s.gpu_index(self.event.node, gpu), at] += int(draw.integers(20, 400))


class IdleNode(NoiseEffects):
    """A node idle between jobs: utilisation, power, interrupts and runnable processes fall together."""

    kind = "idle_node"

    def no_job(self, job: np.ndarray) -> None:
        job[self.node, self.where] = -1


class CheckpointBurst(NoiseEffects):
    """One node writes a large checkpoint: NFS write burst with RPC queueing."""

    kind = "checkpoint_burst"

    def checkpoint(self, load: np.ndarray) -> None:
        load[self.node, self.where] = 1.5 + 2 * self.event.strength


class CheckpointStorm(NoiseEffects):
    """Many nodes checkpoint at once (the event's job and others): NFS queueing, slow metadata calls,
    page-outs (the client's RPC slots are exhausted, see ``FleetSignals.storage_stress``)."""

    kind = "checkpoint_storm"

    def checkpoint(self, load: np.ndarray) -> None:
        s, noise, rng = self.signals, self.event, self.draw()
        others = np.flatnonzero(rng.random(s.fleet.nodes) < 0.2 + 0.5 * noise.strength)
        for node in set(s.job_nodes(noise)) | set(others.tolist()):
            where = self.where
            load[node, where] = np.where(s.workload.busy[node, where], 2.5 + 3 * noise.strength, 0)

    def reach(self) -> list[str]:
        s = self.signals
        nodes = np.flatnonzero(s.checkpoint_load[:, self.where].max(axis=1) > 2)
        return [s.fleet.node(int(n)) for n in nodes]


class LoadImbalance(NoiseEffects):
    """One rank carries more work: the node's other GPUs are less busy (cooler, lower power)."""

    kind = "load_imbalance"

    def utilization(self, util: np.ndarray) -> None:
        s, noise = self.signals, self.event
        heavy = noise.gpu if noise.gpu is not None else int(self.draw().integers(s.fleet.gpus_per_node))
        gpus = s.node_gpus(self.node)
        light = [i for i in range(gpus.start, gpus.stop) if i != s.gpu_index(noise.node, heavy)]
        util[light, self.where] *= 1 - 0.1 - 0.35 * noise.strength


class PowerCap(NoiseEffects):
    """The operator power-caps one GPU, or several of a node."""

    kind = "power_cap"

    def power_limit(self, limit: np.ndarray) -> None:
        s, noise, rng = self.signals, self.event, self.draw()
        cap = POWER_LIMIT_W - 250 - 150 * noise.strength
        per_node = s.fleet.gpus_per_node
        gpus = (
            [noise.gpu]
            if noise.gpu is not None
            else rng.choice(per_node, int(rng.integers(2, per_node + 1)), replace=False).tolist()
        )
        for gpu in gpus:
            limit[self.node * per_node + gpu, self.where] = cap


class PowerBrake(NoiseEffects):
    """The facility asserts power brake over a rack: HW slowdown on every GPU."""

    kind = "power_brake"

    def reach(self) -> list[str]:
        return self.rack_nodes()

    def power_brake(self, brake: np.ndarray) -> None:
        s = self.signals
        for node in s.rack(self.event.node):
            brake[s.node_gpus(node), self.where] = True


class SlowNvml(NoiseEffects):
    """A busy node answers NVML slowly on every GPU, then recovers."""

    kind = "slow_nvml"

    def nvml_latency(self, latency: np.ndarray) -> None:
        s, where = self.signals, self.where
        latency[s.node_gpus(self.node), where] += self.draw().uniform(
            0.1, 0.3 + 2.5 * self.event.strength, (s.fleet.gpus_per_node, where.stop - where.start)
        )


class AmbientHeat(NoiseEffects):
    """Heat at the same load over whole nodes, uneven over their GPUs (position in the airflow)."""

    def heated(self) -> tuple[list[int], float]:
        """The node indices warmed and by how much at the peak."""
        raise NotImplementedError

    def heat(self, offset: np.ndarray) -> None:
        s, rng = self.signals, self.draw()
        where, shape = self.envelope()
        g = s.fleet.gpus_per_node
        nodes, heat = self.heated()
        for node in nodes:
            position = rng.uniform(0.4, 1.5, g)[:, None]
            offset[node * g : (node + 1) * g, where] += heat * position * shape


class HotAisle(AmbientHeat):
    """Every GPU of a node warms together, unevenly; a strong one warms the next node too."""

    kind = "hot_aisle"

    def heated(self) -> tuple[list[int], float]:
        strength = self.event.strength
        last = min(self.node + (2 if strength > 0.6 else 1), self.signals.fleet.nodes)
        return list(range(self.node, last)), 3 + 6 * strength

    def reach(self) -> list[str]:
        s = self.signals
        if self.event.strength > 0.6:
            return [self.event.node, s.fleet.node(min(self.node + 1, s.fleet.nodes - 1))]
        return [self.event.node]


class RackCooling(AmbientHeat):
    """A rack's cooling fails: every GPU of its nodes warms, unevenly."""

    kind = "rack_cooling"

    def heated(self) -> tuple[list[int], float]:
        return list(self.signals.rack(self.event.node)), 4 + 10 * self.event.strength

    def reach(self) -> list[str]:
        return self.rack_nodes()


class WarmGpu(NoiseEffects):
    """One GPU runs chronically warmer than its peers."""

    kind = "warm_gpu"

    def heat(self, offset: np.ndarray) -> None:
        offset[self.row, self.where] += 2 + 8 * self.event.strength


class IbBootFlap(NoiseEffects):
    """A port flaps once while the node boots (training, a few symbol errors), then stays up."""

    kind = "ib_boot_flap"

    def nic_ports(self, ports: NicPorts, rng: np.random.Generator) -> None:
        s, at = self.signals, self.signals.at(self.event.at)
        row = s.fabric.port_row(self.event.node, self.event.gpu)
        ports.flap(row, at)
        if at < s.timeline.count:
            ports.symbol[row, at] += self.draw().poisson(2 + 5 * self.event.strength)


class SwitchReboot(NoiseEffects):
    """A planned leaf-switch reboot: every port of the rack goes down together for minutes, comes
    back briefly while the switch boots, drops again and returns, with a few symbol errors."""

    kind = "switch_reboot"

    def nic_ports(self, ports: NicPorts, rng: np.random.Generator) -> None:
        s, where, draw = self.signals, self.where, self.draw()
        n = where.stop - where.start
        rows = s.fabric.rack_ports(self.event.node)
        for row in rows:
            ports.flap(row, where.start, n)
            if n > 4:  # the switch's ports come up once during its boot
                ports.up[row, where.start + n // 2] = True
                ports.flap(row, where.start + n // 2 + 1, n - n // 2 - 1)
            if where.stop < s.timeline.count:
                ports.symbol[row, where.stop] += draw.poisson(1 + 3 * self.event.strength)

    def reach(self) -> list[str]:
        return self.rack_nodes()


NOISE: dict[str, type[NoiseEffects]] = {
    cls.kind: cls
    for cls in (
        SbeBurst,
        SbeChatter,
        BenignRemap,
        Xid63,
        ContainedXid94,
        AppXid,
        NvlinkFlap,
        PcieReplaySteady,
        BootReplayBurst,
        RebootLoop,
        IdleNode,
        CheckpointBurst,
        CheckpointStorm,
        LoadImbalance,
        PowerCap,
        PowerBrake,
        SlowNvml,
        HotAisle,
        RackCooling,
        WarmGpu,
        IbBootFlap,
        SwitchReboot,
    )
}
