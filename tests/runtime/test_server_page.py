"""The web page at `/` (server/page.py) and the streamed trace it reads (server/trace.py): each
token's kind agrees with the request's own counters; the page has no external resource; in a real
headless Chromium (Debian's package) the page sends a prompt, streams the answer as coloured tokens
and shows the figures; a screenshot is saved in the test's folder."""

from __future__ import annotations

import base64
import html.parser
import json
import re
import shutil
import subprocess
import time
import urllib.request

import pytest

pytest.importorskip("uvicorn")

from test_server_support import KEY, KIND, LiveServer, SseStream, get, msgs  # noqa: E402

from specexport_runtime.api import load  # noqa: E402
from specexport_runtime.server.trace import KINDS, round_kinds  # noqa: E402


def test_round_kinds():
    before = (3, 10, 2, 1, 2)  # rounds, accepted, forced_accepted, corrections, bonus
    assert round_kinds(before, (4, 13, 2, 2, 2), 4) == ["accepted"] * 3 + ["correction"]
    assert round_kinds(before, (4, 14, 3, 1, 3), 6) == [
        "forced",
        "accepted",
        "accepted",
        "accepted",
        "accepted",
        "bonus",
    ]
    assert round_kinds(before, (4, 14, 3, 1, 3), 2) == ["forced", "accepted"]  # cut at EOS
    assert round_kinds(before, before, 1) == ["target"]  # the prefill or a plain step


@pytest.fixture(scope="module")
def server(tiny_artifacts):
    gen = load(tiny_artifacts[KIND], threads=1)  # int8 self-draft: rounds accept several tokens
    srv = LiveServer(gen)  # no key: a browser page on this machine
    yield srv
    srv.close()


def test_a_traced_stream_agrees_with_its_counters(server):
    body = {"model": server.state.model, "messages": msgs("Write a poem about the sea."), "max_tokens": 48,
            "temperature": 0, "stream": True, "trace": True, "proposer": "draft", "gamma": 4}  # fmt: skip
    stream = SseStream(server.port, "/v1/chat/completions", body, key=None)
    events = [e for e in stream.events() if isinstance(e, dict)]
    items = [item for e in events for item in e.get("trace", [])]
    spec = next(e["speculative"] for e in events if "speculative" in e)
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))
    kinds = [i["kind"] for i in items]
    assert set(kinds) <= set(KINDS) and kinds[0] == "target"
    # every round's tokens are traced, except what max_tokens cuts from the last round (<= gamma 4
    # accepted drafts and its closing token), which the counters still count
    assert spec["accepted"] - 4 <= kinds.count("accepted") <= spec["accepted"] and kinds.count("accepted") > 0
    assert kinds.count("correction") + kinds.count("bonus") in (spec["rounds"] - 1, spec["rounds"])
    assert kinds.count("target") == spec["plain_steps"] + 1  # + the prefill's token
    assert "".join(i["text"] for i in items) == text  # byte-level BPE: tokens decode alone to the text
    untraced = SseStream(server.port, "/v1/chat/completions", {**body, "trace": False}, key=None).events()
    assert not any("trace" in e for e in untraced if isinstance(e, dict))


class _Resources(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.urls += [v for k, v in attrs if k in ("src", "href") and v]


def test_the_page_is_self_contained_and_can_be_turned_off(server, tiny_artifacts):
    status, page = get(server.port, "/", key=None)
    assert status == 200 and b"<title>specexport</title>" in page
    parser = _Resources()
    parser.feed(page.decode())
    assert parser.urls == [] and b"http://" not in page and b"https://" not in page  # no CDN: works offline
    srv = LiveServer(load(tiny_artifacts[KIND], threads=1), api_key=KEY, web_page=False)
    try:
        assert get(srv.port, "/", key=None)[0] == 404
    finally:
        srv.close()


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    """A headless Chromium driven over the DevTools protocol (a websocket): navigate, evaluate,
    screenshot. Started with --remote-debugging-port=0; the port is read from DevToolsActivePort."""

    def __init__(self, profile):
        from websockets.sync.client import connect

        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--remote-debugging-port=0", f"--user-data-dir={profile}", "--window-size=1000,900", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        active = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (active.is_file() and active.read_text().strip()):
            assert time.monotonic() < deadline and self.proc.poll() is None, "chromium did not start"
            time.sleep(0.1)
        port = int(active.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=30) as resp:
            page = next(t for t in json.load(resp) if t["type"] == "page")
        self._connection = connect(page["webSocketDebuggerUrl"], max_size=None)
        self.ws, self.next_id = self._connection.__enter__(), 0  # closed by close()

    def call(self, method: str, **params) -> dict:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:  # skip events until our answer
            msg = json.loads(self.ws.recv(timeout=60))
            if msg.get("id") == self.next_id:
                assert "error" not in msg, msg
                return msg["result"]

    def eval(self, expression: str):
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def close(self) -> None:
        self._connection.__exit__(None, None, None)
        self.proc.terminate()
        self.proc.wait(30)


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium package (apt-get install chromium)")
def test_the_page_in_headless_chromium(server, tmp_path):
    """Load /?prompt=..., let the page send it and stream the answer, wait until its status says
    done, then read the DOM: coloured token spans, the stats filled in, the report block; and save
    a screenshot beside the test's files."""
    pytest.importorskip("websockets")
    url = f"http://127.0.0.1:{server.port}/?prompt=Write+a+poem+about+the+sea.&max_tokens=40&proposer=draft"
    (tmp_path / "profile").mkdir()
    browser = Browser(tmp_path / "profile")
    try:
        browser.call("Page.navigate", url=url)
        deadline, status = time.monotonic() + 120, None
        while time.monotonic() < deadline:
            status = browser.eval("document.getElementById('status') && document.getElementById('status').textContent")
            if status in ("done", "ended") or (status or "").startswith("error"):
                break
            time.sleep(0.2)
        assert status == "done", status
        dom = browser.eval("document.documentElement.outerHTML")
        shot = tmp_path / "page.png"
        shot.write_bytes(base64.b64decode(browser.call("Page.captureScreenshot", format="png")["data"]))
    finally:
        browser.close()
    spans = re.findall(r'<span class="tok k-(\w+)" title="\w+">', dom)
    assert len(spans) >= 10 and set(spans) <= set(KINDS)
    assert {"accepted", "correction", "bonus"} & set(spans)  # verified rounds, coloured by outcome
    assert re.search(r'id="s-accept">acceptance \d+\.\d%', dom) and re.search(r'id="s-toks">tok/s \d', dom)
    assert 'id="s-proposer">proposer draft' in dom and '"acceptance_rate"' in dom
    assert shot.stat().st_size > 5000
    print(f"screenshot: {shot}")
