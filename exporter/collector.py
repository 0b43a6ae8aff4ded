"""Collector registration and the context handed to every collector.

A collector is a class with ``collect()`` yielding metric families and an optional ``close()``. The
``register`` decorator adds it to ``REGISTRY``, from which the command line grows its
``--collector.<name>`` / ``--no-collector.<name>`` flags; adding a collector means adding one module
under ``collectors/``. Constructors only store their context: no hardware is touched until the first
``collect()``, in the sampling thread.
"""

from __future__ import annotations

import importlib
import pkgutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from gpuhealth.exporter.inventory import Inventory
from gpuhealth.exporter.nvml_session import NvmlSession
from prometheus_client.core import Metric


@dataclass
class Context:
    """The injected adapters and settings collectors use instead of globals."""

    nvml: Any = None
    session: NvmlSession | None = None  # None: nvml is already initialised (tests)
    procfs: Path = Path("/proc")
    sysfs: Path | None = None  # where gpus_expected is counted on the PCI bus; None: NVML's first count
    kmsg_path: Path | None = Path("/dev/kmsg")
    state_dir: Path | None = None
    inventory: Inventory = field(default_factory=Inventory)
    gpus_expected: int | None = None
    window_seconds: float = 15.0
    nvml_timeout_seconds: float = 2.0
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        if self.session is None and self.nvml is not None:
            self.session = NvmlSession(self.nvml, self.nvml_timeout_seconds, self.clock)

    @property
    def nvml_session(self) -> NvmlSession:
        """The session, for collectors that cannot run without NVML."""
        if self.session is None:
            raise RuntimeError("this collector needs NVML: the context has no nvml module")
        return self.session


class Collector(Protocol):
    def collect(self) -> Iterable[Metric]: ...


C = TypeVar("C", bound=Callable[[Context], Collector])


@dataclass(frozen=True)
class Registration:
    name: str
    factory: Callable[[Context], Collector]
    help: str
    default_enabled: bool


REGISTRY: dict[str, Registration] = {}


def register(name: str, help: str, default_enabled: bool = True) -> Callable[[C], C]:
    """Class decorator: make the collector selectable as ``--collector.<name>``."""
    def wrap(cls: C) -> C:
        REGISTRY[name] = Registration(name, cls, help, default_enabled)
        return cls
    return wrap


def load_collectors() -> dict[str, Registration]:
    """Import every module under ``collectors/`` so that they register; returns them in name order."""
    from gpuhealth.exporter import collectors

    for module in pkgutil.iter_modules(collectors.__path__):
        importlib.import_module(f"{collectors.__name__}.{module.name}")
    return dict(sorted(REGISTRY.items()))
