"""The grammar of every alert value an action uses, and the cleaning of free text.

A label reaches a scheduler's command line, a remote shell behind ``ssh`` or a Kubernetes
annotation, so each is held to the narrowest grammar that still names what it must: one node, one
GPU, one alert name. Nothing outside it is passed on, and nothing a shell could parse fits it.
Free text (the summary) only ever goes into a reason or a log, cleaned of control characters and
terminal escape sequences first.
"""

from __future__ import annotations

import re
import unicodedata

from gpuhealth.contract.gpu import GPU
from gpuhealth.webhook.actions import ALERT_ACTIONS, KINDS, NONE
from gpuhealth.webhook.outcomes import Reason

# One node name: Slurm reads "gpu[01-64]", "a,b" or "ALL" as many nodes, and a label must never widen
# what one alert acts on. ASCII only (no look-alikes), no leading "-" (never an option).
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")
HOSTLIST_WORDS = frozenset({"ALL"})  # names scontrol reads as every node, in any case
# The exporter's gpu label for a kernel-log event it could not match to a GPU: the node is known, the
# GPU is not. A node-wide action may go ahead; one that acts on a GPU may not.
UNKNOWN_GPU = "unknown"
# Prometheus's metric (and alert) name grammar, bounded so that a reason still has room for it.
ALERT_NAME = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]{0,119}")
# A signal as scancel and kill name it (USR1, SIGUSR2, 10): configured, never from an alert.
SIGNAL = re.compile(r"(SIG)?[A-Z][A-Z0-9]{0,15}|[0-9]{1,2}")
UNNAMED_ALERT = "alert"  # stands for a missing alertname in a reason or a command's {alertname}
SHOWN_CHARS = 80  # of an invalid value, quoted, in a reason or a log
TEXT_CHARS = 200  # of cleaned free text
# CSI (ESC [ ... final), OSC (ESC ] ... BEL or ESC \) and two-character escapes.
_ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x9b[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?"
                      r"|\x1b[@-_]?")


def valid_node(node: str) -> bool:
    return bool(NODE_NAME.fullmatch(node)) and node.upper() not in HOSTLIST_WORDS


def shown(value: str) -> str:
    """An untrusted value as a reason or a log may quote it: ASCII, escaped, bounded, one line."""
    text = ascii(value[:SHOWN_CHARS])
    return text + ("..." if len(value) > SHOWN_CHARS else "")


def clean_text(text: str, limit: int = TEXT_CHARS) -> str:
    """Free text for a reason or a log: no escape sequences, control, format or surrogate characters,
    one line of single spaces, at most ``limit`` characters."""
    if not text.isprintable():  # printable text (the usual case) holds no control or escape at all
        text = _ESCAPES.sub(" ", text)
        text = "".join(c if c.isprintable() or unicodedata.category(c) == "Zs" else " " for c in text)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3].rstrip() + "..."


def journaled(node: str, gpu: str, alertname: str) -> tuple[str, str, str]:
    """The values as an action row keeps them: each valid one as it is, an invalid one quoted."""
    def kept(value: str, ok: bool) -> str:
        return value if ok or not value else shown(value)

    return (kept(node, valid_node(node)), kept(gpu, valid_gpu_label(gpu)),
            kept(alertname, bool(ALERT_NAME.fullmatch(alertname))))


def valid_gpu_label(gpu: str) -> bool:
    return gpu == UNKNOWN_GPU or bool(GPU.fullmatch(gpu))


def label_problem(node: str, gpu: str, alertname: str) -> tuple[Reason, str] | None:
    """Why an alert's values cannot be acted on, or None; ``node`` must be present and valid, ``gpu``
    and ``alertname`` valid when present."""
    if not node:
        return Reason.NO_NODE, "the alert has no node label"
    if not valid_node(node):
        return Reason.INVALID_NODE, f"node label {shown(node)} is not one node name"
    if gpu and not valid_gpu_label(gpu):
        return Reason.INVALID_LABEL, f"gpu label {shown(gpu)} is neither a GPU index nor a GPU-<uuid>"
    if alertname and not ALERT_NAME.fullmatch(alertname):
        return Reason.INVALID_LABEL, f"alertname {shown(alertname)} is not a Prometheus alert name"
    return None


def action_problem(kind: str, node: str, gpu: str, alertname: str) -> tuple[Reason, str] | None:
    """Why action ``kind`` cannot act on these values, or None: an unknown kind, a value outside its
    grammar, or a step that acts on one GPU when the alert names no real one. ``none`` acts on nothing."""
    if kind == NONE:
        return None
    if kind not in KINDS:
        return unknown_action(kind)
    problem = label_problem(node, gpu, alertname)
    if problem is not None:
        return problem
    if KINDS[kind].needs_gpu and not GPU.fullmatch(gpu):
        named = f"its gpu label is {shown(gpu)}" if gpu else "it has no gpu label"
        return Reason.NO_GPU, f"{kind} acts on one GPU and the alert names none ({named})"
    return None


def unknown_action(asked: str) -> tuple[Reason, str]:
    known = ", ".join(ALERT_ACTIONS)
    return Reason.UNKNOWN_ACTION, f"action label {shown(asked)} names no action the webhook knows ({known})"
