"""What one call of a batch graph costs against the batch-1 graph, by running sequences and rows.

    python benchmarks/experiments/slot_cost.py ARTIFACT [--role target|draft] [--sizes 1,2,5,9]
        [--running 1,2,4,8] [--past 300] [--json OUT]

ARTIFACT is built with `--max-batch K`. For each S in --sizes this times the batch-1 graph's
S-row call at a --past-token cache and, beside it, one batch-graph call in which c sequences
(c in --running) each feed S rows at the same past while the other K - c slots are empty
(cursor 0), as the scheduler leaves them. The ratio c-call / batch-1 call shows what an empty
slot costs (c = 1) and what batching saves (c > 1: below c means the weights were read once for
all). Medians of --calls calls, best of --repeats rounds, sizes and graphs interleaved.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "runtime"))

from specexport.bench import harness  # noqa: E402


def parser():
    ap = harness.script_parser(__doc__)
    ap.add_argument("artifact", type=Path, help="an artifact built with --max-batch > 1")
    ap.add_argument("--role", choices=("target", "draft"), default="target", help="which graph pair (default target)")
    ap.add_argument("--sizes", default="1,2,5,9", help="rows per sequence S (default %(default)s)")
    ap.add_argument("--running", default="1,2,4,8", help="sequences per call c (default %(default)s)")
    ap.add_argument("--past", type=int, default=300, help="cache length of every timed sequence (default 300)")
    ap.add_argument("--calls", type=int, default=9, help="timed calls per cell and round (default 9)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds; the best median is kept (default 3)")
    ap.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads (default 2)")
    ap.add_argument("--json", default=None, metavar="OUT", help="write the machine, command and cells as JSON here")
    return ap


def main(argv=None) -> int:
    from specexport_runtime.engine import OrtModel, SessionConfig
    from specexport_runtime.manifest import read_manifest
    from specexport_runtime.slots import SlotCall, SlotModel, idle_rows

    args = parser().parse_args(argv)
    meta = harness.run_metadata(None if argv is None else [__file__, *argv], **vars(args))
    sizes = sorted(set(harness.int_list(args.sizes, "--sizes")))
    running = sorted(set(harness.int_list(args.running, "--running")))
    manifest = read_manifest(args.artifact)
    entry = getattr(manifest, args.role)
    if entry is None or entry.max_batch < 2:
        raise harness.HarnessError(f"{args.artifact}'s {args.role} has no batch graph (build with --max-batch > 1)")
    config = SessionConfig(threads=args.threads, shared_pool=True)
    rows = max(sizes)
    solo = OrtModel(
        args.artifact / entry.graph, entry.graph_spec(), manifest.max_context, config, max_rows=rows,
        min_rows=entry.min_rows, cache_pad=entry.cache_pad,
    )  # fmt: skip
    slots = SlotModel(
        args.artifact / entry.batch_graph, replace(entry.graph_spec(), slots=entry.max_batch), manifest.max_context,
        config, max_rows=rows, cache_pad=entry.cache_pad, min_rows=entry.min_rows,
        idle_rows=idle_rows(manifest.contract_version),
    )  # fmt: skip
    running = [c for c in running if c <= slots.slots]
    prompt = [int(t) for t in np.random.default_rng(0).integers(100, entry.vocab_size, args.past)]
    solo.forward(prompt)
    for b in range(slots.slots):
        slots.forward([SlotCall(b, prompt, 1)])

    def solo_call(s: int) -> None:
        solo.truncate(args.past)
        solo.forward(prompt[:s], last_rows=s)

    def slot_call(c: int, s: int) -> None:
        slots.lengths[:] = 0
        slots.lengths[:c] = args.past
        slots.forward([SlotCall(b, prompt[:s], s) for b in range(c)])

    cells = [("batch-1", 1, s, lambda s=s: solo_call(s)) for s in sizes]
    cells += [("batch", c, s, lambda c=c, s=s: slot_call(c, s)) for s in sizes for c in running]
    best: dict[tuple[str, int, int], float] = {}
    for rep in range(args.repeats):
        for graph, c, s, fn in harness.rotated(cells, rep):
            t = harness.median_seconds(fn, args.calls)
            best[(graph, c, s)] = min(t, best.get((graph, c, s), t))
    out = []
    for s in sizes:
        one = best[("batch-1", 1, s)]
        for c in running:
            t = best[("batch", c, s)]
            out.append({"rows": s, "running": c, "batch1_ms": round(one * 1e3, 2), "batch_ms": round(t * 1e3, 2),
                        "vs_batch1": round(t / one, 3), "vs_c_batch1_calls": round(t / (c * one), 3)})  # fmt: skip
    print(harness.header(meta))
    print(f"{args.role}: {slots.slots}-slot graph, past {args.past}, {args.threads} threads, best of {args.repeats}")
    print(f"{'S':>3} {'c':>3} {'batch-1 ms':>11} {'batch ms':>9} {'x batch-1':>10} {'x c calls':>10}")
    for r in out:
        print(
            f"{r['rows']:>3} {r['running']:>3} {r['batch1_ms']:>11.2f} {r['batch_ms']:>9.2f}"
            f" {r['vs_batch1']:>10.2f} {r['vs_c_batch1_calls']:>10.2f}"
        )
    if args.json:
        harness.write_json(args.json, {"meta": meta, "cells": out})
    return 0


if __name__ == "__main__":
    raise SystemExit(harness.cli(main))
