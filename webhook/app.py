"""The aiohttp application: receive, journal, answer; the worker does the acting.

``POST /alerts`` answers 200 once the notification is committed to the journal, 400 for a body
Alertmanager should not send again, 401 without credentials, and 503 only when the journal cannot
be written, which is the one case where Alertmanager's retry helps.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jinja2
from aiohttp import web
from aiohttp.typedefs import Handler
from gpuhealth.webhook.announce import Announcer
from gpuhealth.webhook.auth import Authenticator
from gpuhealth.webhook.backends import Backend, create_backend
from gpuhealth.webhook.backends.helpers import TracksHelpers
from gpuhealth.webhook.config import Config
from gpuhealth.webhook.engine import Engine
from gpuhealth.webhook.intake import wakes_worker
from gpuhealth.webhook.journal import JOURNAL_ERRORS
from gpuhealth.webhook.metrics import Metrics
from gpuhealth.webhook.models import (
    PayloadError,
    decode_body,
    may_hold_surrogate,
    parse_notification,
    rfc3339,
)
from gpuhealth.webhook.outcomes import Outcome, Reason
from gpuhealth.webhook.policy import decide
from gpuhealth.webhook.store import (
    ACTIVE_STATES,
    AWAITING_APPROVAL,
    CANCELLED,
    PENDING,
    RUNNING,
    STATES,
    JournalUnwritable,
    Store,
)
from gpuhealth.webhook.stores import describe, open_store
from gpuhealth.webhook.worker import Worker
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

log = logging.getLogger(__name__)

CONFIG = web.AppKey("config", Config)
BACKEND = web.AppKey("backend", Backend)
AUTH = web.AppKey("auth", Authenticator)
METRICS = web.AppKey("metrics", Metrics)
JOURNAL = web.AppKey("journal", Store)
ENGINE = web.AppKey("engine", Engine)
WORKER = web.AppKey("worker", Worker)

_TEMPLATES = jinja2.Environment(loader=jinja2.FileSystemLoader(Path(__file__).parent), autoescape=True,
                                undefined=jinja2.StrictUndefined)


def _json_error(status: type[web.HTTPException], message: str) -> web.HTTPException:
    return status(text=json.dumps({"error": message}), content_type="application/json")


@web.middleware
async def _json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure answers JSON: a journal that cannot be written is a 503 (retry later), a bug a 500
    without a traceback to the client."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400 or exc.content_type == "application/json":
            raise
        # aiohttp's own answers (no route, wrong method, body too large) are plain text: JSON them too
        headers = {k: v for k, v in exc.headers.items() if k not in ("Content-Type", "Content-Length")}
        return web.json_response({"error": exc.text or exc.reason}, status=exc.status, headers=headers)
    except (JournalUnwritable, *JOURNAL_ERRORS) as exc:
        log.error("event=journal_error path=%r error=%r", request.path[:100], exc)
        raise _json_error(web.HTTPServiceUnavailable, f"journal cannot be written now: {exc}") from None
    except Exception:
        log.exception("event=request_error path=%r", request.path[:100])
        raise _json_error(web.HTTPInternalServerError, "internal error (logged)") from None


ACTOR = web.RequestKey("actor", str)  # the audit name of who made the request
# The status page runs no script and is never framed; no answer is to be sniffed as another type.
SECURITY_HEADERS = {"X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY",
                    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; "
                                               "frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
                    "Referrer-Policy": "no-referrer"}


async def _security_headers(request: web.Request, response: web.StreamResponse) -> None:
    """Alert text is shown on the status page: should escaping ever miss, the browser still runs and
    loads nothing, and no page can frame it to trick a click."""
    response.headers.update(SECURITY_HEADERS)


@web.middleware
async def _no_browser_writes(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Writes come from Alertmanager and operators' tools, never from a web page: browsers mark every
    cross-site write (a form, a no-cors fetch) with ``Origin``, so a page cannot drive the webhook
    through an operator's browser when an authenticating proxy supplies the credentials."""
    if request.method not in ("GET", "HEAD", "OPTIONS") and (
            "Origin" in request.headers or request.headers.get("Sec-Fetch-Site", "none") != "none"):
        raise _json_error(web.HTTPForbidden, "requests from a web page cannot change anything here")
    return await handler(request)


@web.middleware
async def _require_auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every request that changes something needs credentials (alerts: intake; the rest: operator);
    reads stay open."""
    if request.method not in ("GET", "HEAD", "OPTIONS"):
        intake = request.path == "/alerts"
        headers = request.headers.getall("Authorization", [])
        # two credentials in one request: a proxy may have checked the other one, so neither counts
        header = headers[0] if len(headers) == 1 else None
        who = request.app[AUTH].identify(header, operator=not intake)
        if who is None:
            if intake:
                request.app[METRICS].notifications.labels("unauthorized").inc()
            log.warning("event=unauthorized path=%r remote=%s", request.path[:100], request.remote)
            raise web.HTTPUnauthorized(text=json.dumps({"error": "missing or wrong credentials"}),
                                       content_type="application/json",
                                       headers={"WWW-Authenticate": 'Bearer realm="gpuhealth-webhook"'})
        request[ACTOR] = who
    return await handler(request)


async def post_alerts(request: web.Request) -> web.Response:
    metrics = request.app[METRICS]
    if request.content_type != "application/json":
        # Alertmanager always sends JSON; the types a browser may send cross-site without asking
        # (text/plain, forms) never reach the parser, whatever headers a proxy strips
        metrics.notifications.labels("malformed").inc()
        raise _json_error(web.HTTPUnsupportedMediaType,
                          f"expected Content-Type: application/json, got {request.content_type[:60]!r}")
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        metrics.notifications.labels("too_large").inc()
        raise
    except web.RequestPayloadError as exc:  # a broken gzip/deflate body or chunked encoding
        metrics.notifications.labels("malformed").inc()
        detail = " ".join(str(exc.__cause__ or exc).split())
        log.warning("event=notification_rejected remote=%s error=%r", request.remote, detail[:200])
        # the rest of the stream cannot be parsed: end the body here and close after answering
        request.content.feed_eof()
        answer = web.json_response({"error": f"body cannot be read: {detail[:200]}"}, status=400)
        answer.force_close()
        return answer
    try:
        notification = parse_notification(decode_body(raw), surrogates=may_hold_surrogate(raw))
    except PayloadError as exc:
        metrics.notifications.labels("malformed").inc()
        message = str(exc)
        log.warning("event=notification_rejected remote=%s error=%r", request.remote, message[:300])
        raise _json_error(web.HTTPBadRequest, message) from None
    if notification.truncated_alerts:
        log.warning("event=notification_truncated receiver=%r dropped_alerts=%d (raise max_alerts in the "
                    "Alertmanager receiver or group alerts more finely)", notification.receiver,
                    notification.truncated_alerts)
    journal = request.app[JOURNAL]
    decisions = decide(notification, request.app[CONFIG])
    try:
        result = await journal.record(notification, decisions)
    except (JournalUnwritable, *JOURNAL_ERRORS) as exc:
        metrics.notifications.labels("journal_error").inc()
        log.error("event=journal_write_failed error=%r", exc)
        raise _json_error(web.HTTPServiceUnavailable, f"journal cannot be written: {exc}") from None
    except ValueError as exc:  # this notification alone could not be stored; the others of its commit were
        metrics.notifications.labels("malformed").inc()
        log.warning("event=notification_rejected remote=%s error=%r", request.remote, str(exc)[:300])
        raise _json_error(web.HTTPBadRequest, f"notification cannot be stored: {exc}") from None
    if wakes_worker(result, decisions):
        request.app[WORKER].wake()
    for kind in result.cancelled:
        metrics.action(kind, Outcome.CANCELLED, Reason.RESOLVED)
    for action_id, kind, reason, detail in result.refused:
        metrics.action(kind, Outcome.SKIPPED, Reason(reason))
        log.warning("event=action_skipped id=%s kind=%s reason=%s detail=%r", action_id, kind, reason, detail)
    all_seen = bool(notification.alerts) and result.duplicates == len(notification.alerts)
    outcome = "duplicate" if all_seen else "accepted"
    metrics.notifications.labels(outcome).inc()
    log.info("event=notification_%s id=%s receiver=%r alerts=%d new_actions=%d duplicates=%d resolved=%d",
             outcome, result.notification_id, notification.receiver[:100], len(notification.alerts),
             len(result.new_actions), result.duplicates, result.resolved)
    return web.json_response({"status": outcome, "notification": result.notification_id,
                              "alerts": len(notification.alerts), "new_actions": result.new_actions,
                              "duplicates": result.duplicates, "resolved": result.resolved})


CHAINS_SHOWN = 100  # the newest escalation chains in /actions and on the page
UNIX_SECONDS = re.compile(r"[0-9]{1,12}(?:\.[0-9]{1,9})?")
ACTION_ID = re.compile(r"[0-9]{1,18}")  # fits SQLite's 64-bit integer


def _since(value: str | None) -> float | None:
    if value is None:
        return None
    if UNIX_SECONDS.fullmatch(value):
        return float(value)
    parsed = rfc3339(value)
    if parsed is None:
        raise _json_error(web.HTTPBadRequest, f"since: {value[:40]!r} is neither unix seconds nor an "
                                              "RFC 3339 time with its time zone")
    try:
        return parsed.timestamp()
    except OverflowError:
        raise _json_error(web.HTTPBadRequest, f"since: {value[:40]!r} is out of range") from None


async def get_actions(request: web.Request) -> web.Response:
    query = request.query
    state = query.get("state")
    if state is not None and state not in STATES:
        raise _json_error(web.HTTPBadRequest, f"state: one of {', '.join(STATES)}")
    limit = query.get("limit", "500")
    if not re.fullmatch(r"[0-9]{1,5}", limit) or not 0 < int(limit) <= 10000:
        raise _json_error(web.HTTPBadRequest, "limit: an integer 1..10000")
    before = query.get("before")
    if before is not None and not ACTION_ID.fullmatch(before):
        raise _json_error(web.HTTPBadRequest, "before: an action id (ASCII digits)")
    journal = request.app[JOURNAL]
    since = _since(query.get("since"))
    actions = await journal.list_actions(query.get("node"), state, since, int(limit),
                                         before=None if before is None else int(before))
    chains = await journal.chains(query.get("node"), CHAINS_SHOWN)
    return web.json_response({"actions": [a.as_json() for a in actions],
                              "chains": [c.as_json() for c in chains]})


def _action_id(request: web.Request) -> int:
    raw = request.match_info["id"]
    if not ACTION_ID.fullmatch(raw):
        raise _json_error(web.HTTPNotFound, f"no action {raw[:40]!r}")
    return int(raw)


async def get_action(request: web.Request) -> web.Response:
    journal = request.app[JOURNAL]
    action = await journal.get(_action_id(request))
    if action is None:
        raise _json_error(web.HTTPNotFound, "no such action")
    transitions = await journal.transitions(action.id)
    return web.json_response(action.as_json() | {"transitions": transitions})


async def _move(request: web.Request, from_states: tuple[str, ...], to: str, verb: str,
                outcome: str = "") -> web.Response:
    journal = request.app[JOURNAL]
    action_id = _action_id(request)
    who = request[ACTOR]
    moved = await journal.try_move(action_id, from_states, to, "operator" if to == CANCELLED else "approved",
                                   f"{verb} by {who}", outcome)
    chain = await request.app[ENGINE].escalation.cancel(action_id, who) if to == CANCELLED else None
    if moved is None:
        current = await journal.get(action_id)
        if current is None:
            raise _json_error(web.HTTPNotFound, "no such action")
        if chain is not None:  # the step ended; its chain stops before the next one
            return web.json_response(current.as_json() | {"chain": chain.as_json()})
        raise _json_error(web.HTTPConflict, f"action {action_id} is {current.state}; only "
                                            f"{' or '.join(from_states)} actions can be {verb}")
    log.warning("event=action_%s id=%s kind=%s node=%s by=%s", verb, action_id, moved.kind, moved.node, who)
    if to == CANCELLED:
        request.app[METRICS].action(moved.kind, Outcome.CANCELLED, Reason.OPERATOR)
    await request.app[ENGINE].announcer.transition(moved, verb, f"{verb} by {who}", by=who)
    request.app[WORKER].wake()
    return web.json_response(moved.as_json() | ({"chain": chain.as_json()} if chain is not None else {}))


async def approve(request: web.Request) -> web.Response:
    return await _move(request, (AWAITING_APPROVAL,), PENDING, "approved")


async def cancel(request: web.Request) -> web.Response:
    # a running action stops before its next step (the step under way finishes)
    return await _move(request, (PENDING, AWAITING_APPROVAL, RUNNING), CANCELLED, "cancelled",
                       Outcome.CANCELLED.value)


async def reset_breaker(request: web.Request) -> web.Response:
    who = request[ACTOR]
    held = request.query.get("held", "keep")
    if held not in ("keep", "replay", "drop"):
        raise _json_error(web.HTTPBadRequest, "held: keep (default), replay or drop")
    state = await request.app[ENGINE].reset_breaker(who, held)
    request.app[WORKER].wake()
    return web.json_response({"breaker": state})


async def _status(app: web.Application) -> dict[str, Any]:
    journal = app[JOURNAL]
    counts = await journal.counts()
    drained = await journal.drained()
    breaker = await app[ENGINE].breaker()
    metrics = app[METRICS]
    metrics.queue_depth.set(sum(counts[s] for s in ACTIVE_STATES))
    metrics.breaker_open.set(int(breaker["open"]))
    metrics.nodes_drained.set(len(drained))
    jobs = await journal.exhausted_jobs()
    claims = await journal.claims()
    metrics.claimed_actions.clear()
    for replica in {app[CONFIG].replica, *claims}:
        metrics.claimed_actions.labels(replica).set(len(claims.get(replica, ())))
    held = await app[ENGINE].held_by_breaker()
    chains = await journal.chain_counts()
    for state, count in chains.items():
        metrics.chains.labels(state).set(count)
    return {
        "replica": app[CONFIG].replica,
        "claims": claims,
        "dry_run": app[CONFIG].dry_run,
        "undrain_mode": app[CONFIG].undrain.mode,
        "backend": app[BACKEND].name,
        "breaker": breaker,
        "drained_by_us": [{"node": n, "since": e.since, "reason": e.reason, "action_id": e.action_id,
                           "left_for_human": e.keep or app[CONFIG].undrain.mode == "manual"}
                          for n, e in drained.items()],
        "queue": counts,
        "jobs_out_of_retries": [{"job_id": j.job_id, "attempts": j.attempts, "nodes": j.excluded,
                                 "last_at": j.last_at} for j in jobs],
        "held_by_breaker": [{"id": a.id, "kind": a.kind, "node": a.node, "alertname": a.alertname,
                             "since": a.updated_at} for a in held],
        "chains": chains,
        "worker_alive": app[WORKER].alive,
    }


async def get_status(request: web.Request) -> web.Response:
    return web.json_response(await _status(request.app))


async def get_metrics(request: web.Request) -> web.Response:
    await _status(request.app)  # refreshes the gauges read from the journal
    body = generate_latest(request.app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def healthz(request: web.Request) -> web.Response:
    journal = request.app[JOURNAL]
    try:
        await journal.counts()
    except sqlite3.Error as exc:
        raise _json_error(web.HTTPServiceUnavailable, f"journal: {exc}") from None
    if journal.write_error is not None:
        raise _json_error(web.HTTPServiceUnavailable, f"journal cannot be written: {journal.write_error}")
    if not request.app[WORKER].alive:
        raise _json_error(web.HTTPServiceUnavailable, "action worker stopped")
    return web.json_response({"ok": True})


def _when(ts: float | None) -> str:
    return "" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts))


async def status_page(request: web.Request) -> web.Response:
    journal = request.app[JOURNAL]
    status = await _status(request.app)
    actions = await journal.list_actions(limit=50)
    waiting = await journal.list_actions(state=AWAITING_APPROVAL, limit=100)
    chains = await journal.chains(limit=CHAINS_SHOWN)
    html = _TEMPLATES.get_template("status.html").render(status=status, actions=actions, waiting=waiting,
                                                          chains=chains, when=_when, now=_when(time.time()))
    return web.Response(text=html, content_type="text/html")


def create_app(config: Config, *, backend: Backend | None = None) -> web.Application:
    """The webhook application; ``backend`` defaults to the one the config names."""
    app = web.Application(middlewares=[_json_errors, _no_browser_writes, _require_auth],
                          client_max_size=config.max_body_bytes)
    app[CONFIG] = config
    app[BACKEND] = backend if backend is not None else create_backend(config.backend)
    app[AUTH] = Authenticator.from_config(config)
    app[METRICS] = Metrics()
    app.cleanup_ctx.append(_runtime)
    app.on_response_prepare.append(_security_headers)
    app.add_routes([
        web.post("/alerts", post_alerts),
        web.get("/actions", get_actions),
        web.get("/actions/{id}", get_action),
        web.post("/actions/{id}/approve", approve),
        web.post("/actions/{id}/cancel", cancel),
        web.post("/breaker/reset", reset_breaker),
        web.get("/status", get_status),
        web.get("/metrics", get_metrics),
        web.get("/healthz", healthz),
        web.get("/", status_page),
    ])
    return app


async def _runtime(app: web.Application) -> AsyncIterator[None]:
    """Open the journal and start the worker; on shutdown stop the worker before closing the journal."""
    config = app[CONFIG]
    journal = open_store(config, app[METRICS].journal_write_failures.inc)
    announcer = Announcer(config.announce, config.audit_log_path, app[METRICS])
    engine = Engine(config, app[BACKEND], journal, app[METRICS], announcer)
    worker = Worker(engine, journal, config.journal_retention_days * 86400)
    app[JOURNAL], app[ENGINE], app[WORKER] = journal, engine, worker
    backend = app[BACKEND]
    if isinstance(backend, TracksHelpers):  # kill what a killed webhook left running first
        await asyncio.to_thread(backend.track_helpers, config.state_dir / "helpers")
    breaker = await engine.breaker()
    app[METRICS].breaker_open.set(int(breaker["open"]))
    log.info("event=started journal=%s replica=%s backend=%s dry_run=%s breaker_open=%s",
             describe(config), config.replica, app[BACKEND].name, config.dry_run, breaker["open"])
    worker.start()
    yield
    await worker.stop()
    await announcer.close()
    await journal.close()
    log.info("event=stopped (unfinished actions resume on the next start)")
