"""Server against server under concurrent clients: `specexport serve --max-batch N` and llama-server
with N parallel slots (continuous batching), on the same GGUF-derived F32 weights.

    python benchmarks/batch_servers.py ARTIFACT --gguf F32.gguf [--prompts chat] [--limit 16]
        [--max-new-tokens 128] [--concurrency 1,2,4,8] [--repeats 2] [--threads 2]
        [--llama-bin DIR] [--llama-spec ngram-simple] [--json OUT]

ARTIFACT must hold a batch graph of at least max(concurrency) slots. Every server runs alone in
turn (the others are stopped) on the same threads: specexport with speculation on (its default
proposer; in a batch a draft-model proposer drafts by prompt lookup) and off, llama-server plain
and with `--llama-spec` (a --spec-type without a draft model) when given, each with -np C and a
context of C x the artifact's max_context. Clients: C threads, each sending the prompts of its
share one after another (greedy, token ids in, the chat template applied by the artifact's
codec, `cache_prompt` off), non-streaming; aggregate tok/s = completion tokens / wall seconds of
the whole set. Each server first answers a warm-up prompt outside the set. Repeats run the
servers in an order rotated by one. Greedy outputs are compared with specexport-off's per prompt.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "runtime"))
sys.path.insert(0, str(REPO / "benchmarks"))

from llamacpp_servers import HttpServer, free_port  # noqa: E402

from specexport.bench import harness  # noqa: E402


def spec_engine(
    artifact: Path, speculative: bool, clients: int, threads: int, log: Path
) -> tuple[HttpServer, callable]:
    port = free_port()
    cmd = [sys.executable, "-m", "specexport_runtime.cli", "serve", str(artifact), "--port", str(port)]
    cmd += ["--threads", str(threads), "--max-batch", str(clients), "--max-queue", "256"]
    if not speculative:
        cmd += ["--proposer", "none"]
    server = HttpServer(f"specexport-{'on' if speculative else 'off'}", cmd, port, log)

    def ask(ids, n):
        res, _ = server.post(
            "/v1/completions", {"prompt": ids, "max_tokens": n, "temperature": 0, "return_token_ids": True}
        )
        return res["choices"][0]["token_ids"]

    return server, ask


def llama_engine(bin_dir: Path, gguf: Path, spec: str | None, clients: int, threads: int, ctx: int, log: Path):
    port, t = free_port(), str(threads)
    cmd = [str(bin_dir / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["-t", t, "-tb", t, "-np", str(clients), "-c", str(ctx * clients), "--jinja", "--cont-batching"]
    if spec:
        cmd += ["--spec-type", spec]
    server = HttpServer(f"llama-{spec or 'plain'}", cmd, port, log)

    def ask(ids, n):
        body = {"prompt": ids, "n_predict": n, "temperature": 0, "top_k": 1, "cache_prompt": False}
        res, _ = server.post("/completion", {**body, "return_tokens": True, "stream": False})
        return res["tokens"]

    return server, ask


def drive(ask, cases, n: int, clients: int) -> dict:
    """`clients` threads share the cases (client k takes cases k, k + clients, ...)."""
    outputs: dict[str, list[int]] = {}

    def client(k: int) -> None:
        for case in cases[k::clients]:
            outputs[case.id] = ask(list(case.ids), n)

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        for f in [pool.submit(client, k) for k in range(clients)]:
            f.result()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": sum(len(v) for v in outputs.values()), "outputs": outputs}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("artifact", type=Path, help="an artifact built with --max-batch >= max(concurrency)")
    ap.add_argument("--gguf", type=Path, required=True, help="llama-server's model (the same weights, F32)")
    ap.add_argument("--llama-bin", type=Path, default=None, help="folder of llama-server (default: build cache)")
    ap.add_argument("--llama-spec", default=None, help="also run llama-server with this --spec-type")
    ap.add_argument("--prompts", default="chat", help="calibration domains or JSONL files (default chat)")
    ap.add_argument("--limit", type=int, default=16, help="first N prompts of each domain (default 16)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="tokens per answer (default 128)")
    ap.add_argument("--concurrency", default="1,2,4,8", help="comma-separated client counts (default 1,2,4,8)")
    ap.add_argument("--repeats", type=int, default=2, help="passes per server and concurrency (default 2)")
    ap.add_argument("--threads", type=int, default=2, help="threads of every server (default 2)")
    ap.add_argument("--json", type=Path, default=None, help="write the run's figures here")
    return ap


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    from llamacpp_build import llama_binaries

    from specexport_runtime.api import open_artifact

    cache = "~/.cache/specexport/llama.cpp"  # compare_llamacpp.py's default build folder
    bin_dir = args.llama_bin or llama_binaries(argparse.Namespace(llama_bin=None, cache=cache, threads=2))
    manifest, codec, _ = open_artifact(args.artifact)
    cases = harness.make_cases(codec, harness.load_prompt_set(args.prompts, args.limit))
    warm = [harness.warmup_case(codec)]
    n, ctx = args.max_new_tokens, manifest.max_context
    logs = Path(args.json.parent if args.json else ".") / "batch_servers_logs"
    logs.mkdir(exist_ok=True)
    makers = {
        "specexport-on": lambda c: spec_engine(args.artifact, True, c, args.threads, logs / f"spec-on-{c}.log"),
        "specexport-off": lambda c: spec_engine(args.artifact, False, c, args.threads, logs / f"spec-off-{c}.log"),
        "llama-plain": lambda c: llama_engine(bin_dir, args.gguf, None, c, args.threads, ctx, logs / f"llama-{c}.log"),
    }
    if args.llama_spec:
        makers[f"llama-{args.llama_spec}"] = lambda c: llama_engine(
            bin_dir, args.gguf, args.llama_spec, c, args.threads, ctx, logs / f"llama-spec-{c}.log"
        )
    table: dict = {}
    for c in [int(x) for x in args.concurrency.split(",")]:
        rates: dict[str, list[float]] = {name: [] for name in makers}
        outputs: dict[str, dict] = {}
        for r in range(args.repeats):
            for name in harness.rotated(list(makers), r):
                server, ask = makers[name](c)
                try:
                    server.wait_ready()
                    drive(ask, warm, n, 1)
                    run = drive(ask, cases, n, c)
                finally:
                    server.close()
                rates[name].append(run["tokens"] / run["seconds"])
                outputs.setdefault(name, run["outputs"])
                print(f"c={c} repeat {r + 1} {name}: {rates[name][-1]:.1f} tok/s", flush=True)
        ref = outputs["specexport-off"]
        for name in makers:
            med = statistics.median(rates[name])
            table.setdefault(name, {})[c] = {
                "tok_s": med,
                "runs": rates[name],
                "same_as_specexport_off": sum(outputs[name][k][: len(ref[k])] == ref[k] for k in ref),
                "prompts": len(ref),
            }
    best_llama = {
        c: max(v[c]["tok_s"] for k, v in table.items() if k.startswith("llama")) for c in table["llama-plain"]
    }
    print(f"{'server':<22}" + "".join(f"{'c=' + str(c):>14}" for c in best_llama))
    for name, row in table.items():
        print(f"{name:<22}" + "".join(f"{row[c]['tok_s']:8.1f} {row[c]['tok_s'] / best_llama[c]:4.2f}x" for c in row))
    doc = {"metadata": harness.run_metadata(), "servers": table, "best_llama": best_llama}
    if args.json:
        args.json.write_text(json.dumps(doc, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
