"""What ONNX Runtime's GroupQueryAttention does with several sequences in one call.

    python benchmarks/experiments/gqa_batch.py [--pasts 5,17,9] [--rows 1,4]
        [--query-seqlens 4,1,0] [--json OUT]

The fused graph's attention is one com.microsoft GroupQueryAttention node per layer over an
in-place cache buffer [B, H_kv, T_max, D] (docs/graph-contract.md). Batched speculation needs B
sequences per call, each with its own past length (seqlens_k [B]) and 1 + gamma new rows. For
each --rows S this runs one node on B = len(--pasts) sequences and, beside it, B calls of one
sequence each on the same inputs, and reports whether ONNX Runtime accepts the batched call and
the largest difference between a sequence's batched output and its own call's (0.0: the batch
does not change a sequence's rows, so the bitwise exactness class carries over).

With --query-seqlens Q_1,..,Q_B (one per past; 0 = an idle sequence) it also runs one call of
right-padded chunks, sequence b with Q_b valid rows, through the node's `query_seqlens` input
(ONNX Runtime 1.32 and later), compares each sequence's valid rows with its own unpadded call of
Q_b rows and checks that an idle sequence's cache is unchanged. Random inputs; nothing is timed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "runtime"))

from specexport.bench import harness  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, T_MAX = 4, 2, 16, 64


def session(batch: int, rows: int, query_seqlens: bool = False):
    """One GroupQueryAttention node (no rotary): q [B, S, H*D], k/v [B, S, H_kv*D], past/present
    [B, H_kv, T_MAX, D], seqlens_k [B] (past + S - 1), total_sequence_length []; query_seqlens:
    also the node's query_seqlens [B] (its 17th input)."""
    import onnxruntime as ort
    from onnx import TensorProto

    f = TensorProto.FLOAT
    io = [
        ("q", f, [batch, rows, HEADS * HEAD_DIM]),
        ("k", f, [batch, rows, KV_HEADS * HEAD_DIM]),
        ("v", f, [batch, rows, KV_HEADS * HEAD_DIM]),
        ("pk", f, [batch, KV_HEADS, T_MAX, HEAD_DIM]),
        ("pv", f, [batch, KV_HEADS, T_MAX, HEAD_DIM]),
        ("seqlens_k", TensorProto.INT32, [batch]),
        ("total", TensorProto.INT32, []),
    ]
    if query_seqlens:  # optional inputs 7 .. 15 left out
        io += [("", f, [])] * 9 + [("query_seqlens", TensorProto.INT32, [batch])]
    outputs = [("out", f, [batch, rows, HEADS * HEAD_DIM]), ("ok", f, io[3][2]), ("ov", f, io[4][2])]
    options = ort.SessionOptions()
    options.log_severity_level = 4  # a refused call is reported in the row, not logged
    return gqa_session(io, outputs, options, num_heads=HEADS, kv_num_heads=KV_HEADS)


def gqa_session(io: list, outputs: list, options, **attrs):
    """An ONNX Runtime CPU session of one com.microsoft GroupQueryAttention node: io and outputs
    are (name, element type, shape) in the node's order (name "" for an optional input left
    out), attrs its attributes."""
    import onnxruntime as ort
    from onnx import helper

    node = helper.make_node(
        "GroupQueryAttention",
        [name for name, _, _ in io],
        [name for name, _, _ in outputs],
        domain="com.microsoft",
        **attrs,
    )
    graph = helper.make_graph(
        [node],
        "gqa",
        [helper.make_tensor_value_info(*spec) for spec in io if spec[0]],
        [helper.make_tensor_value_info(*spec) for spec in outputs],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 8
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def attend(sess, inputs: dict[str, np.ndarray], pasts: np.ndarray, valid: np.ndarray | None = None) -> np.ndarray:
    """One call with the cache bound in place (present = past buffer); returns out [B, S, H*D].
    valid: query_seqlens [B] (rows of each chunk that are real), or None (all S rows)."""
    import onnxruntime as ort

    rows = inputs["q"].shape[1]
    binding = sess.io_binding()
    for name in ("q", "k", "v"):
        binding.bind_cpu_input(name, np.ascontiguousarray(inputs[name]))
    if valid is None:
        binding.bind_cpu_input("seqlens_k", (pasts + rows - 1).astype(np.int32))
        binding.bind_cpu_input("total", np.array(pasts.max() + rows, np.int32))
    else:  # T_b = past_b + Q_b rows after the call; total only bounds them
        binding.bind_cpu_input("seqlens_k", (pasts + valid - 1).astype(np.int32))
        binding.bind_cpu_input("total", np.array(T_MAX, np.int32))
        binding.bind_cpu_input("query_seqlens", valid.astype(np.int32))
    for past, present in (("pk", "ok"), ("pv", "ov")):
        buffer = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(inputs[past]))
        binding.bind_ortvalue_input(past, buffer)
        binding.bind_ortvalue_output(present, buffer)
    binding.bind_output("out")
    sess.run_with_iobinding(binding)
    return binding.copy_outputs_to_cpu()[0]


def measure(pasts: np.ndarray, rows: int, rng: np.random.Generator) -> dict:
    batch = len(pasts)
    widths = {"q": HEADS * HEAD_DIM, "k": KV_HEADS * HEAD_DIM, "v": KV_HEADS * HEAD_DIM}
    inputs = {name: rng.standard_normal((batch, rows, w)).astype(np.float32) for name, w in widths.items()}
    for name in ("pk", "pv"):
        inputs[name] = rng.standard_normal((batch, KV_HEADS, T_MAX, HEAD_DIM)).astype(np.float32)
    row = {"batch": batch, "rows": rows, "pasts": pasts.tolist()}
    try:
        batched = attend(session(batch, rows), inputs, pasts)
    except RuntimeError as exc:  # ONNX Runtime refusing the call is the finding
        return {**row, "accepted": False, "error": " ".join(str(exc).split())[-200:]}
    one = session(1, rows)
    solo = [attend(one, {n: a[b : b + 1] for n, a in inputs.items()}, pasts[b : b + 1])[0] for b in range(batch)]
    diffs = [float(np.abs(batched[b] - solo[b]).max()) for b in range(batch)]
    return {**row, "accepted": True, "max_abs_diff_per_sequence": diffs}


def measure_padded(pasts: np.ndarray, valid: np.ndarray, rng: np.random.Generator) -> dict:
    """One call of right-padded chunks (query_seqlens = valid) against each sequence's own call."""
    batch, rows = len(pasts), max(1, int(valid.max()))
    widths = {"q": HEADS * HEAD_DIM, "k": KV_HEADS * HEAD_DIM, "v": KV_HEADS * HEAD_DIM}
    inputs = {name: rng.standard_normal((batch, rows, w)).astype(np.float32) for name, w in widths.items()}
    for name in ("pk", "pv"):
        inputs[name] = rng.standard_normal((batch, KV_HEADS, T_MAX, HEAD_DIM)).astype(np.float32)
    row = {"batch": batch, "query_seqlens": valid.tolist(), "pasts": pasts.tolist()}
    caches = {name: inputs[name].copy() for name in ("pk", "pv")}  # attend() binds copies: keep the originals
    try:
        batched = attend(session(batch, rows, query_seqlens=True), {**inputs, **caches}, pasts, valid)
    except RuntimeError as exc:
        return {**row, "accepted": False, "error": " ".join(str(exc).split())[-200:]}
    diffs: list[float | None] = []
    for b in range(batch):
        q = int(valid[b])
        if q == 0:
            diffs.append(None)
            continue
        own = {n: (a[b : b + 1, :q] if n in widths else a[b : b + 1]) for n, a in inputs.items()}
        solo = attend(session(1, q), own, pasts[b : b + 1])[0]  # [q, H*D]
        diffs.append(float(np.abs(batched[b, :q] - solo).max()))
    return {**row, "accepted": True, "max_abs_diff_per_sequence": diffs}


def parser():
    ap = harness.script_parser(__doc__)
    ap.add_argument("--pasts", default="5,17,9", help="past length of each sequence (default 5,17,9: B = 3)")
    ap.add_argument("--rows", default="1,4", help="new rows per sequence to try (default 1,4)")
    ap.add_argument(
        "--query-seqlens",
        default=None,
        help="valid rows of each sequence in one right-padded call (query_seqlens; 0 = idle), one per past",
    )
    ap.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    ap.add_argument("--json", default=None, metavar="OUT", help="write the machine, command and rows as JSON here")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    pasts = np.array(harness.int_list(args.pasts, "--pasts", 0))
    row_counts = harness.int_list(args.rows, "--rows")
    if int(pasts.max()) + max(row_counts) > T_MAX:
        raise harness.HarnessError(
            f"--pasts + --rows must fit the {T_MAX}-row cache, got {pasts.max()} + {max(row_counts)}"
        )
    meta = harness.run_metadata(None if argv is None else [__file__, *argv], **vars(args))
    rng = np.random.default_rng(args.seed)
    results = [measure(pasts, rows, rng) for rows in row_counts]
    if args.query_seqlens is not None:
        valid = np.array(harness.int_list(args.query_seqlens, "--query-seqlens", 0))
        if len(valid) != len(pasts) or int((pasts + valid).max()) > T_MAX or np.any((pasts == 0) & (valid == 0)):
            raise harness.HarnessError(
                f"--query-seqlens needs one count per past, fitting the {T_MAX}-row cache, and an idle"
                f" sequence (0) needs a past > 0; got {args.query_seqlens!r} for pasts {pasts.tolist()}"
            )
        results.append(measure_padded(pasts, valid, rng))
    print(harness.header(meta))
    for result in results:
        print(json.dumps(result))
    if args.json:
        harness.write_json(args.json, {"meta": meta, "rows": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(harness.cli(main))
