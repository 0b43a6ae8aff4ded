"""The inventory step: learns how many GPUs NVML sees and each one's identity before any collector runs.

The kernel log names a GPU by PCI address and Slurm's view needs the index, so the ``xid`` and
``jobs`` collectors depend on GPU identities whether or not the ``gpu`` collector is enabled. The
sampler runs this step first in every run; it reads a GPU's identity once (kept after the GPU
vanishes, so an XID 79 still lands on its index) and tries again next run while a GPU does not
answer. It is also the one place that notices NVML was initialised again and counts the GPUs; the
collectors read both from the context. Whether a GPU is up is the ``gpu`` collector's to report.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import TYPE_CHECKING

from gpuhealth.exporter.guard import DeadlineExceeded, GuardedWorker
from gpuhealth.exporter.nvml_errors import GpuDown, NvmlDown, error_label

if TYPE_CHECKING:
    from concurrent.futures import Future

    from gpuhealth.exporter.collector import Context
    from gpuhealth.exporter.inventory import GpuIdentity

log = logging.getLogger(__name__)


class InventoryStep:
    """Fills ``ctx.inventory`` with the GPU count and the identity of every GPU NVML enumerates."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.reader = ctx.reader
        self.generation = 0

    def run(self) -> None:
        ctx, session = self.ctx, self.ctx.session
        if session is None or not session.ensure():
            return
        if session.generation != self.generation:  # initialised again: ask every feature afresh
            self.generation = session.generation
            self.reader.forget()
            ctx.inventory.driver_version = session.driver_version
        try:
            count: int = GuardedWorker.result(
                ctx.worker("node").submit(lambda: self.reader.core(ctx.nvml.nvmlDeviceGetCount)),
                ctx.nvml_timeout_seconds)
        except NvmlDown as exc:
            session.lost(exc.error)
            return
        except (DeadlineExceeded, GpuDown) as exc:  # the gpu collector reports the failure
            log.debug("inventory count failed error=%s", error_label(exc))
            return
        ctx.inventory.count = count
        unknown = [i for i in range(count) if i not in ctx.inventory.gpus]
        deadline = time.monotonic() + ctx.nvml_timeout_seconds  # the waits overlap: one timeout at most
        futures: dict[int, Future[GpuIdentity]] = {
            i: ctx.worker(f"gpu{i}").submit(functools.partial(self.reader.identity, i)) for i in unknown}
        for index, future in futures.items():
            try:
                ctx.inventory.add(GuardedWorker.result(future, deadline - time.monotonic()))
            except NvmlDown as exc:
                session.lost(exc.error)
                return
            except (DeadlineExceeded, GpuDown) as exc:
                log.debug("gpu identity not read gpu=%d error=%s", index, error_label(exc))
