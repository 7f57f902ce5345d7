"""How a hybrid's prompt should be read: the chunked scan in calls of up to 256 rows (what the
runtime does, recurrent.MAX_CALL_ROWS) against the step recurrence in calls of at most 64 rows
(recurrent.STEP_ROWS), whose rows and states do not depend on the grouping (a prefix hit could
then resume at any position bit for bit). A random-init hybrid of --shape (benchmarks/hybrid_graphs.py
SHAPES), fp32 fused, 2 ONNX Runtime threads; the groupings interleaved, medians of --repeats.

    python benchmarks/experiments/recurrent_prefill.py [--shape qwen3.5-0.8b] [--tokens 512] [--repeats 3]
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "runtime"), str(REPO / "benchmarks")]

from hybrid_graphs import build_graph, shape_config  # noqa: E402

from specexport.bench import harness  # noqa: E402
from specexport_runtime.engine import OrtModel, SessionConfig  # noqa: E402


def parser():
    ap = harness.script_parser(__doc__)
    ap.add_argument("--shape", default="qwen3.5-0.8b", help="a hybrid_graphs shape (default qwen3.5-0.8b)")
    ap.add_argument("--tokens", type=int, default=512, help="prompt tokens read (default 512)")
    ap.add_argument("--calls", default="256,64,32", help="rows per call to compare (default 256,64,32)")
    ap.add_argument("--repeats", type=int, default=3, help="timed reads per grouping (default 3)")
    ap.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads (default 2)")
    ap.add_argument("--work", default=None, help="folder for the graph (default: a temporary one)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    meta = harness.run_metadata(None if argv is None else [__file__, *argv], **vars(args))
    cfg = shape_config(args.shape, [])
    root = Path(args.work or tempfile.mkdtemp(prefix="prefill-"))
    opts = SimpleNamespace(block_size=32, accuracy_level=4, seed=0)
    graph = build_graph("hybrid", "fp32", "fused", cfg, args.tokens + 8, opts, root)
    model = OrtModel(
        graph.path, graph.spec, args.tokens + 8, SessionConfig(threads=args.threads), cache_pad=graph.cache_pad
    )
    ids = [int(t) for t in np.random.default_rng(0).integers(10, cfg["vocab_size"] - 10, size=args.tokens)]
    sizes = [int(s) for s in args.calls.split(",")]
    times: dict[int, list[float]] = {s: [] for s in sizes}
    last: dict[int, np.ndarray] = {}
    for rep in range(args.repeats + 1):  # the first pass warms up
        for s in sizes:
            model.reset()
            start = time.perf_counter()
            for at in range(0, args.tokens, s):
                out = model.forward(ids[at : at + s])
            if rep:
                times[s].append(time.perf_counter() - start)
            last[s] = out.copy()
    print(harness.header(meta))
    base = statistics.median(times[sizes[0]])
    print(f"{'rows a call':>12} {'read s':>8} {'tok/s':>7} {'x':>6} {'last row max |diff|':>20}")
    for s in sizes:
        t = statistics.median(times[s])
        diff = float(np.max(np.abs(last[s] - last[sizes[0]])))
        print(f"{s:>12} {t:>8.2f} {args.tokens / t:>7.1f} {t / base:>5.2f}x {diff:>20.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
