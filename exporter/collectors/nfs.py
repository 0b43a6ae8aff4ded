"""NFS client RPC statistics per mount, from ``/proc/self/mountstats``.

During checkpoint bursts most NFS write latency is client-side queueing for RPC slots: the queue
time and transport backlog show it, the server-side RTT does not.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from gpuhealth.exporter.collector import Context, register
from gpuhealth.exporter.metrics import Families, Family
from gpuhealth.exporter.procfs_file import read_procfs

# xprt line: index of "sends" and "backlog_u" after the protocol name, per transport
_XPRT_FIELDS = {"tcp": (5, 9), "udp": (2, 6), "rdma": (5, 9)}


@dataclass
class MountStats:
    mount: str
    sends: int = 0
    backlog: int = 0
    # op -> operations, transmissions, timeouts, bytes sent, bytes received, queue, RTT, execute (ms)
    ops: dict[str, list[int]] = field(default_factory=dict)


def parse_mountstats(text: str) -> list[MountStats]:
    """NFS mounts of a mountstats file; other filesystems and malformed lines are skipped."""
    mounts: list[MountStats] = []
    current: MountStats | None = None
    in_ops = False
    for line in text.splitlines():
        words = line.split()
        if not words:
            continue
        if words[0] == "device":
            current, in_ops = None, False
            if len(words) >= 8 and words[3] == "on" and words[7] in ("nfs", "nfs4"):
                current = MountStats(words[4])
                mounts.append(current)
        elif current is None:
            continue
        elif words[0] == "xprt:" and len(words) > 1 and words[1] in _XPRT_FIELDS:
            sends, backlog = _XPRT_FIELDS[words[1]]
            numbers = words[2:]
            if len(numbers) > backlog and all(n.isdigit() for n in numbers[:backlog + 1]):
                current.sends, current.backlog = int(numbers[sends]), int(numbers[backlog])
        elif line.strip() == "per-op statistics":
            in_ops = True
        elif in_ops and words[0].endswith(":") and len(words) >= 9 and all(w.isdigit() for w in words[1:9]):
            current.ops[words[0][:-1]] = [int(w) for w in words[1:9]]
    return mounts


@register("nfs", "NFS client per-mount RPC figures from /proc/self/mountstats")
class NfsCollector:
    def __init__(self, ctx: Context) -> None:
        self.path = ctx.procfs / "self/mountstats"

    def collect(self) -> Iterator[Family]:
        f = Families()
        for stats in parse_mountstats(read_procfs(self.path)):
            f.add("gpuhealth_nfs_transport_sends_total", stats.sends, [stats.mount])
            f.add("gpuhealth_nfs_transport_backlog_queue_total", stats.backlog, [stats.mount])
            for op, (ops, trans, _, _, _, queue_ms, rtt_ms, exec_ms) in stats.ops.items():
                labels = [stats.mount, op]
                f.add("gpuhealth_nfs_rpc_operations_total", ops, labels)
                f.add("gpuhealth_nfs_rpc_transmissions_total", trans, labels)
                f.add("gpuhealth_nfs_rpc_queue_seconds_total", queue_ms / 1000, labels)
                f.add("gpuhealth_nfs_rpc_rtt_seconds_total", rtt_ms / 1000, labels)
                f.add("gpuhealth_nfs_rpc_execute_seconds_total", exec_ms / 1000, labels)
        yield from f
