"""The status page in a real headless browser (issue 27): Debian's ``chromium`` driven by
Playwright — never a browser download (``playwright install`` is not run; the test set-up,
``scripts/test``, installs the Debian package on a fresh machine). Fake workers.

The page loads with no console error, shows both models with their GGUF facts, follows a
load made through the API, and its Unload button unloads the model. A screenshot is written
to ``test-artifacts/status-page.png`` (``$MODELYARD_TEST_ARTIFACTS`` moves it).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.router.conftest import ROOT, LiveRouter
from tests.worker.tiny_gguf import write_tiny_llama

CHROMIUM = os.environ.get("MODELYARD_CHROMIUM", "/usr/bin/chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]
ARTIFACTS = Path(os.environ.get("MODELYARD_TEST_ARTIFACTS") or ROOT / "test-artifacts")

CONFIG = """
[server]
models_dir = "."
{keys}
[models.alpha]
path = "alpha.gguf"
aliases = ["a"]
idle_ttl_s = 600
[models.beta]
path = "beta.gguf"
[presets.alpha-greedy]
model = "alpha"
temperature = 0.0
"""


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: the status page's browser test needs Debian's chromium "
                    "(apt-get install chromium; ./scripts/test installs it when run as root)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            yield b
        finally:
            b.close()


def _models(tmp: Path) -> None:
    write_tiny_llama(tmp / "alpha.gguf", qtype="Q8_0", extra_metadata={"general.file_type": 7})
    (tmp / "beta.gguf").write_bytes(b"not a gguf at all")


def _admin(r: LiveRouter, model: str, key: str) -> dict[str, Any]:
    data = httpx.get(f"{r.url}/admin/models", headers={"Authorization": f"Bearer {key}"}, timeout=10).json()
    return next(m for m in data["data"] if m["id"] == model)


def _state(page: Any, model: str) -> Any:
    return page.locator(f'#models tr[data-model="{model}"] [data-field="state"]')


def test_the_page_shows_the_models_follows_a_load_and_unloads(tmp_path: Path, browser: Any) -> None:
    from playwright.sync_api import expect

    _models(tmp_path)
    r = LiveRouter(tmp_path, CONFIG.format(keys=""))
    errors: list[str] = []
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.on("console", lambda m: errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
    try:
        page.goto(f"{r.url}/ui")
        expect(_state(page, "alpha")).to_have_text("unloaded", timeout=15_000)
        expect(_state(page, "beta")).to_have_text("unloaded")
        expect(page.locator('#models tr[data-model="alpha"] td.file')).to_contain_text("llama")
        expect(page.locator('#models tr[data-model="alpha"] td.file')).to_contain_text("Q8_0")
        expect(page.locator('#models tr[data-model="beta"] td.file')).to_contain_text("invalid: not a GGUF file")
        expect(page.locator('#models tr[data-model="alpha-greedy"]')).to_contain_text("preset of alpha")

        # loaded through the API: the page follows (events + poll)
        with httpx.Client(base_url=r.url, timeout=30) as http:
            assert http.post("/admin/models/load", json={"model": "alpha"}).status_code == 200
            expect(_state(page, "alpha")).to_have_text("ready", timeout=15_000)
            expect(page.locator('#models tr[data-model="alpha"] [data-field="slots"]')).to_have_text("0/1")
            expect(page.locator('#models tr[data-model="alpha"] [data-field="expiry"]')).to_contain_text("in ")
            expect(page.locator("#events")).to_contain_text("alpha state")
            # a request shows in the recent requests, and the plots get a line
            out = http.post("/v1/chat/completions", json={"model": "alpha", "max_tokens": 8,
                                                         "messages": [{"role": "user", "content": "hi"}]})
            assert out.status_code == 200, out.text
            expect(page.locator("#requests")).to_contain_text("/v1/chat/completions", timeout=15_000)
            expect(page.locator('#plot-tok_s polyline[data-model="alpha"]')).to_have_count(1, timeout=15_000)

            # the Unload button unloads it
            page.locator('#models tr[data-model="alpha"] button[data-action="unload"]').click()
            expect(_state(page, "alpha")).to_have_text("unloaded", timeout=15_000)
            assert r.admin("alpha")["state"] == "unloaded"
            expect(page.locator("#action-msg")).to_have_text("alpha unloaded")
            # ... and Load loads it again (for the screenshot: one ready, one not)
            page.locator('#models tr[data-model="alpha"] button[data-action="load"]').click()
            expect(_state(page, "alpha")).to_have_text("ready", timeout=15_000)
            http.post("/v1/chat/completions", json={"model": "alpha", "max_tokens": 8,
                                                   "messages": [{"role": "user", "content": "again"}]})
            expect(page.locator("#requests tbody tr", has_text="/v1/chat/completions")).to_have_count(2, timeout=15_000)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shot = ARTIFACTS / "status-page.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 10_000
        assert errors == [], errors
    finally:
        page.close()
        r.stop()


def test_with_keys_the_page_shows_nothing_until_given_the_api_key_and_load_needs_the_admin_key(
        tmp_path: Path, browser: Any) -> None:
    from playwright.sync_api import expect

    _models(tmp_path)
    r = LiveRouter(tmp_path, CONFIG.format(keys='api_key = "sk-api"\nadmin_key = "sk-admin"'))
    page = browser.new_page()
    try:
        page.goto(f"{r.url}/ui")
        expect(page.locator("#conn")).to_have_text("API key needed", timeout=15_000)
        expect(page.locator("#main")).to_be_hidden()
        assert page.locator('#models tr[data-model="alpha"]').count() == 0
        page.fill("#api-key", "sk-api")
        page.click("#keys-save")
        expect(_state(page, "alpha")).to_have_text("unloaded", timeout=15_000)
        # the api key alone does not load
        page.locator('#models tr[data-model="alpha"] button[data-action="load"]').click()
        expect(page.locator("#action-msg")).to_contain_text("load alpha:", timeout=15_000)
        assert _admin(r, "alpha", "sk-admin")["state"] == "unloaded"
        page.fill("#admin-key", "sk-admin")
        page.click("#keys-save")
        page.locator('#models tr[data-model="alpha"] button[data-action="load"]').click()
        expect(_state(page, "alpha")).to_have_text("ready", timeout=15_000)
        assert _admin(r, "alpha", "sk-admin")["state"] == "ready"
    finally:
        page.close()
        r.stop()


def test_a_page_on_another_origin_cannot_read_the_status(tmp_path: Path, browser: Any) -> None:
    """A page served elsewhere (another port is another origin) gets no data: the router
    refuses its Origin (403) and sends no CORS header, so the browser blocks the read too."""
    _models(tmp_path)
    r = LiveRouter(tmp_path, CONFIG.format(keys=""))
    page = browser.new_page()
    try:
        page.goto(f"{r.url}/ui")
        other = r.url.replace("127.0.0.1", "localhost")  # same router, another origin
        result = page.evaluate("""async (url) => {
            try { const r = await fetch(url + '/ui/api/status'); return 'read ' + r.status; }
            catch (e) { return 'blocked'; } }""", other)
        assert result == "blocked"
        with httpx.Client(base_url=r.url) as http:
            resp = http.get("/ui/api/status", headers={"Origin": "http://evil.example"})
            assert resp.status_code == 403 and "access-control-allow-origin" not in resp.headers
    finally:
        page.close()
        r.stop()


def test_a_model_with_replicas_shows_each_one(tmp_path: Path, browser: Any) -> None:
    """``replicas = 2``: the model's row is the model as a whole, and one row per replica follows
    it with that replica's state and slots."""
    from playwright.sync_api import expect

    _models(tmp_path)
    r = LiveRouter(tmp_path, CONFIG.format(keys="").replace('[models.beta]', '[models.twin]\npath = "alpha.gguf"\n'
                                                              'replicas = 2\n[models.beta]'))
    errors: list[str] = []
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
    try:
        page.goto(f"{r.url}/ui")
        expect(_state(page, "twin").first).to_have_text("unloaded", timeout=15_000)
        with httpx.Client(base_url=r.url, timeout=30) as http:
            assert http.post("/admin/models/load", json={"model": "twin"}).status_code == 200
        rows = page.locator('#models tr.replica-row[data-model="twin"]')
        expect(rows).to_have_count(2, timeout=15_000)
        for i in range(2):
            row = page.locator(f'#models tr[data-model="twin"][data-replica="{i}"]')
            expect(row.locator('[data-field="state"]')).to_have_text("ready", timeout=15_000)
            expect(row).to_contain_text(f"replica {i}")
            expect(row.locator('[data-field="slots"]')).to_have_text("0/1")
        assert page.locator('#models tr.replica-row[data-model="alpha"]').count() == 0  # one worker: no rows
        assert errors == [], errors
    finally:
        page.close()
        r.stop()
