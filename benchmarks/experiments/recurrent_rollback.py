"""How a verify call of S rows should leave a Gated DeltaNet layer's state so that any accepted
prefix k <= S can be kept in O(1): measured on ONNX Runtime's CPU provider with the recurrence
written in ONNX standard ops (a Scan over the call's rows), at Qwen3.5-0.8B's linear-attention
shape (16 value heads, 128 x 128 state per head, 18 such layers).

    python benchmarks/experiments/recurrent_rollback.py [--layers 18] [--rows 5 9] [--repeats 30]

Alternatives, per verify call of S rows (all layers):
  per-position  the Scan emits the state after every row ([S, H, Dk, Dv] per layer); rollback
                picks row k's (no extra work, S states written)
  final+replay  the Scan emits only the state after row S-1 and the call's input state is kept
                (double buffer); a rejection (k < S) replays the recurrence over the first k
                rows' (q, k, v, g, beta), which the call also returns, in one small call
Recurrence per row (transformers' torch_recurrent_gated_delta_rule): S <- S * exp(g);
delta = (v - S^T k) * beta; S <- S + k delta^T; out = S^T q. Prints median ms per call.
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

from specexport.bench import harness  # noqa: E402

H, DK, DV = 16, 128, 128


def _step_body(emit_state: bool):
    """Scan body: state [H, DK, DV]; per row q, k [H, DK], v [H, DV], g, beta [H]."""
    f = TensorProto.FLOAT
    inputs = [
        helper.make_tensor_value_info("s_in", f, [H, DK, DV]),
        helper.make_tensor_value_info("q", f, [H, DK]),
        helper.make_tensor_value_info("k", f, [H, DK]),
        helper.make_tensor_value_info("v", f, [H, DV]),
        helper.make_tensor_value_info("g", f, [H]),
        helper.make_tensor_value_info("beta", f, [H]),
    ]

    def ax(name: str, v: list[int]):
        return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, [len(v)], v))

    nodes = [
        ax("a12", [1, 2]),
        ax("a1", [1]),
        ax("a2", [2]),
        helper.make_node("Exp", ["g"], ["eg"]),
        helper.make_node("Unsqueeze", ["eg", "a12"], ["eg3"]),  # [H, 1, 1]
        helper.make_node("Mul", ["s_in", "eg3"], ["s_dec"]),
        helper.make_node("Unsqueeze", ["k", "a1"], ["k_row"]),  # [H, 1, DK]
        helper.make_node("MatMul", ["k_row", "s_dec"], ["kv"]),  # [H, 1, DV] = k^T S
        helper.make_node("Unsqueeze", ["v", "a1"], ["v_row"]),
        helper.make_node("Sub", ["v_row", "kv"], ["err"]),
        helper.make_node("Unsqueeze", ["beta", "a12"], ["b3"]),
        helper.make_node("Mul", ["err", "b3"], ["delta"]),  # [H, 1, DV]
        helper.make_node("Unsqueeze", ["k", "a2"], ["k_col"]),  # [H, DK, 1]
        helper.make_node("MatMul", ["k_col", "delta"], ["upd"]),  # [H, DK, DV]
        helper.make_node("Add", ["s_dec", "upd"], ["s_out"]),
        helper.make_node("Unsqueeze", ["q", "a1"], ["q_row"]),
        helper.make_node("MatMul", ["q_row", "s_out"], ["o3"]),  # [H, 1, DV]
        helper.make_node("Squeeze", ["o3", "a1"], ["o"]),
    ]
    outputs = [helper.make_tensor_value_info("s_out", f, [H, DK, DV]), helper.make_tensor_value_info("o", f, [H, DV])]
    if emit_state:
        nodes.append(helper.make_node("Identity", ["s_out"], ["s_each"]))
        outputs.append(helper.make_tensor_value_info("s_each", f, [H, DK, DV]))
    return helper.make_graph(nodes, "step", inputs, outputs)


def build(layers: int, emit_state: bool) -> bytes:
    """One graph: `layers` independent recurrences over the same S rows (a layer's weights do
    not matter to this cost), each with its own state input and outputs."""
    f = TensorProto.FLOAT
    nodes, inputs, outputs = [], [], []
    for name, shape in (
        ("q", ["S", H, DK]),
        ("k", ["S", H, DK]),
        ("v", ["S", H, DV]),
        ("g", ["S", H]),
        ("beta", ["S", H]),
    ):
        inputs.append(helper.make_tensor_value_info(name, f, shape))
    n_scan = 5
    for i in range(layers):
        inputs.append(helper.make_tensor_value_info(f"state_{i}", f, [H, DK, DV]))
        outs = [f"final_{i}", f"out_{i}"] + ([f"states_{i}"] if emit_state else [])
        nodes.append(
            helper.make_node(
                "Scan",
                [f"state_{i}", "q", "k", "v", "g", "beta"],
                outs,
                body=_step_body(emit_state),
                num_scan_inputs=n_scan,
            )
        )
        outputs.append(helper.make_tensor_value_info(f"final_{i}", f, [H, DK, DV]))
        outputs.append(helper.make_tensor_value_info(f"out_{i}", f, ["S", H, DV]))
        if emit_state:
            outputs.append(helper.make_tensor_value_info(f"states_{i}", f, ["S", H, DK, DV]))
    graph = helper.make_graph(nodes, "gdn", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def parser():
    ap = harness.script_parser(__doc__)
    ap.add_argument("--layers", type=int, default=18, help="recurrent layers in the call (default 18, Qwen3.5-0.8B)")
    ap.add_argument("--rows", type=int, nargs="+", default=[5, 9], help="rows per verify call to measure (default 5 9)")
    ap.add_argument("--repeats", type=int, default=30, help="timed calls per variant, after 3 warm-ups (default 30)")
    ap.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads (default 2)")
    ap.add_argument("--json", default=None, metavar="OUT", help="write the machine, command and rows as JSON here")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    meta = harness.run_metadata(None if argv is None else [__file__, *argv], **vars(args))
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = args.threads
    each = ort.InferenceSession(build(args.layers, True), opts, providers=["CPUExecutionProvider"])
    final = ort.InferenceSession(build(args.layers, False), opts, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    state = {f"state_{i}": (rng.standard_normal((H, DK, DV)) * 0.1).astype(np.float32) for i in range(args.layers)}

    def feeds(S):
        f = {
            "q": rng.standard_normal((S, H, DK)).astype(np.float32),
            "k": (rng.standard_normal((S, H, DK)) / np.sqrt(DK)).astype(np.float32),
            "v": rng.standard_normal((S, H, DV)).astype(np.float32),
            "g": -np.abs(rng.standard_normal((S, H))).astype(np.float32),
            "beta": rng.uniform(0, 1, (S, H)).astype(np.float32),
        }
        f.update(state)
        return f

    rows = []
    print(harness.header(meta))
    print(f"{'rows':>5} {'per-position':>14} {'final only':>12} {'replay k=S/2':>14} {'max |diff|':>11}")
    for S in args.rows:
        t = {"each": [], "final": [], "replay": []}
        diff = 0.0
        for rep in range(args.repeats + 3):
            f = feeds(S)
            half = {n: (v[: S // 2] if n in ("q", "k", "v", "g", "beta") else v) for n, v in f.items()}
            order = [("each", each, f), ("final", final, f), ("replay", final, half)]
            for name, sess, fd in order if rep % 2 else order[::-1]:
                start = time.perf_counter()
                out = sess.run(None, fd)
                if rep >= 3:
                    t[name].append(time.perf_counter() - start)
                if name == "each":
                    kept = out[2][S // 2 - 1]  # layer 0's state after row S/2 - 1
                if name == "replay":
                    replayed = out[0]
            diff = max(diff, float(np.abs(kept - replayed).max()))
        med = {k: statistics.median(v) * 1e3 for k, v in t.items()}
        print(f"{S:>5} {med['each']:>11.2f} ms {med['final']:>9.2f} ms {med['replay']:>11.2f} ms {diff:>11.2e}")
        rows.append({"rows": S, **{f"{k}_ms": v for k, v in med.items()}, "max_abs_diff": diff})
    if args.json:
        harness.write_json(args.json, {"meta": meta, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(harness.cli(main))
