"""Collector registration and the context handed to every collector.

A collector is a class with ``collect()`` yielding metric families and an optional ``close()``. The
``register`` decorator adds it to ``REGISTRY``, from which the command line grows its
``--collector.<name>`` / ``--no-collector.<name>`` flags; adding a collector means adding one module
under ``collectors/``. Constructors only store their context: no hardware is touched until the first
``collect()``, in the sampling thread.

What collectors share goes through the context's inventory, and each registration says which facts
it ``needs`` and ``provides``: the run order follows from that, not from the names. GPU identities
come from the inventory step (``inventory_step.py``), which runs before every collector.
"""

from __future__ import annotations

import functools
import importlib
import logging
import pkgutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from gpuhealth.exporter.fabric_settings import FabricSettings
from gpuhealth.exporter.guard import GuardedWorker
from gpuhealth.exporter.inventory import Inventory
from gpuhealth.exporter.inventory_step import InventoryStep
from gpuhealth.exporter.metrics import Exposed
from gpuhealth.exporter.nvml_reader import NvmlReader
from gpuhealth.exporter.nvml_session import NvmlSession

log = logging.getLogger(__name__)


@dataclass
class Context:
    """The injected adapters and settings collectors use instead of globals."""

    nvml: Any = None
    session: NvmlSession | None = None  # None: nvml is already initialised (tests)
    procfs: Path = Path("/proc")
    # where gpus_expected is counted on the PCI bus (None: NVML's first count) and NICs are read (None: none)
    sysfs: Path | None = None
    fabric: FabricSettings = field(default_factory=FabricSettings)
    kmsg_path: Path | None = Path("/dev/kmsg")
    state_dir: Path | None = None
    inventory: Inventory = field(default_factory=Inventory)
    gpus_expected: int | None = None
    window_seconds: float = 15.0
    nvml_timeout_seconds: float = 2.0
    clock: Callable[[], float] = time.monotonic
    workers: dict[str, GuardedWorker] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.session is None and self.nvml is not None:
            self.session = NvmlSession(self.nvml, self.nvml_timeout_seconds, self.clock)

    def worker(self, name: str) -> GuardedWorker:
        """The one worker thread for ``name`` (a GPU, the node): whoever calls NVML for the same device
        queues on it, so a call stuck in the driver fails the next caller at once instead of twice."""
        if name not in self.workers:
            self.workers[name] = GuardedWorker(f"nvml-{name}")
        return self.workers[name]

    @functools.cached_property
    def reader(self) -> NvmlReader:
        """One reader for the inventory step and the collectors: what a GPU does not offer is learned
        once, and forgotten once (by the step) when NVML is initialised again."""
        return NvmlReader(self.nvml)

    @property
    def nvml_session(self) -> NvmlSession:
        """The session, for collectors that cannot run without NVML."""
        if self.session is None:
            raise RuntimeError("this collector needs NVML: the context has no nvml module")
        return self.session


# Facts collectors share through the inventory (``needs`` / ``provides`` of a registration).
GPU_IDENTITIES = "gpu_identities"  # index, UUID, PCI address per GPU: provided by the inventory step
GPU_PROCESSES = "gpu_processes"    # compute pids per GPU: provided by the gpu collector


class Collector(Protocol):
    def collect(self) -> Iterable[Exposed]: ...


C = TypeVar("C", bound=Callable[[Context], Collector])


@dataclass(frozen=True)
class Registration:
    name: str
    factory: Callable[[Context], Collector]
    help: str
    default_enabled: bool
    needs: frozenset[str] = frozenset()
    provides: frozenset[str] = frozenset()


REGISTRY: dict[str, Registration] = {}


def register(name: str, help: str, default_enabled: bool = True, needs: Iterable[str] = (),
             provides: Iterable[str] = ()) -> Callable[[C], C]:
    """Class decorator: make the collector selectable as ``--collector.<name>``."""
    def wrap(cls: C) -> C:
        REGISTRY[name] = Registration(name, cls, help, default_enabled, frozenset(needs), frozenset(provides))
        return cls
    return wrap


def run_order(registrations: Iterable[Registration]) -> list[Registration]:
    """Each collector after the collectors that provide what it needs, otherwise in name order."""
    pending = sorted(registrations, key=lambda reg: reg.name)
    ordered: list[Registration] = []
    while pending:
        later = {fact for reg in pending for fact in reg.provides}
        ready = next((reg for reg in pending if not reg.needs & (later - reg.provides)), None)
        if ready is None:
            raise ValueError("collectors need each other: " + ", ".join(reg.name for reg in pending))
        ordered.append(ready)
        pending.remove(ready)
    return ordered


def unmet_needs(registrations: Iterable[Registration], provided: Iterable[str]) -> dict[str, set[str]]:
    """What each collector needs that neither ``provided`` (the inventory step's facts) nor another
    enabled collector provides: it then runs on an empty inventory."""
    registrations = list(registrations)
    available = set(provided) | {fact for reg in registrations for fact in reg.provides}
    return {reg.name: set(reg.needs - available) for reg in registrations if reg.needs - available}


def assemble(ctx: Context, choices: dict[str, bool]) -> tuple[dict[str, Collector], list[Callable[[], None]]]:
    """The enabled collectors (``choices`` overrides each default) in run order, and the steps to run
    before them: the inventory step whenever a collector needs GPU identities."""
    registrations = load_collectors()
    enabled = run_order(reg for name, reg in registrations.items() if choices.get(name, reg.default_enabled))
    for name, facts in unmet_needs(enabled, [GPU_IDENTITIES]).items():
        log.warning("collector runs without what it needs collector=%s needs=%s", name,
                    ",".join(sorted(facts)))
    steps = [InventoryStep(ctx).run] if ctx.nvml is not None and any(
        GPU_IDENTITIES in reg.needs for reg in enabled) else []
    return {reg.name: reg.factory(ctx) for reg in enabled}, steps


def load_collectors() -> dict[str, Registration]:
    """Import every module under ``collectors/`` so that they register; returns them in name order."""
    from gpuhealth.exporter import collectors

    for module in pkgutil.iter_modules(collectors.__path__):
        importlib.import_module(f"{collectors.__name__}.{module.name}")
    return dict(sorted(REGISTRY.items()))
