"""Helpers of the server tests (no tests here): a live uvicorn in a thread, a spy on the generator,
raw HTTP and SSE reading, Prometheus text parsing; and the tiny int8 server (with its in-process
reference generator, an openai client and the model name) that test_server.py,
test_server_errors.py and test_server_load.py share: they import its fixtures as `fixture_*`,
each module getting its own server."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from dataclasses import dataclass, field

import pytest
from prometheus_client.parser import text_string_to_metric_families

from specexport_runtime.api import load
from specexport_runtime.generator import Generation
from specexport_runtime.server.config import ServerConfig
from specexport_runtime.server.run import make_server

KEY = "test-key-0123456789"


@dataclass
class Run:
    """One generation the generator really ran (recorded by Spy)."""

    prompt_ids: list[int]
    options: dict
    start: float  # time.monotonic()
    round_ends: list[float] = field(default_factory=list)
    closed: float | None = None
    tokens: list[int] = field(default_factory=list)


class Spy:
    """Wraps one SpecGenerator's `events` (the server's only entry into it): records every run and
    its round times, and can make each round last `delay` seconds longer (a slow model)."""

    def __init__(self, gen):
        self.runs: list[Run] = []
        self.delay = 0.0
        inner_events = gen.events

        def events(prompt, config=None, **kwargs):
            run = Run(list(prompt), {"config": config, **kwargs}, time.monotonic())
            self.runs.append(run)
            inner = inner_events(prompt, config, **kwargs)

            def rounds():
                try:
                    for event in inner:
                        if self.delay:
                            time.sleep(self.delay)
                        run.tokens += event[0]
                        run.round_ends.append(time.monotonic())
                        yield event
                finally:
                    inner.close()
                    run.closed = time.monotonic()

            return Generation(rounds(), inner.stats, inner.config, inner.gamma_policy)

        gen.events = events

    def find(self, prompt_ids: list[int]) -> list[Run]:
        return [r for r in self.runs if r.prompt_ids == prompt_ids]


class LiveServer:
    """The real server (make_server: uvicorn + the app) on a random local port, in a thread."""

    def __init__(self, gen, **config):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.config = ServerConfig(port=self.port, **config)
        self.server = make_server(gen, self.config, log_level="warning", access_log=False)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)

    @property
    def state(self):
        return self.server.state

    @property
    def worker(self):
        return self.server.state.worker

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


def headers(key: str | None = KEY, **extra) -> dict:
    h = {"Content-Type": "application/json", **extra}
    if key is not None:
        h["Authorization"] = f"Bearer {key}"
    return h


def post(
    port: int,
    path: str,
    body,
    key: str | None = KEY,
    raw: bytes | None = None,
    timeout: float = 60,
    extra_headers: dict | None = None,
) -> tuple[int, dict, dict]:
    """(status, headers, JSON body) of one request over a fresh connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = raw if raw is not None else json.dumps(body).encode()
        conn.request("POST", path, body=data, headers={**headers(key), **(extra_headers or {})})
        resp = conn.getresponse()
        payload = resp.read()
        return resp.status, dict(resp.getheaders()), json.loads(payload) if payload else {}
    finally:
        conn.close()


def get(port: int, path: str, key: str | None = KEY, timeout: float = 30) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path, headers=headers(key))
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def answers_ok(port: int, path: str) -> bool:
    """Whether GET `path` on 127.0.0.1:`port` answers 200 now (False while nothing listens)."""
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        conn.request("GET", path)
        return conn.getresponse().status == 200
    except OSError:
        return False


class SseStream:
    """A streaming request on its own connection, read line by line (the framing is checked by callers)."""

    def __init__(self, port: int, path: str, body: dict, key: str | None = KEY, timeout: float = 60):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        self.conn.request("POST", path, body=json.dumps(body).encode(), headers=headers(key))
        self.resp = self.conn.getresponse()
        self.lines: list[bytes] = []

    def readline(self) -> bytes:
        line = self.resp.readline()  # HTTPResponse undoes the chunked transfer coding
        self.lines.append(line)
        return line

    def next_event(self) -> dict | str | None:
        """The next `data:` payload (a dict, or '[DONE]'), None at the end of the stream; asserts the
        framing: every event is one `data: ` line followed by an empty line."""
        line = self.readline()
        if not line:
            return None
        assert line.startswith(b"data: ") and line.endswith(b"\n"), line
        blank = self.readline()
        assert blank == b"\n", (line, blank)
        payload = line[len(b"data: ") :].rstrip(b"\n")
        return "[DONE]" if payload == b"[DONE]" else json.loads(payload)

    def events(self) -> list:
        out = []
        while (event := self.next_event()) is not None:
            out.append(event)
        return out

    def abandon(self) -> None:
        """The client goes away without reading further (the socket closes)."""
        sock = self.conn.sock
        if sock is not None:
            sock.shutdown(socket.SHUT_RDWR)
        self.conn.close()
        self.resp.close()


def metric_values(text: bytes | str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of a Prometheus exposition."""
    text = text.decode() if isinstance(text, bytes) else text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def metric_sum(values: dict, name: str, **labels) -> float:
    """Sum of the samples named `name` whose labels include `labels`."""
    return sum(v for (n, ls), v in values.items() if n == name and set(labels.items()) <= set(ls))


def wait_until(predicate, timeout: float = 20.0, what: str = "condition") -> None:
    """Poll server-side state (never a fixed sleep standing in for a synchronization)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


# --- the tiny server of test_server.py, test_server_errors.py and test_server_load.py --------------
KIND = "int8"  # a draft model that agrees often: rounds accept several tokens
MAX_BODY = 64 * 1024
MAX_QUEUE = 4
CHAT = "/v1/chat/completions"
PROMPTS = [
    "Write a function that adds two numbers.",
    "The quick brown fox",
    "for i in range(10): print(i)",
    '{"name": "specexport", "items": [1, 2, 3]}',
]
PROPOSERS = ["draft", "hybrid", "ngram", "suffix", "none"]


def msgs(text: str) -> list[dict]:
    return [{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}]


@pytest.fixture(scope="module", name="served")
def fixture_served(tiny_artifacts):
    gen = load(tiny_artifacts[KIND], threads=1)
    spy = Spy(gen)
    server = LiveServer(gen, api_key=KEY, max_queue=MAX_QUEUE, max_body_bytes=MAX_BODY)
    server.spy = spy
    yield server
    server.close()


@pytest.fixture(scope="module", name="ref")
def fixture_ref(tiny_artifacts):
    """In-process generation: the reference the server's output must equal."""
    return load(tiny_artifacts[KIND], threads=1)


@pytest.fixture(scope="module", name="client")
def fixture_client(served):
    import openai  # the modules that use this fixture skip without it

    return openai.OpenAI(base_url=served.base_url, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module", name="model")
def fixture_model(served):
    return served.state.model
