"""POST /alerts: authentication, validation, durability answers, and a fuzzed parser."""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import sqlite3
from dataclasses import replace

import pytest
from gpuhealth.webhook.config import parse_config
from gpuhealth.webhook.intake import resolve
from gpuhealth.webhook.journal import Journal
from gpuhealth.webhook.models import PayloadError, may_hold_surrogate, parse_notification
from gpuhealth.webhook.policy import decide
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict
from waiting import eventually
from webhook_helpers import FIXTURES, TOKEN, alert, notification, recorded, resolved


async def test_recorded_alertmanager_delivery_is_accepted_with_its_own_headers(webhook, tmp_path):
    headers = json.loads((FIXTURES / "delivery_headers.json").read_text())
    token = headers["Authorization"].removeprefix("Bearer ")
    (tmp_path / "am-token").write_text(token)
    hook = await webhook(auth={"token_file": str(tmp_path / "am-token")})
    resp = await hook.client.post("/alerts", data=json.dumps(recorded("firing_single_gpu")), headers=headers)
    assert resp.status == 200
    assert (await resp.json())["new_actions"] == [1]


@pytest.mark.parametrize("authorization", [None, "Bearer wrong-token", "Basic bm9ib2R5Og==", "Token x"])
async def test_missing_or_wrong_credentials_are_401(webhook, authorization):
    hook = await webhook()
    headers = {"Authorization": authorization} if authorization else {}
    resp = await hook.client.post("/alerts", json=notification(alert()), headers=headers)
    assert resp.status == 401
    assert resp.headers["WWW-Authenticate"].startswith("Bearer")
    assert await hook.actions() == []
    assert await hook.metric("gpuhealth_webhook_notifications_total", outcome="unauthorized") == 1


async def test_basic_auth(webhook, tmp_path):
    (tmp_path / "password").write_text("s3cret\n")
    hook = await webhook(auth={"basic_auth": {"username": "alertmanager",
                                              "password_file": str(tmp_path / "password")}})
    good = base64.b64encode(b"alertmanager:s3cret").decode()
    bad = base64.b64encode(b"alertmanager:guess").decode()
    body = notification(alert())
    for credentials, status in ((good, 200), (bad, 401), ("%%%", 401)):
        resp = await hook.client.post("/alerts", json=body, headers={"Authorization": f"Basic {credentials}"})
        assert resp.status == status


async def test_auth_can_be_disabled_explicitly_for_an_authenticating_proxy(webhook):
    hook = await webhook(auth={"disabled": True, "token_file": None})
    assert (await hook.client.post("/alerts", json=notification(alert()))).status == 200


async def test_reads_are_open_and_writes_need_credentials(webhook):
    hook = await webhook()
    for path in ("/", "/status", "/actions", "/metrics", "/healthz"):
        assert (await hook.client.get(path)).status == 200, path
    for path in ("/breaker/reset", "/actions/1/approve", "/actions/1/cancel"):
        assert (await hook.client.post(path)).status == 401, path


@pytest.mark.parametrize(("body", "message"), [
    (b"{not json", "not valid JSON"),
    (b"[]", "expected a JSON object"),
    (json.dumps({**notification(alert()), "version": "3"}).encode(), 'version: expected "4"'),
    (json.dumps({**notification(alert()), "alerts": {}}).encode(), "alerts: expected a non-empty list"),
    (json.dumps({**notification(alert()), "alerts": []}).encode(), "alerts: expected a non-empty list"),
    (json.dumps(notification(alert(summary="\ud800"))).encode(), "not valid Unicode"),
    (json.dumps(notification(alert(summary="\ud83d\ude00\udfff"))).replace("udfff", "uDFFF").encode(),
     "not valid Unicode"),
    (json.dumps(notification({**alert(), "labels": {"\udc00": "x"}})).encode(), "not valid Unicode"),
    (json.dumps(notification({**alert(), "startsAt": "yesterday"})).encode(), "alerts[0].startsAt"),
    (json.dumps(notification({**alert(), "labels": {"node": 1}})).encode(), "alerts[0].labels"),
    (json.dumps(notification({**alert(), "fingerprint": ""})).encode(), "alerts[0].fingerprint"),
    (b"[" * 100000 + b"]" * 100000, "not valid JSON"),
    # strict JSON: what another parser (a proxy, a log shipper) could read differently is refused
    (json.dumps(notification(alert())).replace('"version": "4"', '"version": "3", "version": "4"').encode(),
     "'version' appears twice"),
    (json.dumps({**notification(alert()), "groupLabels": {"x": float("nan")}}).encode(), "NaN is not"),
    (json.dumps({**notification(alert()), "commonLabels": [float("inf")]}).encode(), "Infinity is not"),
    (json.dumps(notification(alert())).replace('"truncatedAlerts": 0', '"truncatedAlerts": ' + "9" * 5000)
     .encode(), "5000 digits"),
    (b"\xef\xbb\xbf" + json.dumps(notification(alert())).encode(), "not valid JSON"),
    (b'{"version": "4", "receiver": "\xff"}', "not valid JSON"),
    # each field against its own grammar
    (json.dumps(notification({**alert(), "fingerprint": "0123456789abcdef\nevent=forged"})).encode(),
     "alerts[0].fingerprint: expected 16 lowercase hex digits"),
    (json.dumps(notification({**alert(), "fingerprint": "\x1b[2J0123456789"})).encode(), "fingerprint"),
    (json.dumps(notification({**alert(), "startsAt": "20261130T050000Z"})).encode(), "not an RFC 3339 time"),
    (json.dumps(notification({**alert(), "startsAt": "2026-11-30 05:00:00Z"})).encode(), "not an RFC 3339"),
    (json.dumps(notification({**alert(), "endsAt": "2026-11-30T05:00:00"})).encode(), "alerts[0].endsAt"),
    # Alertmanager refuses an alert that ends before it starts; a resolution claiming so is forged
    (json.dumps(notification(resolved({**alert(), "startsAt": "2026-11-30T07:00:00Z"}))).encode(),
     "alerts[0]: endsAt is before startsAt"),
    (json.dumps(notification({**alert(), "generatorURL": "http://prom:9090/graph?g0.expr=up == 0"})).encode(),
     "generatorURL: 'http://prom:9090/graph?g0.expr=up == 0' is not an absolute URI"),
    (json.dumps(notification({**alert(), "generatorURL": "/graph?g0.expr=up"})).encode(), "absolute URI"),
    (json.dumps(notification({**alert(), "generatorURL": "http://pröm:9090/"})).encode(), "absolute URI"),
    (json.dumps({**notification(alert()), "externalURL": "http://am:9093/\r\nX-Forged: 1"}).encode(),
     "externalURL: holds control characters"),
    (json.dumps({**notification(alert()), "receiver": "gpuhealth\nevent=forged"}).encode(),
     "receiver: holds control characters"),
    (json.dumps({**notification(alert()), "groupKey": "{}:{node=\"x\"}\x1b[2J"}).encode(),
     "groupKey: holds control characters"),
])
async def test_malformed_notifications_are_400_with_a_clear_message(webhook, body, message):
    hook = await webhook()
    resp = await hook.client.post("/alerts", data=body, headers=hook.posting)
    assert resp.status == 400
    assert message in (await resp.json())["error"]
    assert await hook.metric("gpuhealth_webhook_notifications_total", outcome="malformed") == 1


async def test_body_size_limit(webhook):
    hook = await webhook(max_body_bytes=2048)
    big = notification(*[alert(f"gpu{i:02d}") for i in range(1, 17)])
    resp = await hook.client.post("/alerts", json=big, headers=hook.auth)
    assert resp.status == 413
    assert "Maximum request body size" in (await resp.json())["error"]
    assert await hook.metric("gpuhealth_webhook_notifications_total", outcome="too_large") == 1


async def test_unwritable_journal_answers_503_so_alertmanager_retries(webhook, tmp_path):
    hook = await webhook(journal_busy_timeout_seconds=0.2)
    blocker = sqlite3.connect(tmp_path / "state" / "journal.sqlite3", isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")  # another writer holds the journal
    try:
        resp = await hook.client.post("/alerts", json=notification(alert()), headers=hook.auth)
        assert resp.status == 503
        assert "journal" in (await resp.json())["error"]
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    await hook.post(alert())
    assert len(await hook.settle()) == 1
    assert await hook.metric("gpuhealth_webhook_notifications_total", outcome="journal_error") == 1


def test_only_a_body_with_a_surrogate_escape_pays_the_unicode_check():
    """The byte scan decides whether the parser encodes every string to find a lone surrogate: a body
    with none of ``\\ud800``-``\\udfff`` skips it; one with such an escape (lone, paired, or text that
    merely reads like one) pays it, and only a lone one is refused."""
    plain = json.dumps(notification(alert(summary="caf\u00e9 \u2603 \ud7ff \ue000"))).encode()
    raw_utf8 = json.dumps(notification(alert(summary="\U0001f600 \u00e9")), ensure_ascii=False).encode()
    paired = json.dumps(notification(alert(summary="\U0001f600"))).encode()  # \ud83d\ude00
    look_alike = json.dumps(notification(alert(summary="\\ud800 is text"))).encode()  # "\\ud800"
    assert not may_hold_surrogate(plain) and not may_hold_surrogate(raw_utf8)
    assert may_hold_surrogate(paired) and may_hold_surrogate(look_alike)
    for body in (plain, raw_utf8, paired, look_alike):
        parse_notification(json.loads(body), surrogates=may_hold_surrogate(body))
    with pytest.raises(PayloadError, match="not valid Unicode"):
        parse_notification(json.loads(b'{"summary": "\\uDBFF"}'), surrogates=True)


@settings(max_examples=300, deadline=None)
@given(text=st.text(st.characters(min_codepoint=0xd700, max_codepoint=0xe000, exclude_categories=())
                    | st.characters(max_codepoint=0x1ffff)))
def test_the_byte_scan_finds_every_lone_surrogate_and_passes_text_without_one(text):
    body = json.dumps({"summary": text}).encode()
    try:
        text.encode()
    except UnicodeEncodeError:
        assert may_hold_surrogate(body)  # a lone one: never left unchecked
        return
    if "\\" not in text and all(ord(c) <= 0xffff for c in text):
        assert not may_hold_surrogate(body)  # no surrogate escape: the check is skipped


def test_parser_accepts_a_generator_url_of_any_scheme_from_tools_other_than_prometheus():
    for url in ("", "http://prometheus:9090/graph?g0.expr=up%20%3D%3D%200&g0.tab=1", "https://grafana/x",
                "grafana+alerting://rule/abc"):
        [a] = parse_notification(notification({**alert(), "generatorURL": url})).alerts
        assert a.generator_url == url


def test_parser_accepts_alertmanager_times_and_ignores_go_zero_end():
    parsed = parse_notification(notification(alert(starts_at="2026-11-30T05:24:48.671234567Z")))
    [a] = parsed.alerts
    assert a.starts_at.isoformat() == "2026-11-30T05:24:48.671234+00:00" and a.ends_at is None
    with pytest.raises(PayloadError, match="and 2 more"):
        parse_notification(notification(*[{**alert(), "status": "x"}] * 12))


_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8)
_json = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=20)
_field = st.sampled_from(["version", "status", "alerts", "receiver", "groupKey", "truncatedAlerts", "labels",
                          "annotations", "startsAt", "endsAt", "fingerprint", "generatorURL"])


def _mutated(body: dict, data: st.DataObject) -> dict:
    """A valid notification with some fields, top-level or in an alert, replaced by arbitrary JSON."""
    body = json.loads(json.dumps(body))
    for _ in range(data.draw(st.integers(1, 4))):
        raw = body["alerts"] if isinstance(body["alerts"], list) else []
        alerts = [a for a in raw if isinstance(a, dict)]
        target = data.draw(st.sampled_from(alerts)) if alerts and data.draw(st.booleans()) else body
        target[data.draw(_field)] = data.draw(_json)
    return body


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_payloads_never_crash_the_parser(data):
    if data.draw(st.booleans()):
        candidate = data.draw(_json)
    else:
        name = data.draw(st.sampled_from(["firing_single_gpu", "partly_resolved_node_group"]))
        candidate = _mutated(recorded(name), data)
    try:
        parse_notification(candidate)
    except PayloadError as exc:
        assert str(exc)


async def test_fuzzed_payloads_through_the_app_are_never_5xx(webhook):
    hook = await webhook()
    bodies: list[bytes] = []

    @settings(max_examples=60, deadline=None)
    @given(data=st.data())
    def draw(data):  # hypothesis drives a sync function; the requests are sent afterwards
        bodies.append(json.dumps(_mutated(recorded("partly_resolved_node_group"), data)).encode())

    draw()
    for body in bodies:
        resp = await hook.client.post("/alerts", data=body, headers=hook.posting)
        assert resp.status in (200, 400), await resp.text()
    assert (await hook.client.get("/healthz")).status == 200
    await hook.settle()


async def test_a_sender_hanging_up_mid_request_does_not_lose_the_notification(webhook):
    hook = await webhook()
    body = json.dumps(notification(alert("gpu05", action="restart_job"))).encode()
    _, writer = await asyncio.open_connection(hook.client.host, hook.client.port)
    writer.write(b"POST /alerts HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Authorization: Bearer {TOKEN}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    await writer.drain()
    writer.close()  # gone before the answer, as Alertmanager is when its timeout fires
    await writer.wait_closed()
    await eventually(hook.actions, timeout=10, what="the notification (was it lost?)", interval=0.02)
    [action] = await hook.settle()
    assert (action["node"], action["state"]) == ("gpu05", "done")


async def test_one_bad_notification_in_a_group_commit_leaves_its_neighbours_committed(webhook):
    hook = await webhook()
    bodies = [notification(alert(f"gpu{i % 16 + 1:02d}", action="none")) for i in range(59)]
    bad = notification(alert("gpu01", action="none"))
    bad["alerts"][0]["labels"]["team"] = "\ud800"  # a lone surrogate: JSON allows it, UTF-8 does not
    bodies.insert(30, bad)
    answers = await asyncio.gather(*[hook.client.post("/alerts", data=json.dumps(b), headers=hook.posting)
                                     for b in bodies])
    statuses = [r.status for r in answers]
    assert statuses.count(200) == 59 and statuses[30] == 400, statuses
    assert "not valid Unicode" in (await answers[30].json())["error"]
    assert len(await hook.actions(limit="1000")) == 59


def test_the_journal_isolates_each_notification_of_a_batch(tmp_path):
    journal = Journal(tmp_path / "journal.sqlite3")
    good = [parse_notification(notification(alert(f"gpu0{i}", action="drain"))) for i in range(1, 4)]
    broken = replace(good[0], receiver="\ud800")  # text SQLite cannot encode
    batch = [(n, decide(n, parse_config({"backend": {"type": "simulated"}}))) for n in
             (good[0], broken, good[1], good[2])]
    results = journal.record(batch, resolve)
    assert isinstance(results[1], UnicodeEncodeError)
    assert [len(r.new_actions) for r in (results[0], results[2], results[3])] == [1, 1, 1]
    assert sorted(a.node for a in journal.list_actions()) == ["gpu01", "gpu02", "gpu03"]
    journal.close()


@pytest.mark.parametrize(("path", "status"), [
    ("/actions/\u00b2", 404), ("/actions/99999999999999999999999999", 404), ("/actions/-1", 404),
    ("/actions?limit=\u00b2", 400), ("/actions?limit=99999999999999999999", 400), ("/actions?limit=0", 400),
    ("/actions?since=nan", 400), ("/actions?since=1e999", 400), ("/actions?since=\u0663", 400),
    ("/actions?since=1700000000.5", 200), ("/actions?since=2026-11-30T05:00:00Z", 200),
    ("/actions?before=\u00b2", 400), ("/actions?before=-1", 400), ("/actions?before=1e3", 400),
    ("/actions?before=99999999999999999999999999", 400), ("/actions?before=12", 200),
])
async def test_numeric_query_parameters_are_strict(webhook, path, status):
    hook = await webhook()
    resp = await hook.client.get(path)
    assert resp.status == status, await resp.text()
    assert resp.content_type == "application/json"


async def test_actions_page_back_through_the_whole_journal_with_before(webhook):
    """Newest first, ``limit`` at a time: ``before`` (the last id of a page) reaches every older row."""
    hook = await webhook()
    posted = []
    for _ in range(3):
        answer = await hook.post(*[alert(f"gpu{n:02d}", action="none") for n in range(1, 11)])
        posted += answer["new_actions"]
    pages, before = [], ""
    while True:
        page = [a["id"] for a in await hook.actions(limit="7", **({"before": before} if before else {}))]
        if not page:
            break
        pages.append(page)
        before = str(min(page))
    seen = [i for page in pages for i in page]
    assert sorted(seen) == sorted(posted) and len(seen) == 30 and len(pages) == 5


async def test_gzip_bodies_are_read_and_a_broken_or_oversized_one_is_a_json_400_or_413(webhook):
    hook = await webhook(max_body_bytes=1 << 16)
    gzipped = {**hook.auth, "Content-Type": "application/json", "Content-Encoding": "gzip"}
    resp = await hook.client.post("/alerts", data=gzip.compress(json.dumps(notification(alert())).encode()),
                                  headers=gzipped)
    assert resp.status == 200, await resp.text()
    resp = await hook.client.post("/alerts", data=b"not gzip at all", headers=gzipped)
    assert resp.status == 400 and "body cannot be read" in (await resp.json())["error"]
    resp = await hook.client.post("/alerts", data=gzip.compress(b" " * (1 << 24)), headers=gzipped)  # a bomb
    assert resp.status == 413 and resp.content_type == "application/json"
    assert await hook.metric("gpuhealth_webhook_notifications_total", outcome="malformed") == 1
    assert (await hook.client.get("/healthz")).status == 200


@pytest.mark.parametrize(("method", "path", "status"), [
    ("GET", "/no/such/page", 404), ("GET", "/actions/1/approve", 405), ("PUT", "/alerts", 405),
])
async def test_answers_of_the_router_are_json_too(webhook, method, path, status):
    hook = await webhook()
    resp = await hook.client.request(method, path, headers=hook.auth)
    assert resp.status == status
    assert resp.content_type == "application/json" and (await resp.json())["error"]
    if status == 405:
        assert resp.headers["Allow"]


async def _raw(hook, request: bytes) -> bytes:
    """One request as bytes on the wire: headers aiohttp's client would refuse to send."""
    reader, writer = await asyncio.open_connection(hook.client.host, hook.client.port)
    writer.write(request)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


@pytest.mark.parametrize("authorization", [b"Bearer \xff\xfe", b"Bearer " + TOKEN.encode() + b"\xff",
                                           b"Basic \xff\xfe"])
async def test_credentials_that_are_not_utf8_are_401(webhook, authorization):
    hook = await webhook()
    body = json.dumps(notification(alert())).encode()
    answer = await _raw(hook, b"POST /alerts HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: "
                        + authorization + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    assert answer.startswith(b"HTTP/1.1 401 "), answer[:200]
    assert await hook.actions() == []


async def test_two_authorization_headers_are_refused_even_if_one_is_right(webhook):
    hook = await webhook()
    for first, second in ((TOKEN, "wrong"), ("wrong", TOKEN), (TOKEN, TOKEN)):
        headers = [("Authorization", f"Bearer {first}"), ("Authorization", f"Bearer {second}")]
        resp = await hook.client.post("/alerts", json=notification(alert()), headers=CIMultiDict(headers))
        assert resp.status == 401, (first, second)
    assert await hook.actions() == []


@pytest.mark.parametrize(("path", "headers", "status"), [
    ("/alerts", {"Content-Type": "text/plain", "Origin": "https://evil.example"}, 403),
    ("/alerts", {"Content-Type": "application/json", "Origin": "null"}, 403),
    ("/alerts", {"Content-Type": "application/x-www-form-urlencoded", "Sec-Fetch-Site": "cross-site"}, 403),
    ("/breaker/reset", {"Origin": "http://127.0.0.1"}, 403),
    ("/actions/1/approve", {"Sec-Fetch-Site": "same-origin"}, 403),
])
async def test_a_web_page_cannot_drive_the_webhook_through_a_browser(webhook, path, headers, status):
    """With auth left to a proxy, a browser would attach the operator's credentials to a cross-site form
    or no-cors fetch; browsers mark those with Origin, which Alertmanager and operators' tools never send."""
    hook = await webhook(auth={"disabled": True, "token_file": None})
    resp = await hook.client.post(path, data=json.dumps(notification(alert())), headers=headers)
    assert resp.status == status and resp.content_type == "application/json", await resp.text()
    assert await hook.actions() == []
    resp = await hook.client.post("/alerts", json=notification(alert()))  # a tool, saying it sends JSON
    assert resp.status == 200


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonp",
                                          "text/json"])
async def test_a_body_that_is_not_declared_json_is_415_and_never_parsed(webhook, content_type):
    """The types a browser sends cross-site without a preflight (text/plain, forms) carried a valid
    notification through to the journal; Alertmanager always says application/json."""
    hook = await webhook()
    headers = {**hook.auth} | ({"Content-Type": content_type} if content_type else {})
    body = json.dumps(notification(alert())).encode()
    resp = await hook.client.post("/alerts", data=body, headers=headers, skip_auto_headers=["Content-Type"])
    assert resp.status == 415 and resp.content_type == "application/json", await resp.text()
    assert "application/json" in (await resp.json())["error"]
    assert await hook.actions() == []
    assert await hook.metric("gpuhealth_webhook_notifications_total", outcome="malformed") == 1
    declared = {**hook.auth, "Content-Type": "application/json; charset=utf-8"}
    resp = await hook.client.post("/alerts", data=body, headers=declared)
    assert resp.status == 200, await resp.text()
