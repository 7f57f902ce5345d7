"""Many concurrent chat sessions with distinct histories through the HTTP batch server, with the
prefix pool under a memory bound: the bound holds, the hit rate is reported, nothing fails.

    python benchmarks/prefix_sessions.py ARTIFACT [--sessions 32] [--turns 3] [--max-batch 8]
        [--prefix-cache-mib 256] [--max-new-tokens 24] [--threads 2] [--json OUT]

ARTIFACT has a batch graph (built with --max-batch N, N >= --max-batch). One `specexport-runtime
serve` process (--max-batch, --prefix-cache-mib, a queue that holds every session) serves
--sessions client threads at once. Session s: the artifact's stored system prompt when it has one
(else prefix_reuse.py's guidelines), then --turns user questions of its own (its number and a
question), each turn sending the whole history with the server's greedy answers of its earlier
turns. While they run, a poller reads /metrics every 0.2 s: the pool's bytes must never exceed
its bound. Reported: requests that failed (must be 0), the pool's peak bytes against the bound,
its token and request hit rates, evictions, tokens served from the pool, the server's peak
resident memory, and per turn the median time to first token and cached prompt tokens.
"""

from __future__ import annotations

import re
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "runtime"))
sys.path.insert(0, str(REPO / "benchmarks"))

from llamacpp_servers import HttpServer, free_port  # noqa: E402
from prefix_reuse import QUESTIONS, system_prompt  # noqa: E402

from specexport.bench import harness  # noqa: E402

METRIC = re.compile(r"^(specexport:prefix_cache_\w+?)(?:_total)?\{[^}]*\} ([0-9.e+-]+)$", re.M)


def metrics(port: int) -> dict[str, float]:
    """specexport:prefix_cache_* values of the server's /metrics (model label dropped)."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {m.group(1).removeprefix("specexport:prefix_cache_"): float(m.group(2)) for m in METRIC.finditer(text)}


def peak_rss(pid: int) -> int:
    """VmHWM of a process, bytes (0 where /proc lacks it)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def session(client, model: str, s: int, system: str, args, out: list, errors: list) -> None:
    messages = [{"role": "system", "content": system}]
    for t in range(args.turns):
        messages.append({"role": "user", "content": f"Session {s + 1}, question {t + 1}: {QUESTIONS[(s + t) % 8]}"})
        start = time.perf_counter()
        try:
            first, text, usage = None, [], None
            for chunk in client.chat.completions.create(
                model=model,
                messages=messages,
                max_tokens=args.max_new_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            ):
                usage = chunk.usage or usage
                if chunk.choices and chunk.choices[0].delta.content:
                    first = first or time.perf_counter()
                    text.append(chunk.choices[0].delta.content)
        except Exception as exc:  # noqa: BLE001 - every failure is counted and reported
            errors.append(f"session {s + 1} turn {t + 1}: {type(exc).__name__}: {exc}"[:300])
            return
        cached = usage.prompt_tokens_details.cached_tokens if usage and usage.prompt_tokens_details else 0
        out.append({"turn": t, "ttft_ms": 1000 * ((first or time.perf_counter()) - start), "cached": cached})
        messages.append({"role": "assistant", "content": "".join(text)})


def parser():
    ap = harness.script_parser(__doc__)
    ap.add_argument("artifact", help="artifact folder with a batch graph (specexport build --max-batch N)")
    ap.add_argument("--sessions", type=int, default=32, help="concurrent sessions (default 32)")
    ap.add_argument("--turns", type=int, default=3, help="turns per session (default 3)")
    ap.add_argument("--max-batch", type=int, default=8, help="the server's --max-batch (default 8)")
    ap.add_argument("--prefix-cache-mib", type=float, default=256, help="the server's pool bound, MiB (default 256)")
    ap.add_argument("--max-new-tokens", type=int, default=24, help="tokens per answer at most (default 24)")
    ap.add_argument("--system-tokens", type=int, default=1000, help="system prompt tokens without a stored one")
    ap.add_argument("--threads", type=int, default=2, help="the server's intra-op threads (default 2)")
    ap.add_argument("--json", default=None, metavar="OUT", help="write the machine, command and results as JSON here")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    for name in ("sessions", "turns", "max_batch", "max_new_tokens", "threads", "system_tokens"):
        if getattr(args, name) < 1:
            raise harness.HarnessError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    import openai

    from specexport_runtime.manifest import read_manifest
    from specexport_runtime.tokenizer import TextCodec

    meta = harness.run_metadata(None if argv is None else [__file__, *argv], **vars(args))
    root = Path(args.artifact)
    manifest = read_manifest(root)
    if manifest.system_prompt is not None:
        system = (root / manifest.system_prompt.text).read_text(encoding="utf-8")
    else:
        system = system_prompt(TextCodec(root / manifest.tokenizer.file), args.system_tokens)
    port = free_port()
    cmd = [sys.executable, "-m", "specexport_runtime.cli", "serve", str(root), "--port", str(port)]
    cmd += ["--threads", str(args.threads), "--max-batch", str(args.max_batch), "--max-queue", str(4 * args.sessions)]
    cmd += ["--prefix-cache-mib", str(args.prefix_cache_mib)]
    server = HttpServer("sessions", cmd, port, Path("/tmp") / f"prefix_sessions.{port}.log")
    out: list[dict] = []
    errors: list[str] = []
    peak = {"bytes": 0.0, "max_bytes": 0.0, "over": 0}
    done = threading.Event()
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=1800)
        model = client.models.list().data[0].id

        def poll() -> None:
            while not done.is_set():
                m = metrics(port)
                peak["bytes"], peak["max_bytes"] = max(peak["bytes"], m.get("bytes", 0)), m.get("max_bytes", 0)
                peak["over"] += m.get("bytes", 0) > m.get("max_bytes", 0)
                time.sleep(0.2)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        start = time.perf_counter()
        threads = [
            threading.Thread(target=session, args=(client, model, s, system, args, out, errors))
            for s in range(args.sessions)
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        wall = time.perf_counter() - start
        done.set()
        poller.join(5)
        final = metrics(port)
        rss = peak_rss(server.proc.pid)
    finally:
        done.set()
        server.close()
    print(
        harness.preamble(
            meta,
            None,
            f"{args.sessions} concurrent sessions x {args.turns} turns, distinct histories over a shared system prompt"
            f" ({'stored in the artifact' if manifest.system_prompt else 'run time'}), greedy,"
            f" {args.max_new_tokens} tokens an answer, serve --max-batch {args.max_batch}"
            f" --prefix-cache-mib {args.prefix_cache_mib}",
        )
    )
    print(f"requests: {len(out)} answered, {len(errors)} failed, wall {wall:.1f} s")
    for e in errors[:5]:
        print(f"  failed: {e}")
    print(
        f"pool: peak {peak['bytes'] / 2**20:.1f} MiB of {peak['max_bytes'] / 2**20:.1f} MiB bound"
        f" (samples over the bound: {peak['over']}), token hit rate {final.get('token_hit_rate', 0):.3f},"
        f" evictions {final.get('evictions', 0):.0f}; server peak RSS {rss / 2**30:.2f} GiB"
    )
    print(f"{'turn':>4} {'requests':>8} {'median TTFT ms':>15} {'median cached':>14}")
    turns = []
    for t in range(args.turns):
        rows = [r for r in out if r["turn"] == t]
        if rows:
            ttft, cached = statistics.median(r["ttft_ms"] for r in rows), statistics.median(r["cached"] for r in rows)
            turns.append({"turn": t + 1, "requests": len(rows), "ttft_ms": ttft, "cached": cached})
            print(f"{t + 1:>4} {len(rows):>8} {ttft:>15.1f} {cached:>14.0f}")
    if args.json:
        harness.write_json(
            args.json,
            {"meta": meta, "turns": turns, "errors": errors, "pool_peak": peak, "final": final, "peak_rss": rss},
        )
    return 1 if errors or peak["over"] else 0


if __name__ == "__main__":
    raise SystemExit(harness.cli(main))
