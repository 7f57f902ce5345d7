"""Per-call cost of the graphs of several artifacts, measured in one process, interleaved.

    python benchmarks/graph_forms.py ARTIFACT [ARTIFACT ...] [--past 200] [--calls 30] [--repeats 5]
        [--seq 1,5,9] [--threads 2] [--json OUT]

For each artifact's target and draft (e.g. a portable and a fused build of the same recipe) it
times the runtime's own OrtModel.forward at a past length of --past tokens for S = 1 (decode)
and the verify sizes in --seq, rotating through the models each repeat so machine drift spreads
over all of them, and prints the median milliseconds per call and the ratio of each call to the
first artifact's target decode. No generation, no sampling: only the graph calls the
speculative loop makes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "runtime"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifacts", nargs="+", help="artifact folders (specexport build)")
    ap.add_argument("--past", type=int, default=200, help="cached tokens before each timed call (default 200)")
    ap.add_argument("--calls", type=int, default=30, help="calls per measurement (default 30)")
    ap.add_argument("--repeats", type=int, default=5, help="measurements per model and S; the median is kept (default 5)")
    ap.add_argument("--seq", default="1,5,9", help="comma list of S (tokens per call) to time (default 1,5,9)")
    ap.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads (default 2)")
    ap.add_argument("--json", default=None, help="write the rows as JSON to this file")
    args = ap.parse_args(argv)

    from specexport_runtime.engine import OrtModel, SessionConfig
    from specexport_runtime.manifest import read_manifest

    config = SessionConfig(threads=args.threads, shared_pool=True)
    models = {}
    for root in map(Path, args.artifacts):
        manifest = read_manifest(root)
        for role, entry in (("target", manifest.target), ("draft", manifest.draft)):
            if entry is not None:
                label = f"{root.name}/{role} ({entry.precision}, {entry.kv_layout})"
                models[label] = OrtModel(root / entry.graph, entry.graph_spec(), manifest.max_context, config)
    seqs = [int(s) for s in args.seq.split(",")]
    samples: dict[tuple[str, int], list[float]] = {(m, s): [] for m in models for s in seqs}
    names = list(models)
    for rep in range(args.repeats):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            model = models[name]
            for s in seqs:
                model.reset()
                model.forward(list(range(3, 3 + args.past)))
                start = time.perf_counter()
                for _ in range(args.calls):
                    model.truncate(args.past)
                    model.forward([5] * s, last_rows=s)
                samples[(name, s)].append((time.perf_counter() - start) / args.calls * 1000)
    base = statistics.median(samples[(names[0], seqs[0])])
    rows = [{"model": m, "seq": s, "ms_median": statistics.median(samples[(m, s)]),
             "vs_first_target_decode": statistics.median(samples[(m, s)]) / base} for m in names for s in seqs]
    print(f"past {args.past}, {args.threads} threads, median of {args.repeats} x {args.calls} calls")
    print(f"{'model':<60}{'S':>3}{'ms':>9}{'ratio':>8}")
    for r in rows:
        print(f"{r['model']:<60}{r['seq']:>3}{r['ms_median']:>9.2f}{r['vs_first_target_decode']:>8.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
