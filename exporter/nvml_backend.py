"""The NVML module a backend name stands for: real ``pynvml``, or the simulator with its scenario.

Shared by the exporter and ``gpuhealth-validate``, so both read a simulated node the same way and a
test scenario means the same thing to both.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

BACKENDS = ("nvml", "sim")


def load_nvml(backend: str, kmsg_path: Path | None = None, scenario: Path | None = None,
              profile: str | None = None, mig: bool = False, sysfs: Path | None = None) -> Any:
    """The module for ``backend``, not yet initialised (callers initialise it under a deadline).

    With ``sim``, ``scenario`` is read (``ScenarioError`` lists its problems), the simulator's
    kernel lines go to ``kmsg_path`` when it is a regular file (fake XIDs never reach a device), and
    its PCI tree and InfiniBand ports are written under ``sysfs`` (a private directory) when given.
    """
    if backend == "sim":
        from gpuhealth.exporter.sim.nvml import SimulatedNvml
        from gpuhealth.exporter.sim.profiles import DEFAULT_PROFILE, load_profile
        from gpuhealth.exporter.sim.scenario import load_scenario

        if kmsg_path is not None and kmsg_path.exists() and not kmsg_path.is_file():
            log.info("simulated kernel lines are not written to a device path=%s", kmsg_path)
            kmsg_path = None
        hardware = load_profile(profile or DEFAULT_PROFILE)
        node = load_scenario(scenario)
        if profile is not None:
            node = dataclasses.replace(node, model=hardware.model, nvlinks=hardware.nvlinks)
        return SimulatedNvml(node, kmsg_path, profile=hardware, mig=mig, sysfs=sysfs)
    import pynvml

    return pynvml
