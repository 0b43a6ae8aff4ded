"""The read-only status page, rendered by a real headless Chromium."""

from __future__ import annotations

import asyncio
import html.parser
import shutil

import pytest
from webhook_helpers import alert

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class _Tables(html.parser.HTMLParser):
    """Text of every table cell, by table id, from the DOM Chromium built."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self.current: str | None = None
        self.cell: list[str] | None = None
        self.texts: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "table":
            self.current = dict(attrs).get("id") or ""
            self.tables[self.current] = []
        elif tag == "tr" and self.current is not None:
            self.tables[self.current].append([])
        elif tag in ("td", "th"):
            self.cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self.cell is not None and self.current is not None:
            self.tables[self.current][-1].append(" ".join("".join(self.cell).split()))
            self.cell = None
        elif tag == "table":
            self.current = None

    def handle_data(self, data: str) -> None:
        self.texts.append(data)
        if self.cell is not None:
            self.cell.append(data)


@pytest.mark.slow
async def test_status_page_in_headless_chromium(webhook, tmp_path):
    assert CHROMIUM, "Debian package 'chromium' is needed (scripts/bootstrap.sh installs it)"
    hook = await webhook(guardrails={"breaker_max_nodes": 2, "require_approval": ["replace"]})
    hostile = "<script>document.title='pwned'</script>"
    await hook.post(alert("gpu09", action="replace"))
    await hook.post(*[alert(f"gpu{i:02d}", action="drain", summary=f"row remap failure {hostile}")
                      for i in (1, 2, 3)])
    await hook.settle()
    shot = tmp_path / "status.png"
    proc = await asyncio.create_subprocess_exec(
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}", "--window-size=1280,900",
        "--dump-dom", str(hook.client.make_url("/")),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        dom, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, err.decode()[-2000:]
    page = _Tables()
    page.feed(dom.decode())
    text = " ".join(" ".join(page.texts).split())
    assert "Circuit breaker OPEN" in text and "cap is 2" in text
    assert [row[0] for row in page.tables["drained"][1:]] == ["gpu01", "gpu02"]
    actions = page.tables["actions"][1:]
    assert [(row[3], row[6], row[7]) for row in actions] == [
        ("gpu03", "skipped", "breaker_open"), ("gpu02", "done", "ok"), ("gpu01", "done", "ok"),
        ("gpu09", "awaiting_approval", "approval_required")]
    assert [(row[2], row[3]) for row in page.tables["approvals"][1:]] == [("replace", "gpu09")]
    assert "<title>gpuhealth webhook</title>" in dom.decode()  # the alert's markup stayed text
    assert hostile in text
    assert shot.stat().st_size > 10_000


async def test_every_answer_forbids_scripts_framing_and_sniffing(webhook):
    """The page escapes alert text (jinja2 autoescape); the headers are the second wall should a
    template ever print a value raw: no script runs, nothing loads, no page can frame it."""
    hook = await webhook()
    await hook.post(alert(summary='<script>alert(1)</script><img src=x onerror=alert(2)>'))
    for path in ("/", "/actions", "/status", "/nope"):
        resp = await hook.client.get(path)
        headers = resp.headers
        assert headers["X-Content-Type-Options"] == "nosniff", path
        assert headers["X-Frame-Options"] == "DENY", path
        assert "default-src 'none'" in headers["Content-Security-Policy"], path
        assert "frame-ancestors 'none'" in headers["Content-Security-Policy"], path
    page = await (await hook.client.get("/")).text()
    assert "<script>alert(1)" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
