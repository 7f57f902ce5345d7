"""What attention costs per sequence: one GroupQueryAttention node per sequence against one node
over all of them.

    python benchmarks/experiments/gqa_nodes_cost.py [--sequences 8] [--layers 30] [--past 300]
        [--heads 9] [--kv-heads 3] [--head-dim 64] [--threads 2] [--calls 30]

The batch graph (docs/batching.md) gives each cache slot its own GroupQueryAttention node per
layer. This builds two graphs of --layers layers of attention alone (no rotary, random inputs,
one new row per sequence at a cache of --past rows, in place in [B, H_kv, T, D] buffers): one
with --sequences one-sequence nodes per layer, one with a single node over all sequences (which
ONNX Runtime accepts for one new row each), and prints the median milliseconds of a call of each.
Equal figures mean the attention's cost is per sequence, not per node.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sequences", type=int, default=8, help="sequences per call (default 8)")
    ap.add_argument("--layers", type=int, default=30, help="attention layers per graph (default 30)")
    ap.add_argument("--past", type=int, default=300, help="cached rows of every sequence (default 300)")
    ap.add_argument("--heads", type=int, default=9, help="query heads (default 9, SmolLM2-135M)")
    ap.add_argument("--kv-heads", type=int, default=3, help="key/value heads (default 3)")
    ap.add_argument("--head-dim", type=int, default=64, help="head width (default 64)")
    ap.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads (default 2)")
    ap.add_argument("--calls", type=int, default=30, help="timed calls per graph (default 30)")
    return ap


def attention_graph(args, per_sequence: bool):
    """(session, nodes per layer, batch per node) of --layers layers of GroupQueryAttention."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    f, H, HKV, D, T = TensorProto.FLOAT, args.heads, args.kv_heads, args.head_dim, args.past + 8
    B, n = (1, args.sequences) if per_sequence else (args.sequences, 1)
    vi = helper.make_tensor_value_info
    inputs = [vi("q", f, [B, 1, H * D]), vi("k", f, [B, 1, HKV * D]), vi("v", f, [B, 1, HKV * D])]
    inputs += [vi("seqlens_k", TensorProto.INT32, [B]), vi("total", TensorProto.INT32, [])]
    nodes, outputs = [], []
    for layer in range(args.layers):
        for s in range(n):
            tag = f"{layer}_{s}"
            inputs += [vi(f"pk{tag}", f, [B, HKV, T, D]), vi(f"pv{tag}", f, [B, HKV, T, D])]
            outputs += [
                vi(f"o{tag}", f, [B, 1, H * D]),
                vi(f"ok{tag}", f, [B, HKV, T, D]),
                vi(f"ov{tag}", f, [B, HKV, T, D]),
            ]
            nodes.append(
                helper.make_node(
                    "GroupQueryAttention",
                    ["q", "k", "v", f"pk{tag}", f"pv{tag}", "seqlens_k", "total"],
                    [f"o{tag}", f"ok{tag}", f"ov{tag}"],
                    domain="com.microsoft",
                    num_heads=H,
                    kv_num_heads=HKV,
                )
            )
    model = helper.make_model(
        helper.make_graph(nodes, "attention", inputs, outputs),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
    )
    model.ir_version = 8
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.log_severity_level = args.threads, 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"]), n, B


def time_graph(args, per_sequence: bool) -> float:
    session, n, B = attention_graph(args, per_sequence)
    rng, io = np.random.default_rng(0), session.io_binding()
    H, HKV, D, T = args.heads, args.kv_heads, args.head_dim, args.past + 8
    for name, width in (("q", H * D), ("k", HKV * D), ("v", HKV * D)):
        io.bind_cpu_input(name, rng.standard_normal((B, 1, width)).astype(np.float32))
    io.bind_cpu_input("seqlens_k", np.full(B, args.past, np.int32))
    io.bind_cpu_input("total", np.array(args.past + 1, np.int32))
    buffers = []  # the caches, bound in place (present = past), kept alive for the session
    for layer in range(args.layers):
        for s in range(n):
            for past, present in (("pk", "ok"), ("pv", "ov")):
                buf = rng.standard_normal((B, HKV, T, D)).astype(np.float32)
                buffers.append(buf)
                io.bind_input(f"{past}{layer}_{s}", "cpu", 0, np.float32, buf.shape, buf.ctypes.data)
                io.bind_output(f"{present}{layer}_{s}", "cpu", 0, np.float32, buf.shape, buf.ctypes.data)
            io.bind_output(f"o{layer}_{s}")
    for _ in range(5):
        session.run_with_iobinding(io)
    seconds = []
    for _ in range(args.calls):
        start = time.perf_counter()
        session.run_with_iobinding(io)
        seconds.append(time.perf_counter() - start)
    return 1000 * float(np.median(seconds))


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if min(args.sequences, args.layers, args.past, args.heads, args.kv_heads, args.head_dim, args.calls) < 1:
        parser().error("every count must be >= 1")
    apart, together = time_graph(args, True), time_graph(args, False)
    print(f"{args.sequences} one-sequence nodes per layer: {apart:.2f} ms a call ({args.layers} layers)")
    print(f"one node over {args.sequences} sequences per layer: {together:.2f} ms a call ({together / apart:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
