"""Journal schema versions: an older file is carried forward in place, a newer one is refused."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from gpuhealth.webhook.config import parse_config
from gpuhealth.webhook.intake import resolve
from gpuhealth.webhook.journal import Journal
from gpuhealth.webhook.models import parse_notification
from gpuhealth.webhook.policy import decide
from gpuhealth.webhook.schema import LATEST, MIGRATIONS, SchemaTooNew, pending
from webhook_helpers import alert, notification

UNVERSIONED = Path(__file__).parent / "journal_fixtures" / "unversioned_v1.sql"
CONFIG = parse_config({"backend": {"type": "simulated", "nodes": ["gpu01"]}})


def _version(path: Path) -> int:
    with sqlite3.connect(path) as db:
        return int(db.execute("PRAGMA user_version").fetchone()[0])


def test_an_unversioned_file_is_version_1_and_migrates_in_place_keeping_its_records(tmp_path):
    path = tmp_path / "journal.sqlite3"
    with sqlite3.connect(path) as db:
        db.executescript(UNVERSIONED.read_text())
    assert _version(path) == 0
    journal = Journal(path)
    assert _version(path) == LATEST
    [action] = journal.list_actions()
    assert (action.kind, action.node, action.state, action.claimed_by) == ("drain", "gpu01", "pending", "")
    again = parse_notification(notification(alert("gpu01", action="drain", fingerprint="0000000000000001")))
    [result] = journal.record([(again, decide(again, CONFIG))], resolve)
    assert result.new_actions == [] and result.duplicates == 1  # the migrated alert still deduplicates
    journal.close()
    Journal(path).close()  # opening an up-to-date file again changes nothing
    assert _version(path) == LATEST


def test_a_new_file_gets_every_migration(tmp_path):
    Journal(tmp_path / "journal.sqlite3").close()
    assert _version(tmp_path / "journal.sqlite3") == LATEST == len(MIGRATIONS)


def test_a_file_from_a_newer_webhook_is_refused_untouched(tmp_path):
    path = tmp_path / "journal.sqlite3"
    Journal(path).close()
    with sqlite3.connect(path) as db:
        db.execute(f"PRAGMA user_version = {LATEST + 1}")
    with pytest.raises(SchemaTooNew, match=f"schema version {LATEST + 1}"):
        Journal(path)
    assert _version(path) == LATEST + 1


def test_migrations_are_numbered_in_order_for_both_databases():
    assert [m.version for m in MIGRATIONS] == list(range(1, LATEST + 1))
    assert all(m.sqlite.strip() and m.postgres.strip() and m.why for m in MIGRATIONS)
    assert pending(1) == MIGRATIONS[1:] and pending(LATEST) == ()
