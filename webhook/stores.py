"""Which store the configuration names: SQLite in ``state_dir`` by default, PostgreSQL with
``journal.url`` (the optional ``gpuhealth[postgres]`` extra), shared by every replica."""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Callable
from types import ModuleType

from gpuhealth.webhook.config import Config
from gpuhealth.webhook.intake import resolve
from gpuhealth.webhook.journal import AsyncJournal, Journal
from gpuhealth.webhook.schema import SchemaTooNew


class StoreUnavailable(Exception):
    """The configured journal cannot be opened: the webhook does not start."""


def describe(config: Config) -> str:
    """The journal's location for logs, without a password."""
    if config.journal.url is None:
        return str(config.journal_path)
    return redacted_url(config.journal.url)


def redacted_url(url: str) -> str:
    """A libpq URL as a log may show it: scheme, hosts, ports and database. The user information (up to
    the last ``@``: a password may hold ``@``, ``/`` or ``?``) and the parameters (``?password=``) are
    ``***``; a user name is kept when it is a plain name, the rest only when it is plainly a location."""
    scheme, _, rest = url.partition("://")
    userinfo, at, location = rest.rpartition("@")
    location, query, _ = location.partition("?")
    if not re.fullmatch(r"[A-Za-z0-9._:,\[\]-]*(/[A-Za-z0-9._-]*)?", location):
        location = "***"  # the last "@" was inside the parameters: nothing after it is sure to be a location
    user, colon, _ = userinfo.partition(":")
    shown_user = (user if re.fullmatch(r"[A-Za-z0-9._-]+", user) else "***") + (":***" if colon else "")
    return f"{scheme}://{shown_user + '@' if at else ''}{location}{'?***' if query else ''}"


def _postgres() -> ModuleType:
    try:
        from gpuhealth.webhook import store_postgres
    except ImportError as exc:
        raise StoreUnavailable(f"journal.url needs psycopg 3 ({exc}): "
                               "pip install 'gpuhealth[postgres]'") from None
    return store_postgres


def check(config: Config) -> None:
    """Open the journal once, migrating it, before serving: a bad one stops the start-up."""
    try:
        if config.journal.url is None:
            Journal(config.journal_path, config.journal_busy_timeout_seconds).close()
            return
        store_postgres = _postgres()
        try:
            store_postgres.PostgresJournal(config.journal.url, config.replica,
                                           config.journal.lease_seconds).close()
        except store_postgres.psycopg.Error as exc:
            raise StoreUnavailable(f"journal {describe(config)}: {exc}") from None
    except (sqlite3.Error, SchemaTooNew) as exc:
        raise StoreUnavailable(f"journal {describe(config)}: {exc}") from None


def open_store(config: Config, on_failure: Callable[[], object]) -> AsyncJournal:
    if config.journal.url is None:
        return AsyncJournal(config.journal_path, resolve, config.journal_busy_timeout_seconds, on_failure,
                            config.replica)
    store: AsyncJournal = _postgres().AsyncPostgresJournal(
        config.journal.url, resolve, config.replica, config.journal.lease_seconds, on_failure,
        commit_window=config.journal.commit_window_seconds)
    return store
