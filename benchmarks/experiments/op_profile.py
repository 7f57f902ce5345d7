"""Where a target's decode step goes, by ONNX operator type (ONNX Runtime's profiler).

    python benchmarks/op_profile.py ARTIFACT [--past 200] [--steps 60] [--rows 1] [--threads 2] [--top 12]
        [--nodes 0]

Opens the artifact's target graph alone with profiling on, feeds a --past-token prefix, then
--steps one-token decode calls (--rows S > 1: S-token verify calls, the cursor moved back after
each, as a rejected draft leaves it), and prints per operator type the kernel milliseconds per step, the
share of all kernel time and the nodes run per step, plus the wall milliseconds per step (the
profiler itself adds a little). The profile JSON is written to a temporary folder and removed.
"""

from __future__ import annotations

import argparse
import collections
import json
import tempfile
import time
from pathlib import Path

from specexport_runtime.api import check_graph, open_artifact
from specexport_runtime.engine import OrtModel, SessionConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--past", type=int, default=200, help="tokens in the cache before the timed steps")
    ap.add_argument("--steps", type=int, default=60, help="one-token decode calls profiled")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rows", type=int, default=1, help="tokens per call (1: decode steps; S > 1: verify calls)")
    ap.add_argument("--top", type=int, default=12, help="operator types listed")
    ap.add_argument("--nodes", type=int, default=0, help="also list the N costliest nodes by name")
    args = ap.parse_args()
    manifest, _, _ = open_artifact(args.artifact, False)
    entry = manifest.target
    with tempfile.TemporaryDirectory(prefix="op-profile-") as folder:
        config = SessionConfig(threads=args.threads, profile_prefix=str(Path(folder) / "target"))
        model = OrtModel(check_graph(args.artifact, entry.graph, "target graph"), entry.graph_spec(), manifest.max_context,
                         config, min_rows=entry.min_rows, cache_pad=entry.cache_pad)
        model.forward([100 + i % 1000 for i in range(args.past)])
        start = time.perf_counter()
        for i in range(args.steps):
            if args.rows == 1:
                model.forward([500 + i])
            else:
                model.forward([500 + i + j for j in range(args.rows)], last_rows=args.rows)
                model.truncate(args.past)
        wall = (time.perf_counter() - start) / args.steps
        events = json.loads(Path(model.session.end_profiling()).read_text())
    runs = sorted(e["ts"] for e in events if e.get("cat") == "Session" and e["name"] == "model_run")
    decode_start = runs[1]  # runs[0] is the prefill: left out
    calls = args.steps
    spent, count, by_node = collections.Counter(), collections.Counter(), collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= decode_start:
            spent[e["args"]["op_name"]] += e["dur"]
            count[e["args"]["op_name"]] += 1
            by_node[e["name"].removesuffix("_kernel_time")] += e["dur"]
    total = sum(spent.values())
    what = "decode step" if args.rows == 1 else f"{args.rows}-row call"
    print(f"{args.artifact.name}: {wall * 1e3:.2f} ms per {what} (wall, profiling on), "
          f"{sum(count.values()) / calls:.0f} nodes per call")
    for op, us in spent.most_common(args.top):
        print(f"  {op:34s} {us / calls / 1e3:7.3f} ms  {100 * us / total:5.1f}%  {count[op] / calls:5.0f} nodes")
    for name, us in by_node.most_common(args.nodes):
        print(f"    node {name:40s} {us / calls / 1e3:7.3f} ms")


if __name__ == "__main__":
    main()
