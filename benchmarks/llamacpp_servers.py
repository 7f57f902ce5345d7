"""llama.cpp's and specexport's HTTP servers for compare_llamacpp.py, and llama-bench's reference
row. Not a script; the engines it starts are timed by compare_llamacpp.py through the harness.

HttpServer is one server process on a free localhost port; LlamaServer runs llama-server on one
GGUF, SpecServer `specexport serve` on one artifact and proposer. Both turn a greedy request on
token ids into one run row (tokens, tok_s, new_tokens, drafted, accepted, calls).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from llamacpp_build import check

from specexport.bench import harness

REPO = Path(__file__).resolve().parents[1]  # the servers' working directory


def spec_types(server: Path) -> set[str]:
    """--spec-type values this llama-server accepts (from its --help line 'draft-simple,...')."""
    text = check([str(server), "--help"], "llama-server --help").stdout
    line = next((ln for ln in text.splitlines() if "--spec-type" in ln), "")
    return {w for w in line.replace(",", " ").replace("|", " ").split() if w.startswith(("ngram-", "draft-"))}


def _bench(bin_dir: Path, model: Path, threads: int, prompt: int, gen: int) -> list[str]:
    return [
        str(bin_dir / "llama-bench"),
        "-m",
        str(model),
        "-p",
        str(prompt),
        "-n",
        str(gen),
        "-r",
        "1",
        "-t",
        str(threads),
    ]


def repack_works(bin_dir: Path, model: Path, threads: int) -> bool:
    """Whether llama.cpp's weight repacking (its AMX and repack buffer types, on by default) survives
    a batched matmul: an 8-token llama-bench prompt run. On one AMX host (this llama.cpp build, Q4_1
    and Q8_0) the AMX tile kernel died with SIGILL there, while 1-token decode steps ran fine."""
    return subprocess.run(_bench(bin_dir, model, threads, 8, 0), capture_output=True, check=False).returncode == 0


def bench_tg(bin_dir: Path, model: Path, n: int, threads: int) -> dict:
    """llama-bench's text-generation test (n tokens after an empty context, default repacking): a
    reference row of llama.cpp's decode speed that needs no batched call, no prompt, no tokens."""
    out = check(_bench(bin_dir, model, threads, 0, n) + ["-o", "json"], f"llama-bench on {model.name}").stdout
    tok_s = json.loads(out)[0]["avg_ts"]
    return {
        "tokens": [],
        "tok_s": tok_s,
        "new_tokens": n,
        "wall_tok_s": tok_s,
        "drafted": 0,
        "accepted": 0,
        "calls": None,
    }  # wall_tok_s: llama-bench's own figure, not this process run's wall time


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class HttpServer:
    """One server process on a free localhost port, its log in `log`; `post` times each request
    from the client's side (wall seconds, HTTP and prefill included)."""

    kind = "server"

    def __init__(self, name: str, cmd: list[str], port: int, log: Path):
        self.name, self.port, self.log = name, port, log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)

    def _fail(self, why: str) -> harness.HarnessError:
        lines = self.log.read_text(errors="replace").strip().splitlines()
        return harness.HarnessError(f"{self.kind} {self.name}: {why}; last log line: {(lines or ['-'])[-1][:200]}")

    def wait_ready(self, timeout: float = 300) -> None:
        """Poll /health until it answers 200 (the model is loaded)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise self._fail(f"exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # not listening yet, or 503 while loading
            time.sleep(0.5)
        raise self._fail(f"not ready after {timeout:.0f} s")

    def post(self, path: str, body: dict) -> tuple[dict, float]:
        """POST a JSON body -> (response JSON, wall seconds)."""
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        start = time.perf_counter()
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                res = json.load(r)
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            raise self._fail(f"{path} failed: {e}") from e
        return res, time.perf_counter() - start

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


class LlamaServer(HttpServer):
    """llama-server on one GGUF with the given extra flags (a --spec-type, a draft)."""

    kind = "llama-server"

    def __init__(self, name: str, bin_dir: Path, model: Path, extra: list[str], threads: int, ctx: int, log: Path):
        port, t = free_port(), str(threads)
        super().__init__(
            name,
            [
                str(bin_dir / "llama-server"),
                "-m",
                str(model),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "-t",
                t,
                "-tb",
                t,
                "-td",
                t,
                "-tbd",
                t,
                "-np",
                "1",
                "--jinja",
                "-c",
                str(ctx),
                *extra,
            ],
            port,
            log,
        )

    def complete(self, ids: list[int], n: int, seed: int, schema: dict | None = None) -> dict:
        """Greedy /completion on token ids, under `schema` when given -> one run row (tokens
        include a final EOS)."""
        body = {
            "prompt": ids,
            "n_predict": n,
            "temperature": 0,
            "top_k": 1,
            "seed": seed,
            "cache_prompt": False,
            "return_tokens": True,
            "stream": False,
        }
        if schema is not None:
            body["json_schema"] = schema
        res, _ = self.post("/completion", body)
        tm = res["timings"]  # draft_n / draft_n_accepted sit in timings, only when something was drafted
        return {
            "tokens": res["tokens"],
            "tok_s": tm["predicted_per_second"],
            "new_tokens": tm["predicted_n"],
            "drafted": tm.get("draft_n", 0),
            "accepted": tm.get("draft_n_accepted", 0),
            "calls": None,
        }


class SpecServer(HttpServer):
    """`specexport serve ARTIFACT --proposer MODE` ('none' for target-only): the path a client of
    the server takes. Unlike the worker it keeps what serving keeps between requests (the suffix
    proposer's global tree of earlier answers, learned costs), as llama-server's ngram-mod keeps
    its pool; each mode has its own server, so no mode sees another's answers."""

    kind = "specexport serve"

    def __init__(self, name: str, artifact: Path, mode: str, threads: int, log: Path):
        port = free_port()
        super().__init__(
            name,
            [
                sys.executable,
                "-m",
                "specexport_runtime.cli",
                "serve",
                str(artifact),
                "--port",
                str(port),
                "--threads",
                str(threads),
                "--proposer",
                "none" if mode == "off" else mode,
            ],
            port,
            log,
        )

    def complete(self, ids: list[int], n: int, seed: int, schema: dict | None = None) -> dict:
        """Greedy /v1/completions on token ids, under `schema` when given -> one run row (decode
        tok/s as the server measured it)."""
        body = {"prompt": ids, "max_tokens": n, "temperature": 0, "seed": seed, "return_token_ids": True}
        if schema is not None:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": schema, "strict": True},
            }
        res, _ = self.post("/v1/completions", body)
        spec = res["speculative"]
        return {
            "tokens": res["choices"][0]["token_ids"],
            "tok_s": spec["decode_tokens_per_second"],
            "new_tokens": res["usage"]["completion_tokens"],
            "drafted": spec["drafted"],
            "accepted": spec["accepted"],
            "calls": spec["rounds"] + spec["plain_steps"],
        }
