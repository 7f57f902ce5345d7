"""CORS (server/cors.py) and the server's log (server/logs.py) on the live tiny server: a
preflight from an admitted origin gets its Access-Control-* headers and one from another origin
gets 403 and none; the default admits pages of this machine only; `--cors-origins` is checked
and shown in `--help`; the log has a start-up summary and one line per request, in text and JSON."""

from __future__ import annotations

import http.client
import io
import json
import logging
import re

import pytest

pytest.importorskip("uvicorn")

from test_server_support import KEY, KIND, LiveServer, msgs, post  # noqa: E402

from specexport_runtime.api import load  # noqa: E402
from specexport_runtime.cli import _parser  # noqa: E402
from specexport_runtime.errors import InvalidArgument  # noqa: E402
from specexport_runtime.server.config import ServerConfig  # noqa: E402
from specexport_runtime.server.cors import LOCAL_ORIGINS, admits, parse_origins  # noqa: E402
from specexport_runtime.server.logs import configure, log_startup  # noqa: E402


@pytest.fixture(scope="module")
def gen(tiny_artifacts):
    return load(tiny_artifacts[KIND], threads=1)


@pytest.fixture(scope="module")
def local(gen):
    """A server with the default origins."""
    srv = LiveServer(gen, api_key=KEY)
    yield srv
    srv.close()


def _preflight(port: int, origin: str, path: str = "/v1/chat/completions") -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(
            "OPTIONS",
            path,
            headers={
                "Origin": origin,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type",
            },
        )
        resp = conn.getresponse()
        resp.read()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()


def _cors_headers(headers: dict) -> dict:
    return {k: v for k, v in headers.items() if k.lower().startswith("access-control-")}


def test_preflight_from_an_admitted_origin_gets_its_headers(local):
    for origin in ("http://localhost:5173", "http://127.0.0.1:8080", "https://[::1]", "http://localhost"):
        status, headers = _preflight(local.port, origin)
        assert status == 204, origin
        assert headers["access-control-allow-origin"] == origin
        assert "POST" in headers["access-control-allow-methods"]
        assert "authorization" in headers["access-control-allow-headers"]
        assert headers["vary"] == "Origin"


@pytest.mark.parametrize("origin", ["https://evil.example", "http://localhost.evil.example", "null", "file://"])
def test_preflight_from_another_origin_gets_none(local, origin):
    status, headers = _preflight(local.port, origin)
    assert status == 403 and _cors_headers(headers) == {}


def test_requests_from_an_admitted_origin_can_be_read_by_the_page(local):
    body = {"model": local.state.model, "messages": msgs("hi"), "max_tokens": 3}
    status, headers, _ = post(
        local.port, "/v1/chat/completions", body, extra_headers={"Origin": "http://localhost:3000"}
    )
    assert status == 200
    headers = {k.lower(): v for k, v in headers.items()}
    assert headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "retry-after" in headers["access-control-expose-headers"]
    status, headers, _ = post(
        local.port, "/v1/chat/completions", body, extra_headers={"Origin": "https://evil.example"}
    )
    assert status == 200 and _cors_headers(headers) == {}  # answered, but a browser withholds it from the page
    status, headers, _ = post(local.port, "/v1/chat/completions", body)  # no Origin: not a browser
    assert status == 200 and _cors_headers(headers) == {}


def test_configured_origins_and_off(gen):
    srv = LiveServer(gen, cors_origins="https://chat.example.com, http://localhost:3000")
    try:
        assert _preflight(srv.port, "https://chat.example.com")[0] == 204
        assert _preflight(srv.port, "http://localhost:3000")[0] == 204
        assert _preflight(srv.port, "http://localhost:3001")[0] == 403  # the port is part of the origin
    finally:
        srv.close()
    srv = LiveServer(gen, cors_origins="none")
    try:
        status, headers = _preflight(srv.port, "http://localhost:5173")
        assert status == 405 and _cors_headers(headers) == {}  # CORS off: the routes answer OPTIONS themselves
    finally:
        srv.close()


def test_origin_patterns_are_checked():
    assert parse_origins("") == () == parse_origins("none")
    assert parse_origins(" HTTP://Example.COM:8080 ,*") == ("http://example.com:8080", "*")
    assert admits(("*",), "https://any.example") and not admits(("*",), "null")
    assert admits(("https://a.example",), "https://a.example:443") and not admits(
        ("https://a.example",), "http://a.example"
    )
    assert admits(LOCAL_ORIGINS, "http://127.0.0.1:1") and not admits(LOCAL_ORIGINS, "http://127.0.0.2")
    for bad in ("localhost:3000", "ftp://x.example", "http://a.example/path", "http://a.example:port"):
        with pytest.raises(InvalidArgument, match=re.escape(repr(bad)) + ".*expected"):
            parse_origins(bad)
    with pytest.raises(InvalidArgument, match="cors-origins"):
        ServerConfig(cors_origins="example.com")
    help_text = _parser()._subparsers._group_actions[0].choices["serve"].format_help()
    assert "--cors-origins" in help_text and "--log-format" in help_text


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_startup_summary_and_one_line_per_request(gen, fmt):
    out = io.StringIO()
    handler = configure(fmt, "info", stream=out)
    try:
        srv = LiveServer(gen, api_key=KEY, max_batch=1)
        try:
            log_startup(gen, srv.config, 1.25)
            body = {"model": srv.state.model, "messages": msgs("hi"), "max_tokens": 5, "proposer": "draft"}
            status, headers, answer = post(srv.port, "/v1/chat/completions", body)
            assert status == 200
        finally:
            srv.close()
    finally:
        logging.getLogger().removeHandler(handler)
    lines = [line for line in out.getvalue().splitlines() if "specexport.server" in line]
    startup = [line for line in lines if "startup" in line]
    requests = [line for line in lines if " request " in line or '"event": "request"' in line]
    assert len(startup) == 1 and len(requests) == 1, out.getvalue()
    usage = answer["usage"]
    rid = {k.lower(): v for k, v in headers.items()}["x-request-id"]  # the response names its log line
    if fmt == "json":
        s, r = json.loads(startup[0]), json.loads(requests[0])
        assert s["event"] == "startup" and s["load_seconds"] == 1.25 and s["slots"] == 1 and s["proposer"]
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", r["ts"]) and r["level"] == "INFO"
        assert (r["prompt_tokens"], r["new_tokens"]) == (usage["prompt_tokens"], usage["completion_tokens"])
        assert r["proposer"] == "draft" and r["finish"] in ("length", "eos")
        assert {"id", "tok_s", "acceptance", "queue_s", "ttft_s", "total_s"} <= set(r) and r["id"] == rid
    else:
        assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z INFO specexport.server request id=\w+ ", requests[0])
        assert f"id={rid} " in requests[0]
        assert f"prompt_tokens={usage['prompt_tokens']} new_tokens={usage['completion_tokens']}" in requests[0]
        assert "proposer=draft" in requests[0] and "acceptance=" in requests[0] and "tok_s=" in requests[0]
        assert "load_seconds=1.25" in startup[0] and "slots=1" in startup[0]
