"""The journal on its own: retention keeps exactly what deduplication and undrain still need."""

from __future__ import annotations

import time

from gpuhealth.webhook.config import parse_config
from gpuhealth.webhook.intake import resolve
from gpuhealth.webhook.journal import Journal
from gpuhealth.webhook.models import parse_notification
from gpuhealth.webhook.policy import decide
from webhook_helpers import alert, notification, resolved

CONFIG = parse_config({"backend": {"type": "simulated", "nodes": ["gpu01"]}})


def _record(journal: Journal, *alerts: dict) -> list[int]:
    parsed = parse_notification(notification(*alerts))
    [result] = journal.record([(parsed, decide(parsed, CONFIG))], resolve)
    return result.new_actions


def test_prune_forgets_finished_history_but_keeps_what_is_still_needed(tmp_path):
    journal = Journal(tmp_path / "journal.sqlite3")
    still_firing, gone = alert("gpu01", action="drain"), alert("gpu02", action="restart_job")
    waiting = alert("gpu03", action="drain")
    [firing_id, gone_id, waiting_id] = _record(journal, still_firing, gone, waiting)
    for action_id in (firing_id, gone_id):
        journal.update(action_id, "done", expect="pending", outcome="done", reason="ok")
    _record(journal, resolved(gone))
    pruned = journal.prune(time.time() + 1)
    assert pruned["actions"] == 1 and pruned["alerts"] == 1 and pruned["transitions"] >= 2
    assert journal.get(gone_id) is None
    assert journal.get(firing_id).state == "done" and journal.get(waiting_id).state == "pending"
    assert _record(journal, still_firing) == []  # a re-delivery of the firing alert stays a duplicate
    assert journal.transitions(firing_id)
    journal.close()
