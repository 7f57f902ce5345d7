"""Aggregate throughput of continuous batching against the batch-1 runtime, at several concurrencies.

    python benchmarks/batch_throughput.py ARTIFACT [--prompts chat] [--limit 16] [--max-new-tokens 128]
        [--concurrency 1,2,4,8] [--repeats 3] [--threads 2] [--json OUT]

ARTIFACT must hold a batch graph (`specexport build ... --max-batch 8`). One process loads it
twice: the batch-1 generator (what `specexport serve` without batching runs: one request at a
time, so its aggregate throughput at any concurrency is its sequential one) and the batch
generator (load(..., batch=True)). Methods:
    batch1-default     the batch-1 generator, the artifact's default proposer, prompts in turn
    batch1-off         the same, target-only
    batch-C-off/on     C closed-loop clients on the batch scheduler (max_running C): each client
                       submits its next prompt when its previous one ends; speculation off, or
                       on (the artifact's default proposer at the batch's gamma)
Each repeat runs every method over the whole prompt set, in an order rotated by one per repeat;
every method first runs a warm-up prompt outside the set, and the suffix store of earlier
answers is emptied before every method's run. Figures per method: aggregate tok/s = generated
tokens / wall seconds of the whole set (prefills included), median over repeats; the ratio to
batch1-default per repeat, then its median; time to first token per request (submit to first
token; p50 and p99 over the set); the most prompt rows one round carried and the longest round.
Greedy outputs of every batch method are compared token for token with batch1-off's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "runtime"))

from specexport.bench import harness  # noqa: E402


def sequential(gen, cases, n: int, speculative: bool) -> dict:
    gen.forget_history()
    outputs, ttft, tokens = {}, [], 0
    start = time.perf_counter()
    for case in cases:
        t0 = time.perf_counter()
        first = None
        ids: list[int] = []
        for new, _, _ in gen.events(list(case.ids), max_new_tokens=n, speculative=speculative):
            if new and first is None:
                first = time.perf_counter()
            ids += new
        ttft.append((first or time.perf_counter()) - t0)
        outputs[case.id] = ids
        tokens += len(ids)
    return {"seconds": time.perf_counter() - start, "tokens": tokens, "ttft": ttft, "outputs": outputs}


def closed_loop(gen, cases, n: int, clients: int, speculative: bool) -> dict:
    """`clients` closed-loop clients over the scheduler: each submits its next prompt when its last ends."""
    gen.forget_history()
    scheduler = gen.scheduler(max_running=clients)
    queue, inflight, done = list(cases), [], []

    def submit():
        case = queue.pop(0)
        seq = scheduler.submit(list(case.ids), max_new_tokens=n, speculative=speculative)
        inflight.append((case, seq))

    start = time.perf_counter()
    for _ in range(min(clients, len(queue))):
        submit()
    while inflight:
        scheduler.step()
        for item in [x for x in inflight if x[1].done]:
            inflight.remove(item)
            done.append(item)
            if queue:
                submit()
    seconds = time.perf_counter() - start
    prefill_rounds = [s for _, p, s in scheduler.round_log if p]
    return {
        "seconds": seconds,
        "tokens": sum(len(s.tokens) for _, s in done),
        "ttft": [(s.first_token_at or s.queued_at) - s.queued_at for _, s in done],
        "outputs": {case.id: s.tokens for case, s in done},
        "stall_rows": scheduler.stall_rows,
        "longest_round_s": max(s for _, _, s in scheduler.round_log),
        "longest_prefill_round_s": max(prefill_rounds, default=0.0),
        "median_round_s": statistics.median(s for _, _, s in scheduler.round_log),
        "drafted": sum(s.stats.drafted for _, s in done),
        "accepted": sum(s.stats.accepted for _, s in done),
        "batch_sizes": dict(sorted(scheduler.batch_sizes.items())),
    }


def pct(values, q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("artifact", type=Path, help="an artifact built with --max-batch > 1")
    ap.add_argument("--prompts", default="chat", help="calibration domains or JSONL files (default chat)")
    ap.add_argument("--limit", type=int, default=16, help="first N prompts of each domain (default 16)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="tokens per answer (default 128)")
    ap.add_argument("--concurrency", default="1,2,4,8", help="comma-separated client counts (default 1,2,4,8)")
    ap.add_argument("--repeats", type=int, default=3, help="passes over the prompt set (default 3)")
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads (default 2)")
    ap.add_argument(
        "--no-shared-pool",
        action="store_true",
        help="give every ONNX Runtime session its own thread pool (default: one process-wide pool, as the CLIs)",
    )
    ap.add_argument("--json", type=Path, default=None, help="write the run's figures here")
    return ap


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    from specexport_runtime.api import load

    concurrency = [int(c) for c in args.concurrency.split(",")]
    shared = not args.no_shared_pool
    solo = load(args.artifact, threads=args.threads, shared_pool=shared)
    batch = load(args.artifact, threads=args.threads, shared_pool=shared, batch=True)
    if max(concurrency) > batch.slots.slots:
        ap.error(f"--concurrency {max(concurrency)} exceeds the artifact's max_batch {batch.slots.slots}")
    cases = harness.make_cases(solo.codec, harness.load_prompt_set(args.prompts, args.limit))
    warm = [harness.warmup_case(solo.codec)]
    n = args.max_new_tokens
    methods = {
        "batch1-default": lambda cs: sequential(solo, cs, n, True),
        "batch1-off": lambda cs: sequential(solo, cs, n, False),
    }
    for c in concurrency:
        for on in (False, True):
            methods[f"batch-{c}-{'on' if on else 'off'}"] = lambda cs, c=c, on=on: closed_loop(batch, cs, n, c, on)
    for run in methods.values():  # warm-up outside the measured set
        run(warm)
    runs: dict[str, list[dict]] = {name: [] for name in methods}
    names = list(methods)
    for r in range(args.repeats):
        for name in harness.rotated(names, r):
            runs[name].append(methods[name](cases))
            print(
                f"repeat {r + 1} {name}: {runs[name][-1]['tokens'] / runs[name][-1]['seconds']:.1f} tok/s", flush=True
            )
    reference = runs["batch1-off"][0]["outputs"]
    table = {}
    for name, rs in runs.items():
        rates = [x["tokens"] / x["seconds"] for x in rs]
        ratios = [x["tokens"] / x["seconds"] / (b["tokens"] / b["seconds"]) for x, b in zip(rs, runs["batch1-default"])]
        ttft = [t for x in rs for t in x["ttft"]]
        row = {
            "tok_s": statistics.median(rates),
            "vs_batch1_default": statistics.median(ratios),
            "ttft_p50_ms": 1000 * pct(ttft, 0.5),
            "ttft_p99_ms": 1000 * pct(ttft, 0.99),
            "identical_to_target_only": sum(x["outputs"][k] == reference[k] for x in rs for k in reference),
            "compared": len(rs) * len(reference),
        }
        for key in ("stall_rows", "longest_prefill_round_s", "median_round_s", "drafted", "accepted", "batch_sizes"):
            if key in rs[-1]:
                row[key] = rs[-1][key]
        table[name] = row
    print(f"{'method':<16} {'tok/s':>7} {'x b1-def':>8} {'ttft p50':>9} {'ttft p99':>9} {'same':>7}")
    for name, row in table.items():
        same = f"{row['identical_to_target_only']}/{row['compared']}"
        print(
            f"{name:<16} {row['tok_s']:7.1f} {row['vs_batch1_default']:8.2f} {row['ttft_p50_ms']:8.0f}m"
            f" {row['ttft_p99_ms']:8.0f}m {same:>7}"
        )
    doc = {"metadata": harness.run_metadata(), "args": {k: str(v) for k, v in vars(args).items()}, "methods": table}
    if args.json:
        args.json.write_text(json.dumps(doc, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
