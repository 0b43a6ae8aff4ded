"""Cluster backends: the only code that acts on a scheduler or orchestrator.

The config's ``backend`` section names a backend by ``type``; the rest of the section is passed to
that class's ``from_config``, which raises ``ValueError`` listing every problem it found. A built-in
type is looked up by module, then by the class whose ``name`` equals the type, so that a backend
module stays free to name its class as it likes. ``type: "package.module:Class"`` loads an
out-of-tree backend the same way.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

from gpuhealth.webhook.backends.base import Backend, BackendError, NodeState

__all__ = ["BUILTIN", "Backend", "BackendError", "NodeState", "backend_class", "create_backend"]

BUILTIN = {
    "slurm": "gpuhealth.webhook.backends.slurm",
    "kubernetes": "gpuhealth.webhook.backends.kubernetes",
    "command": "gpuhealth.webhook.backends.command",
    "simulated": "gpuhealth.webhook.backends.simulated",
}


class BackendClass(Protocol):
    """A backend class: ``from_config`` validates its settings and builds it."""

    def from_config(self, settings: dict[str, Any]) -> Backend: ...


def backend_class(kind: str) -> BackendClass:
    """The class for a backend ``type``; ``ValueError`` with the known types when there is none."""
    if ":" in kind:
        module_name, _, class_name = kind.partition(":")
        try:
            cls: BackendClass = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"backend type {kind!r} cannot be loaded: {exc}") from None
        return cls
    if kind not in BUILTIN:
        raise ValueError(f"unknown backend type {kind!r}; known: {', '.join(sorted(BUILTIN))}, "
                         "or 'package.module:Class'")
    try:
        module = importlib.import_module(BUILTIN[kind])
    except ImportError as exc:
        raise ValueError(f"backend type {kind!r} is not available: {exc}") from None
    for value in vars(module).values():
        if isinstance(value, type) and getattr(value, "name", None) == kind and hasattr(value, "from_config"):
            found: BackendClass = value
            return found
    raise ValueError(f"backend module {BUILTIN[kind]} defines no class with name = {kind!r}")


def create_backend(section: dict[str, Any]) -> Backend:
    """Build the configured backend; every problem comes back in one ``ValueError``."""
    settings = dict(section)
    kind = settings.pop("type", None)
    if not isinstance(kind, str) or not kind:
        raise ValueError(f"backend.type is required, one of: {', '.join(sorted(BUILTIN))}")
    return backend_class(kind).from_config(settings)
