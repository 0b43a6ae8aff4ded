"""What ``scontrol show node|job -o`` prints, parsed in one place.

The Slurm backend and the local test cluster (``gpuhealth.local.slurm``) read the same lines; two
parsers had already drifted apart over Slurm's ``[user@time]`` suffix on a node's reason.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

_STATE = re.compile(r"(?:^|\s)State=(\S+)")
# The Reason runs up to the Comment/Extra Slurm prints after it; Slurm appends " [user@time]" to it.
_REASON = re.compile(r"\sReason=(?P<reason>.*?)(?P<stamp>\s\[[^\[\]]*@[^\[\]]*\])?(?=\s(?:Comment|Extra)=|$)")
_FIELD = re.compile(r"(?:^|\s)([A-Za-z]+)=(\S*)")


@dataclass(frozen=True)
class NodeLine:
    """One node: ``state`` with its flags (``IDLE+DRAIN``) and its reason, as set and as printed."""

    state: str
    reason: str  # as it was set: without Slurm's " [user@time]"
    stamp: str = ""  # Slurm's " [user@time]", when printed

    @property
    def flags(self) -> set[str]:
        return set(self.state.split("+")) if self.state else set()

    @property
    def printed_reason(self) -> str:
        return self.reason + self.stamp


def parse_node_line(line: str) -> NodeLine:
    state = _STATE.search(line)
    reason = _REASON.search(line)
    return NodeLine(state[1] if state else "", reason["reason"] if reason else "",
                    (reason["stamp"] or "") if reason else "")


def job_fields(text: str, keys: Iterable[str]) -> dict[str, str]:
    """The job's own ``keys``: the first of each, as a Comment or Command printed later may hold text
    that looks like one."""
    wanted = frozenset(keys)
    fields: dict[str, str] = {}
    for key, value in _FIELD.findall(text):
        if key in wanted:
            fields.setdefault(key, value)
    return fields
