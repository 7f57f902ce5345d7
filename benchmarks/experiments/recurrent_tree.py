"""Can a token tree be verified over recurrent layers? Each tree node's state comes from its
parent's, so the step recurrence has to read a parent's state instead of the previous row's:
measured on ONNX Runtime's CPU provider at Qwen3.5-0.8B's Gated DeltaNet shape (16 value heads,
128 x 128 state per head, 18 layers), against the chain's step recurrence (a Scan emitting the
state after every row, what the decoder graph runs, scan.step_or_chunk).

    python benchmarks/experiments/recurrent_tree.py [--layers 18] [--rows 5 9 17] [--repeats 20]

Tree form: a Loop over the S nodes whose carried value is the stack of node states
[S + 1, H, Dk, Dv] (entry 0 the call's input state, node r's state at r + 1); node r gathers its
parent's entry, runs the same step as the chain, and scatters its state into entry r + 1 (ONNX
has no in-place update of a carried tensor: each step writes a new stack). The parents are a
random tree (each node's parent drawn from the nodes before it). Prints median ms per call of
both forms and their ratio; the chain's rows are the tree's when every parent is the row before
(checked: max |diff|).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "runtime"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from recurrent_rollback import DK, DV, H, _step_body  # noqa: E402
from recurrent_rollback import build as build_chain  # noqa: E402

from specexport.bench import harness  # noqa: E402


def _tree_body():
    """Loop body: (i, cond, stack [S + 1, H, Dk, Dv]) -> (cond, stack with node i's state at i + 1, o_i [H, Dv])."""
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    step = _step_body(False)
    nodes = [
        helper.make_node("Constant", [], ["b_one"], value=helper.make_tensor("b_one", i64, [], [1])),
        helper.make_node("Constant", [], ["b_ax0"], value=helper.make_tensor("b_ax0", i64, [1], [0])),
        helper.make_node("Gather", ["parents", "i"], ["p"], axis=0),  # [] the parent's stack entry
        helper.make_node("Gather", ["stack", "p"], ["s_in"], axis=0),  # [H, Dk, Dv]
        *[helper.make_node("Gather", [x, "i"], [f"{x}_i"], axis=0) for x in ("q", "k", "v", "g", "beta")],
        helper.make_node(
            "Scan", ["s_in", "q_1", "k_1", "v_1", "g_1", "beta_1"], ["s_out", "o_1"], body=step, num_scan_inputs=5
        ),
        *[helper.make_node("Unsqueeze", [f"{x}_i", "b_ax0"], [f"{x}_1"]) for x in ("q", "k", "v", "g", "beta")],
        helper.make_node("Add", ["i", "b_one"], ["at"]),
        helper.make_node("Reshape", ["at", "b_shape"], ["at1"]),
        helper.make_node("Unsqueeze", ["s_out", "b_ax0"], ["s_out1"]),
        helper.make_node("ScatterND", ["stack", "at1", "s_out1"], ["stack_out"]),
        helper.make_node("Squeeze", ["o_1", "b_ax0"], ["o"]),
        helper.make_node("Identity", ["cond"], ["cond_out"]),
    ]
    nodes.insert(0, helper.make_node("Constant", [], ["b_shape"], value=helper.make_tensor("s", i64, [2], [1, 1])))
    # the Unsqueeze nodes feed the Scan: order them before it
    scan = next(n for n in nodes if n.op_type == "Scan")
    nodes.remove(scan)
    nodes.insert(nodes.index(next(n for n in nodes if n.op_type == "Add")), scan)
    inputs = [
        helper.make_tensor_value_info("i", i64, []),
        helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
        helper.make_tensor_value_info("stack", f, None),
    ]
    outputs = [
        helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
        helper.make_tensor_value_info("stack_out", f, None),
        helper.make_tensor_value_info("o", f, None),
    ]
    return helper.make_graph(nodes, "node", inputs, outputs)


def build_tree(layers: int) -> bytes:
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    inputs = [helper.make_tensor_value_info(n, f, None) for n in ("q", "k", "v", "g", "beta")]
    inputs.append(helper.make_tensor_value_info("parents", i64, ["S"]))
    nodes = [
        helper.make_node("Shape", ["parents"], ["n1"]),
        helper.make_node("Constant", [], ["ax0"], value=helper.make_tensor("ax0", i64, [1], [0])),
        helper.make_node("Squeeze", ["n1", "ax0"], ["n"]),
        helper.make_node("Constant", [], ["true"], value=helper.make_tensor("t", TensorProto.BOOL, [], [True])),
    ]
    outputs = []
    for i in range(layers):
        inputs.append(helper.make_tensor_value_info(f"state_{i}", f, [H, DK, DV]))
        nodes += [
            helper.make_node("Unsqueeze", [f"state_{i}", "ax0"], [f"root_{i}"]),
            helper.make_node("Shape", [f"root_{i}"], [f"rs_{i}"], start=1),
            helper.make_node("Concat", ["n1", f"rs_{i}"], [f"shape_{i}"], axis=0),
            helper.make_node("ConstantOfShape", [f"shape_{i}"], [f"zeros_{i}"]),
            helper.make_node("Concat", [f"root_{i}", f"zeros_{i}"], [f"stack0_{i}"], axis=0),
            helper.make_node("Loop", ["n", "true", f"stack0_{i}"], [f"stack_{i}", f"out_{i}"], body=_tree_body()),
        ]
        outputs += [
            helper.make_tensor_value_info(f"stack_{i}", f, None),
            helper.make_tensor_value_info(f"out_{i}", f, None),
        ]
    graph = helper.make_graph(nodes, "tree", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def parser():
    ap = harness.script_parser(__doc__)
    ap.add_argument("--layers", type=int, default=18, help="recurrent layers in the call (default 18, Qwen3.5-0.8B)")
    ap.add_argument("--rows", type=int, nargs="+", default=[5, 9, 17], help="tree nodes per call (default 5 9 17)")
    ap.add_argument("--repeats", type=int, default=20, help="timed calls per form, after 3 warm-ups (default 20)")
    ap.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads (default 2)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    meta = harness.run_metadata(None if argv is None else [__file__, *argv], **vars(args))
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = args.threads
    chain = ort.InferenceSession(build_chain(args.layers, True), opts, providers=["CPUExecutionProvider"])
    tree = ort.InferenceSession(build_tree(args.layers), opts, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    state = {f"state_{i}": (rng.standard_normal((H, DK, DV)) * 0.1).astype(np.float32) for i in range(args.layers)}
    print(harness.header(meta))
    print(f"{'nodes':>6} {'chain (Scan)':>13} {'tree (Loop)':>12} {'tree / chain':>13} {'path = chain':>13}")
    for S in args.rows:
        rows = {
            "q": rng.standard_normal((S, H, DK)).astype(np.float32),
            "k": (rng.standard_normal((S, H, DK)) / np.sqrt(DK)).astype(np.float32),
            "v": rng.standard_normal((S, H, DV)).astype(np.float32),
            "g": -np.abs(rng.standard_normal((S, H))).astype(np.float32) * 0.1,
            "beta": rng.uniform(0, 1, (S, H)).astype(np.float32),
        }
        parents = np.array([rng.integers(0, r + 1) for r in range(S)], np.int64)  # entry 0 = the input state
        line = np.arange(S, dtype=np.int64)  # every node's parent the node before: the chain
        same = np.max(
            np.abs(
                tree.run(["out_0"], {**rows, **state, "parents": line})[0] - chain.run(["out_0"], {**rows, **state})[0]
            )
        )
        times = {"chain": [], "tree": []}
        for _ in range(3):
            chain.run(None, {**rows, **state})
            tree.run(None, {**rows, **state, "parents": parents})
        for _ in range(args.repeats):  # interleaved
            t = time.perf_counter()
            chain.run(None, {**rows, **state})
            times["chain"].append(time.perf_counter() - t)
            t = time.perf_counter()
            tree.run(None, {**rows, **state, "parents": parents})
            times["tree"].append(time.perf_counter() - t)
        c, tr = (statistics.median(times[k]) * 1e3 for k in ("chain", "tree"))
        print(f"{S:>6} {c:>10.2f} ms {tr:>9.2f} ms {tr / c:>12.2f}x {same:>13.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
