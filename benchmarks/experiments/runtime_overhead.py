"""Python overhead and memory flatness of the runtime on one long generation.

    python benchmarks/experiments/runtime_overhead.py ARTIFACT [--tokens 2000] [--proposer draft|ngram|hybrid]
        [--threads 2] [--json OUT]

Reports, for speculation off and on: time inside ONNX Runtime session calls (both models) vs
total generation time, i.e. the share spent in Python around them, and the resident memory
(RSS) after the first 20 emitted pieces vs at the end. One warm-up generation on a prompt outside
the measured one comes first (specexport.bench.harness), and the store of earlier answers is emptied
before each measurement.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "runtime"))

from specexport.bench import harness  # noqa: E402

PROMPT = "Write a long, detailed tutorial about binary search trees in Python, with code for every operation."


def measure(gen, speculative: bool, proposer: str | None, tokens: int) -> dict:
    import psutil

    process = psutil.Process()
    rss: list[int] = []
    for model in (gen.target, gen.draft):
        if model is not None:
            model.stats.__init__()  # count this generation's calls only
    gen.forget_history()
    run = gen.events(
        gen.codec.encode_chat([{"role": "user", "content": PROMPT}]),
        max_new_tokens=tokens,
        speculative=speculative,
        proposer=proposer,
        gamma=None,
    )
    for _ in run.pieces():
        rss.append(process.memory_info().rss)
    stats = run.stats
    ort_seconds = gen.target.stats.seconds + (gen.draft.stats.seconds if gen.draft is not None else 0.0)
    total = stats.total_seconds
    early = rss[min(len(rss) - 1, 20)]
    return {
        "speculative": speculative,
        "new_tokens": stats.new_tokens,
        "tokens_per_second": round(stats.tokens_per_second, 1),
        "total_s": round(total, 2),
        "onnxruntime_s": round(ort_seconds, 2),
        "python_share": round(1 - ort_seconds / total, 4),
        "rss_mb_early": round(early / 2**20, 1),
        "rss_mb_end": round(rss[-1] / 2**20, 1),
        "rss_growth": round(rss[-1] / early - 1, 4),
    }


def parser():
    ap = harness.script_parser(__doc__)
    ap.add_argument("artifact", help="artifact folder (specexport build)")
    ap.add_argument("--tokens", type=int, default=2000, help="new tokens to generate (default 2000)")
    ap.add_argument("--proposer", default=None, help="the proposer of the speculative run (default: the artifact's)")
    ap.add_argument("--threads", type=int, default=None, help="ONNX Runtime intra-op threads (default: all cores)")
    ap.add_argument("--json", default=None, metavar="OUT", help="write the machine, command and rows as JSON here")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.tokens < 1:
        raise harness.HarnessError(f"--tokens must be at least 1, got {args.tokens}")
    from specexport_runtime.api import load

    meta = harness.run_metadata(None if argv is None else [__file__, *argv], **vars(args))
    gen = load(args.artifact, threads=args.threads, shared_pool=True)
    proposer = gen.resolve_proposer(args.proposer)
    gen.chat(list(harness.WARMUP_MESSAGES), max_new_tokens=8, proposer=proposer)
    rows = [measure(gen, False, None, args.tokens), measure(gen, True, proposer, args.tokens)]
    print(harness.header(meta))
    for row in rows:
        print(json.dumps(row))
    if args.json:
        harness.write_json(args.json, {"meta": meta, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(harness.cli(main))
