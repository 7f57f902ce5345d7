"""What free retrieval rows are worth in a batch: C closed-loop clients with speculation off, on,
and on without free rows, in one run.

    python benchmarks/experiments/free_rows.py ARTIFACT [--clients 8] [--prompts chat] [--limit 16]
        [--max-new-tokens 128] [--repeats 5] [--threads 2] [--proposer NAME] [--json OUT]

ARTIFACT must hold a batch graph of at least --clients slots. One batch generator serves every
method (benchmarks/batch_throughput.py's closed loop: each client submits its next prompt when
its last ends, the store of earlier answers emptied before each run). Methods:
    off         speculation off
    on          the artifact's default proposer (or --proposer) at the batch's gamma, free retrieval rows
                (hybrid's offers, suffix matches) within BatchGamma.free_limit
    no-free     the same with free_limit 0: drafts only in rounds of a batch gamma above 0
Each method first runs a warm-up prompt outside the set; repeats run the methods in an order
rotated by one. Figures: aggregate tok/s (generated tokens / wall seconds of the set) per repeat,
each method's ratio to off per repeat and its median, and the free tokens drafted and accepted.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "runtime"))
sys.path.insert(0, str(REPO / "benchmarks"))

from specexport.bench import harness  # noqa: E402

METHODS = ("off", "on", "no-free")


def parser():
    ap = harness.script_parser(__doc__)
    ap.add_argument("artifact", help="artifact folder built with --max-batch >= --clients")
    ap.add_argument("--clients", type=int, default=8, help="closed-loop clients (default 8)")
    ap.add_argument("--proposer", default=None, help="the proposer of 'on' (default: the artifact's, e.g. hybrid)")
    harness.add_run_options(ap, prompts="chat", limit=16, max_new_tokens=128, repeats=5, threads=2)
    return ap


def main(argv=None) -> int:
    args = harness.parse_args(parser(), argv)
    from batch_throughput import closed_loop

    from specexport_runtime.api import load

    if args.clients < 1:
        raise harness.HarnessError(f"--clients must be >= 1, got {args.clients}")
    meta = harness.run_metadata(None if argv is None else [__file__, *argv], **vars(args))
    config = {"proposer": args.proposer} if args.proposer else None
    gen = load(args.artifact, threads=args.threads, batch=True, config=config)
    cases = harness.make_cases(gen.codec, harness.load_prompt_set(args.prompts, args.limit))
    warm = [harness.warmup_case(gen.codec)]
    gamma = gen.scheduler().gamma  # the policy's BatchGamma, which every run's scheduler shares
    free_limit = gamma.free_limit

    def run(method: str, set_cases) -> dict:
        gamma.free_limit = (lambda running: 0) if method == "no-free" else free_limit
        return closed_loop(gen, set_cases, args.max_new_tokens, args.clients, method != "off")

    for method in METHODS:
        run(method, warm)
    rows: dict[str, list[dict]] = {m: [] for m in METHODS}
    outputs: dict[str, dict] = {}  # method -> case id -> greedy tokens of its first run
    for r in range(args.repeats):
        for method in harness.rotated(list(METHODS), r):
            res = run(method, cases)
            row = {"tok_s": res["tokens"] / res["seconds"], "drafted": res["drafted"], "accepted": res["accepted"]}
            rows[method].append(row)
            outputs.setdefault(method, res["outputs"])
            print(f"  repeat {r + 1} {method:<8} {row['tok_s']:7.1f} tok/s", file=sys.stderr, flush=True)
    summary = {}
    for method in METHODS:
        ratios = [a["tok_s"] / b["tok_s"] for a, b in zip(rows[method], rows["off"])]
        summary[method] = {
            "tok_s": statistics.median(x["tok_s"] for x in rows[method]),
            "vs_off": [round(x, 4) for x in ratios],
            "vs_off_median": statistics.median(ratios),
            "drafted": sum(x["drafted"] for x in rows[method]),
            "accepted": sum(x["accepted"] for x in rows[method]),
            "identical_to_off": sum(outputs[method][k] == v for k, v in outputs["off"].items()),
        }
    settings = f"{args.clients} clients, {len(cases)} prompts x {args.repeats}, {args.max_new_tokens} tokens, greedy"
    print(harness.preamble(meta, None, settings))
    print(f"{'method':<9}{'tok/s':>8}{'x off':>8}  {'per repeat':<38}drafted/accepted  identical")
    for method, s in summary.items():
        reps = ", ".join(f"{x:.2f}" for x in s["vs_off"])
        counts = f"{s['drafted']}/{s['accepted']}"
        same = f"{s['identical_to_off']}/{len(cases)}"
        print(f"{method:<9}{s['tok_s']:8.1f}{s['vs_off_median']:8.2f}  {reps:<38}{counts:<18}{same}")
    if args.json:
        harness.write_json(args.json, {"meta": meta, "methods": summary, "runs": rows})
    return 0 if all(s["identical_to_off"] == len(cases) for s in summary.values()) else 1


if __name__ == "__main__":
    raise SystemExit(harness.cli(main))
