"""The web page at `/` (server/page.py) and the streamed trace it reads (server/trace.py): each
token's kind agrees with the request's own counters; the page has no external resource; in a real
headless Chromium (Debian's package) the page sends a prompt, streams the answer as coloured tokens
and shows the figures; a screenshot is saved in the test's folder."""

from __future__ import annotations

import html.parser
import re
import shutil
import subprocess

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
            "temperature": 0, "stream": True, "trace": True, "proposer": "draft"}  # fmt: skip
    stream = SseStream(server.port, "/v1/chat/completions", body, key=None)
    events = [e for e in stream.events() if isinstance(e, dict)]
    items = [item for e in events for item in e.get("trace", [])]
    spec = next(e["speculative"] for e in events if "speculative" in e)
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))
    kinds = [i["kind"] for i in items]
    assert set(kinds) <= set(KINDS) and kinds[0] == "target"
    assert kinds.count("accepted") == spec["accepted"] > 0
    assert kinds.count("correction") + kinds.count("bonus") == spec["rounds"]
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


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium package (apt-get install chromium)")
def test_the_page_in_headless_chromium(server, tmp_path):
    """Load /?prompt=..., let the page send it and stream the answer (virtual time waits for the
    fetch), then read the DOM: coloured token spans, the stats filled in, the report block, the
    status 'done'; and save a screenshot beside the test's files."""
    url = f"http://127.0.0.1:{server.port}/?prompt=Write+a+poem+about+the+sea.&max_tokens=40&proposer=draft"
    common = [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
              f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=30000"]  # fmt: skip
    dom = subprocess.run([*common, "--dump-dom", url], capture_output=True, text=True, timeout=180).stdout
    assert '<span id="status">done</span>' in dom, dom[-3000:]
    spans = re.findall(r'<span class="tok k-(\w+)" title="\w+">', dom)
    assert len(spans) >= 10 and "accepted" in spans and set(spans) <= set(KINDS)
    assert re.search(r'id="s-accept">acceptance \d+\.\d%', dom) and re.search(r'id="s-toks">tok/s \d', dom)
    assert 'id="s-proposer">proposer draft' in dom and '"acceptance_rate"' in dom
    shot = tmp_path / "page.png"
    subprocess.run([*common, f"--screenshot={shot}", "--window-size=1000,900", url], capture_output=True, timeout=180)
    assert shot.is_file() and shot.stat().st_size > 5000
    print(f"screenshot: {shot}")
