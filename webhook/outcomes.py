"""Why an action ended as it did: a closed vocabulary, so that every counter exists from the start.

An alert for "why did the webhook not act" needs the zero series to exist before the first skip.
"""

from __future__ import annotations

from enum import StrEnum


class Outcome(StrEnum):
    DONE = "done"
    DRY_RUN = "dry_run"
    SKIPPED = "skipped"
    DEFERRED = "deferred"  # will be tried again later
    FAILED = "failed"
    CANCELLED = "cancelled"


class Reason(StrEnum):
    OK = "ok"
    RECORD_ONLY = "record_only"  # action "none"
    ALREADY_RESUMED = "already_resumed"  # undrain found the node back in service
    DRY_RUN = "dry_run"
    NO_NODE = "no_node"  # the alert has no node label
    INVALID_NODE = "invalid_node"  # a label a scheduler would read as many nodes ("gpu[01-64]", "ALL,x")
    INVALID_LABEL = "invalid_label"  # a gpu or alertname outside its grammar ("0;reboot", "all", "-h")
    UNKNOWN_ACTION = "unknown_action"  # the alert's action label names no action the webhook knows
    NO_GPU = "no_gpu"  # a step acts on one GPU and the alert names none (no gpu label, or "unknown")
    NOT_ALLOWED = "not_allowed"  # not on the allow list
    DENIED = "denied"  # on the deny list
    UNKNOWN_NODE = "unknown_node"
    DRAINED_BY_OTHER = "drained_by_other"
    ALREADY_DRAINED = "already_drained"
    COOLDOWN = "cooldown"
    BREAKER_OPEN = "breaker_open"
    NOT_DRAINED_BY_US = "not_drained_by_us"
    STILL_FIRING = "still_firing"  # undrain while another draining alert fires on the node
    LEFT_FOR_HUMAN = "left_for_human"
    HEALTH_CHECK_FAILED = "health_check_failed"
    DROPPED_AT_RESET = "dropped_at_reset"  # held by the open breaker, dropped by the operator's reset
    RATE_LIMITED = "rate_limited"
    JOB_RETRY_INTERVAL = "job_retry_interval"
    BACKEND_ERROR = "backend_error"
    RESOLVED = "resolved"  # the alert resolved before the action started
    OPERATOR = "operator"  # cancelled through the API


VALID: dict[Outcome, tuple[Reason, ...]] = {
    Outcome.DONE: (Reason.OK, Reason.RECORD_ONLY, Reason.ALREADY_RESUMED),
    Outcome.DRY_RUN: (Reason.DRY_RUN,),
    Outcome.SKIPPED: (Reason.NO_NODE, Reason.INVALID_NODE, Reason.INVALID_LABEL, Reason.UNKNOWN_ACTION,
                      Reason.NO_GPU, Reason.NOT_ALLOWED,
                      Reason.DENIED, Reason.UNKNOWN_NODE, Reason.DRAINED_BY_OTHER, Reason.ALREADY_DRAINED,
                      Reason.BREAKER_OPEN, Reason.NOT_DRAINED_BY_US, Reason.STILL_FIRING,
                      Reason.LEFT_FOR_HUMAN, Reason.HEALTH_CHECK_FAILED, Reason.DROPPED_AT_RESET),
    Outcome.DEFERRED: (Reason.COOLDOWN, Reason.RATE_LIMITED, Reason.JOB_RETRY_INTERVAL, Reason.BACKEND_ERROR,
                       Reason.HEALTH_CHECK_FAILED),
    Outcome.FAILED: (Reason.BACKEND_ERROR,),
    Outcome.CANCELLED: (Reason.RESOLVED, Reason.OPERATOR),
}
