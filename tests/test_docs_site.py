"""The built book, looked at in a real browser: headless Chromium on docs/_build/html.

``make docs`` builds the site; ``make docs-check`` installs Debian's ``chromium`` and runs
this file. For the landing page, one tutorial and the API reference it checks that the page
loads with no console error, no uncaught exception and no failed request, and that every
image on it loads (lazy images are made eager first); it saves a screenshot of each under
docs/_build/screenshots/. It skips, saying why, without Chromium or without a built site.

Chromium is driven through the DevTools protocol over its websocket (websocket-client, in
the ``docs`` extra): no chromedriver, no version matching.
"""

from __future__ import annotations

import base64
import functools
import http.server
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SITE = ROOT / "docs" / "_build" / "html"
SHOTS = ROOT / "docs" / "_build" / "screenshots"
PAGES = {
    "landing": "index.html",
    "tutorial": "tutorials/01_paged_kv_cache.html",
    "api": "api.html",
}
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TIMEOUT_S = 60.0


def _chromium() -> str | None:
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser")) if p), None)


class DevTools:
    """One page of a headless Chromium, spoken to with the DevTools protocol."""

    def __init__(self, binary: str, profile: str):
        self.proc = subprocess.Popen(
            [binary, *FLAGS, f"--user-data-dir={profile}", "--remote-debugging-port=0",
             "--window-size=1280,900", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            self._connect(profile)
        except BaseException:
            _kill_group(self.proc)
            raise

    def _connect(self, profile: str) -> None:
        port_file = Path(profile) / "DevToolsActivePort"
        deadline = time.monotonic() + TIMEOUT_S
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"chromium did not start (exit code {self.proc.poll()})")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
            page = next(t for t in json.load(r) if t["type"] == "page")
        import websocket

        self.ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=TIMEOUT_S,
                                              suppress_origin=True)
        self.ids = itertools.count(1)
        self.events: list[dict] = []
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable")
        self.call("Emulation.setDeviceMetricsOverride", width=1280, height=900,
                  deviceScaleFactor=1, mobile=False)

    def call(self, method: str, **params) -> dict:
        """Send one command; keep the events that arrive before its reply."""
        msg_id = next(self.ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self.events.append(msg)

    def wait_for(self, method: str) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        seen = len(self.events)
        while not any(e.get("method") == method for e in self.events[seen:]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {method} within {TIMEOUT_S} s")
            self.events.append(json.loads(self.ws.recv()))

    def close(self) -> None:
        """Stop Chromium and every helper process it started (they write to the profile)."""
        try:
            self.call("Browser.close")
        except Exception:  # already gone: the process-group kill below still runs
            pass
        self.ws.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        _kill_group(self.proc)


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill Chromium's whole process group: its crash handler and zygotes outlive it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _remove_profile(profile: str) -> None:
    """Remove Chromium's profile; a helper exiting late may still add a file, so retry."""
    for attempt in range(20):
        try:
            shutil.rmtree(profile)
            return
        except FileNotFoundError:
            return
        except OSError:
            if attempt == 19:
                raise
            time.sleep(0.25)


def _errors(events: list[dict]) -> list[str]:
    """Console errors, uncaught exceptions and failed requests among the events."""
    out = []
    for e in events:
        method, p = e.get("method"), e.get("params", {})
        if method == "Runtime.exceptionThrown":
            d = p["exceptionDetails"]
            out.append(f"exception: {d.get('exception', {}).get('description') or d['text']}")
        elif method == "Runtime.consoleAPICalled" and p["type"] in ("error", "assert"):
            out.append("console.error: " + " ".join(str(a.get("value", a.get("description")))
                                                    for a in p["args"]))
        elif method == "Log.entryAdded" and p["entry"]["level"] == "error":
            out.append(f"log: {p['entry']['text']} {p['entry'].get('url', '')}")
        elif method == "Network.loadingFailed" and not p.get("canceled"):
            out.append(f"request failed: {p['errorText']} (request {p['requestId']})")
    return out


# Make every image eager, wait until each has loaded or failed, report the ones that failed.
IMAGES_JS = """
(async () => {
  const imgs = Array.from(document.images);
  imgs.forEach(i => { i.loading = "eager"; });
  await Promise.all(imgs.map(i => i.complete ? null : new Promise(done => {
    i.addEventListener("load", done); i.addEventListener("error", done);
    setTimeout(done, 20000);
  })));
  return imgs.map(i => ({src: i.currentSrc || i.src, ok: i.complete && i.naturalWidth > 0}));
})()
"""


@pytest.fixture(scope="module")
def site_url():
    if not (SITE / "index.html").exists():
        pytest.skip(f"no built site at {SITE.relative_to(ROOT)}: run `make docs` first")
    handler = functools.partial(_QuietHandler, directory=str(SITE))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # no request log in the test output
        pass


@pytest.fixture(scope="module")
def browser():
    binary = _chromium()
    if binary is None:
        pytest.skip("no Chromium installed (Debian: apt-get install chromium; "
                    "`make docs-check` does it)")
    pytest.importorskip("websocket", reason="websocket-client is in the docs extra: "
                                            "pip install -e '.[docs]'")
    profile = tempfile.mkdtemp(prefix="minivllm-chromium-")
    try:
        tools = DevTools(binary, profile)
        try:
            yield tools
        finally:
            tools.close()
    finally:
        _remove_profile(profile)


@pytest.mark.parametrize("name", list(PAGES))
def test_page_loads_cleanly_with_its_images(browser, site_url, name):
    url = f"{site_url}/{PAGES[name]}"
    browser.events.clear()
    browser.call("Page.navigate", url=url)
    browser.wait_for("Page.loadEventFired")
    result = browser.call("Runtime.evaluate", expression=IMAGES_JS, awaitPromise=True,
                          returnByValue=True)
    images = result["result"]["value"]
    title = browser.call("Runtime.evaluate", expression="document.title",
                         returnByValue=True)["result"]["value"]
    time.sleep(0.5)  # let late console messages arrive
    browser.call("Runtime.evaluate", expression="window.scrollTo(0, 0)")
    SHOTS.mkdir(parents=True, exist_ok=True)
    shot = browser.call("Page.captureScreenshot", format="png")
    (SHOTS / f"{name}.png").write_bytes(base64.b64decode(shot["data"]))
    if name == "tutorial":  # the first figure, scrolled into view
        browser.call("Runtime.evaluate", expression=(
            "document.querySelector('img.sphx-glr-single-img, img.sphx-glr-multi-img')"
            ".scrollIntoView({block: 'center'})"))
        time.sleep(0.3)
        shot = browser.call("Page.captureScreenshot", format="png")
        (SHOTS / f"{name}-figure.png").write_bytes(base64.b64decode(shot["data"]))

    assert "404" not in title and title, f"{url}: title {title!r}"
    errors = _errors(browser.events)
    assert not errors, f"{url}: {errors}"
    broken = [i["src"] for i in images if not i["ok"]]
    assert not broken, f"{url}: images that did not load: {broken}"
    if name == "tutorial":
        assert any("sphx_glr" in i["src"] for i in images), f"{url}: no tutorial figure"
