"""Where a target's decode step goes, by ONNX operator type (ONNX Runtime's profiler).

    python benchmarks/experiments/op_profile.py ARTIFACT [--past 200] [--steps 60] [--rows 1] [--threads 2]
        [--top 12] [--nodes 0] [--json OUT]

Opens the artifact's target graph alone with profiling on, feeds a --past-token prefix, then
--steps one-token decode calls (--rows S > 1: S-token verify calls, the cursor moved back after
each, as a rejected draft leaves it), and prints per operator type the kernel milliseconds per step, the
share of all kernel time and the nodes run per step, plus the wall milliseconds per step (the
profiler itself adds a little). The profile JSON is written to a temporary folder and removed;
--json keeps the machine, the command and the table.
"""

from __future__ import annotations

import collections
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "runtime"))

from specexport.bench import harness  # noqa: E402


def parser():
    ap = harness.script_parser(__doc__)
    ap.add_argument("artifact", type=Path, help="artifact folder (specexport build); its target graph is profiled")
    ap.add_argument("--past", type=int, default=200, help="tokens in the cache before the timed steps (default 200)")
    ap.add_argument("--steps", type=int, default=60, help="calls profiled (default 60)")
    ap.add_argument("--threads", type=int, default=None, help="ONNX Runtime intra-op threads (default: all cores)")
    ap.add_argument("--rows", type=int, default=1, help="tokens per call (1: decode steps; S > 1: verify calls)")
    ap.add_argument("--top", type=int, default=12, help="operator types listed (default 12)")
    ap.add_argument("--nodes", type=int, default=0, help="also list the N costliest nodes by name (default 0)")
    ap.add_argument("--json", default=None, metavar="OUT", help="write the machine, command and table as JSON here")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if min(args.steps, args.rows) < 1 or args.past < 1:
        raise harness.HarnessError("--past, --steps and --rows must be at least 1")
    from specexport_runtime.api import open_artifact
    from specexport_runtime.engine import OrtModel, SessionConfig
    from specexport_runtime.paths import check_graph

    meta = harness.run_metadata(None if argv is None else [__file__, *argv], **vars(args))
    manifest, _, _ = open_artifact(args.artifact, False)
    entry = manifest.target
    with tempfile.TemporaryDirectory(prefix="op-profile-") as folder:
        config = SessionConfig(threads=args.threads, profile_prefix=str(Path(folder) / "target"))
        model = OrtModel(
            check_graph(args.artifact, entry.graph, "target graph"),
            entry.graph_spec(),
            manifest.max_context,
            config,
            min_rows=entry.min_rows,
            cache_pad=entry.cache_pad,
        )
        vocab = entry.vocab_size  # token ids: any in range (costs do not depend on the text)
        model.forward([(100 + i % 1000) % vocab for i in range(args.past)])
        start = time.perf_counter()
        for i in range(args.steps):
            if args.rows == 1:
                model.forward([(500 + i) % vocab])
            else:
                model.forward([(500 + i + j) % vocab for j in range(args.rows)], last_rows=args.rows)
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
    ops = [
        {"op": op, "ms_per_call": us / calls / 1e3, "share": us / total, "nodes_per_call": count[op] / calls}
        for op, us in spent.most_common(args.top)
    ]
    nodes = [{"node": name, "ms_per_call": us / calls / 1e3} for name, us in by_node.most_common(args.nodes)]
    print(harness.header(meta))
    print(
        f"{args.artifact.name}: {wall * 1e3:.2f} ms per {what} (wall, profiling on), "
        f"{sum(count.values()) / calls:.0f} nodes per call"
    )
    for r in ops:
        print(f"  {r['op']:34s} {r['ms_per_call']:7.3f} ms  {100 * r['share']:5.1f}%  {r['nodes_per_call']:5.0f} nodes")
    for r in nodes:
        print(f"    node {r['node']:40s} {r['ms_per_call']:7.3f} ms")
    if args.json:
        harness.write_json(args.json, {"meta": meta, "wall_ms_per_call": wall * 1e3, "ops": ops, "nodes": nodes})
    return 0


if __name__ == "__main__":
    raise SystemExit(harness.cli(main))
