"""The recovery action announced by XID 154, kept across exporter restarts.

The kernel log is resumed after the last record handled, so a restarted exporter never reads the
XID 154 line again; without this file a GPU waiting for a reset would read "none" after a restart
on drivers whose NVML cannot be polled for the action. A reboot clears it (the boot id changes).
"""

from __future__ import annotations

import logging
from pathlib import Path

from gpuhealth.exporter.metrics import RECOVERY_ACTIONS

log = logging.getLogger(__name__)


def load_recovery(path: Path | None, boot_id: str) -> dict[str, str]:
    """{gpu: action} saved during this boot; empty when missing, unreadable or from another boot."""
    if path is None:
        return {}
    try:
        first, *lines = path.read_text().splitlines()
    except (OSError, ValueError):
        return {}
    if first != boot_id:
        return {}
    actions = {}
    for line in lines:
        gpu, _, action = line.partition(" ")
        if action in RECOVERY_ACTIONS:
            actions[gpu] = action
    return actions


def save_recovery(path: Path | None, boot_id: str, actions: dict[str, str]) -> None:
    if path is None:
        return
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text("".join([f"{boot_id}\n", *(f"{gpu} {a}\n" for gpu, a in sorted(actions.items()))]))
        tmp.replace(path)
    except OSError as exc:  # the metric is still right until the next restart
        log.warning("cannot save recovery actions path=%s error=%s", path, exc)
