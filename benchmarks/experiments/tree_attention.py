"""Whether ONNX Runtime's GroupQueryAttention verifies a draft tree exactly, and what it costs.

    python benchmarks/experiments/tree_attention.py [--past 200] [--sizes 2,9,17] [--json OUT]

Tree verification runs R rows in one call: row i at position past + depth(i), attending to the
committed prefix and to its own ancestors only (runtime/specexport_runtime/tree.py). In the
fused graph that is GroupQueryAttention with `position_ids` and an additive `attention_bias`
[1, 1, R, past + R], its K/V written in place at rows past .. past + R - 1. This runs one node
(the default model's heads: 9 query, 3 KV, head size 64, rotary) on a fixed tree and compares,
for each root-to-leaf path, the tree call's output rows and written K rows with a chain call of
that path alone, both without the tree inputs (as the fused graph calls it today) and with them
(a causal bias): max |diff| 0.0 means a tree call is bitwise that chain call on the accepted
path, so the accepted rows can be moved into place without recomputation. It then times a
chain of S rows without the tree inputs and with them (a causal bias): the cost of carrying them
on every call.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "runtime"))

from specexport.bench import harness  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gqa_batch import gqa_session  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, T_MAX = 9, 3, 64, 1024
TREE_PARENTS = [-1, 0, 0, 1, 1, 2, 3, 6, 0]  # root, 3 children, grandchildren, one path of depth 4


def session(tree_inputs: bool, threads: int):
    """One GroupQueryAttention node with rotary: q [1, S, H*D], k/v [1, S, H_kv*D], in-place
    cache [1, H_kv, T_MAX, D]; with tree_inputs also position_ids [1, S] and attention_bias
    [1, 1, S, total]."""
    import onnxruntime as ort
    from onnx import TensorProto

    f, i32, i64 = TensorProto.FLOAT, TensorProto.INT32, TensorProto.INT64
    cache = [1, KV_HEADS, T_MAX, HEAD_DIM]
    io = [
        ("q", f, [1, "S", HEADS * HEAD_DIM]),
        ("k", f, [1, "S", KV_HEADS * HEAD_DIM]),
        ("v", f, [1, "S", KV_HEADS * HEAD_DIM]),
        ("pk", f, cache),
        ("pv", f, cache),
        ("seqlens_k", i32, [1]),
        ("total", i32, []),
        ("cos", f, [T_MAX, HEAD_DIM // 2]),
        ("sin", f, [T_MAX, HEAD_DIM // 2]),
    ]
    if tree_inputs:
        io += [("position_ids", i64, [1, "S"]), ("attention_bias", f, [1, 1, "S", "T"])]
    outputs = [("out", f, [1, "S", HEADS * HEAD_DIM]), ("ok", f, cache), ("ov", f, cache)]
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return gqa_session(io, outputs, options, num_heads=HEADS, kv_num_heads=KV_HEADS, do_rotary=1)


class Node:
    """A session with its rotary tables; call() binds the caches in place (present = past)."""

    def __init__(self, tree_inputs: bool, threads: int):
        self.sess = session(tree_inputs, threads)
        inv = 1.0 / 10000 ** (np.arange(HEAD_DIM // 2) / (HEAD_DIM // 2))
        angles = np.outer(np.arange(T_MAX), inv)
        self.cos, self.sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)

    def call(self, qkv, caches, past: int, positions=None, bias=None) -> np.ndarray:
        q, k, v = qkv
        rows = q.shape[1]
        io = self.sess.io_binding()
        io.bind_output("out", "cpu")
        feeds = {"q": q, "k": k, "v": v, "cos": self.cos, "sin": self.sin}
        feeds["seqlens_k"] = np.array([past + rows - 1], np.int32)
        feeds["total"] = np.array(past + rows, np.int32)
        if positions is not None:
            feeds["position_ids"], feeds["attention_bias"] = positions, bias
        for name, value in feeds.items():
            io.bind_cpu_input(name, np.ascontiguousarray(value))
        shape = [1, KV_HEADS, T_MAX, HEAD_DIM]
        for (past_name, present), buf in zip((("pk", "ok"), ("pv", "ov")), caches):
            io.bind_input(past_name, "cpu", 0, np.float32, shape, buf.ctypes.data)
            io.bind_output(present, "cpu", 0, np.float32, shape, buf.ctypes.data)
        self.sess.run_with_iobinding(io)
        return io.copy_outputs_to_cpu()[0]


def tree_inputs(tree, past: int) -> tuple[np.ndarray, np.ndarray]:
    """position_ids [1, R] = past + depth and attention_bias [1, 1, R, past + R]."""
    R = len(tree)
    bias = np.zeros((1, 1, R, past + R), np.float32)
    bias[0, 0, :, past:] = tree.attention_bias(np.float32)
    return (past + tree.depths())[None].astype(np.int64), bias


def compare(past: int, threads: int, rng: np.random.Generator) -> list[dict]:
    from specexport_runtime.tree import DraftTree

    tree = DraftTree(np.arange(len(TREE_PARENTS)), np.array(TREE_PARENTS))
    R = len(tree)
    widths = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM)
    qkv = [rng.standard_normal((1, R, w)).astype(np.float32) for w in widths]
    cache0 = [rng.standard_normal((1, KV_HEADS, T_MAX, HEAD_DIM)).astype(np.float32) for _ in range(2)]
    tree_node, chain_node = Node(True, threads), Node(False, threads)
    caches = [c.copy() for c in cache0]
    out = tree_node.call(qkv, caches, past, *tree_inputs(tree, past))  # [1, R, H*D]
    rows = []
    leaves = [i for i in range(R) if not tree.children(i)]
    for leaf in leaves:
        path = tree.path_to(leaf)
        ref_caches = [c.copy() for c in cache0]
        ref = chain_node.call([t[:, path] for t in qkv], ref_caches, past)  # [1, L, H*D]
        L = len(path)
        same_caches = [c.copy() for c in cache0]  # the path as a chain through the tree inputs (causal bias)
        same = tree_node.call([t[:, path] for t in qkv], same_caches, past, *tree_inputs(DraftTree.chain(path), past))
        k_tree = caches[0][0][:, [past + r for r in path]]  # [H_kv, L, D]: where the tree call wrote them
        k_chain = ref_caches[0][0][:, past : past + L]
        rows.append(
            {
                "path": path,
                "max_abs_diff_out": float(np.abs(out[0, path] - ref[0]).max()),
                "max_abs_diff_out_vs_biased_chain": float(np.abs(out[0, path] - same[0]).max()),
                "max_abs_diff_k": float(np.abs(k_tree - k_chain).max()),
            }
        )
    return rows


def timings(past: int, sizes: list[int], threads: int, calls: int, rng: np.random.Generator) -> list[dict]:
    from specexport_runtime.tree import DraftTree

    plain, biased = Node(False, threads), Node(True, threads)
    caches = [rng.standard_normal((1, KV_HEADS, T_MAX, HEAD_DIM)).astype(np.float32) for _ in range(2)]
    out = []
    for S in sizes:
        widths = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM)
        qkv = [rng.standard_normal((1, S, w)).astype(np.float32) for w in widths]
        extra = tree_inputs(DraftTree.chain(np.arange(S)), past)
        chain = harness.median_seconds(lambda qkv=qkv: plain.call(qkv, caches, past), calls)
        tree = harness.median_seconds(lambda qkv=qkv, extra=extra: biased.call(qkv, caches, past, *extra), calls)
        out.append({"rows": S, "chain_us": round(chain * 1e6, 1), "with_tree_inputs_us": round(tree * 1e6, 1)})
    return out


def parser():
    ap = harness.script_parser(__doc__)
    ap.add_argument("--past", type=int, default=200, help="committed rows before the call (default 200)")
    ap.add_argument("--sizes", default="2,9,17", help="chain rows to time (default %(default)s)")
    ap.add_argument("--calls", type=int, default=200, help="timed calls per size (default 200)")
    ap.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads (default 2)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    ap.add_argument("--json", default=None, metavar="OUT", help="write the machine, command and rows as JSON here")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    sizes = harness.int_list(args.sizes, "--sizes")
    if not 0 <= args.past or args.past + max(max(sizes), len(TREE_PARENTS)) > T_MAX:
        raise harness.HarnessError(f"--past must be in [0, {T_MAX} - rows], got {args.past}")
    meta = harness.run_metadata(None if argv is None else [__file__, *argv], **vars(args))
    rng = np.random.default_rng(args.seed)
    paths = compare(args.past, args.threads, rng)
    costs = timings(args.past, sizes, args.threads, args.calls, rng)
    print(harness.header(meta))
    print(f"tree parents {TREE_PARENTS}, past {args.past}: each root-to-leaf path against a chain call of it")
    for row in paths:
        print(
            f"  path {row['path']}: out max |diff| {row['max_abs_diff_out']:.3g} (against the chain through"
            f" the tree inputs: {row['max_abs_diff_out_vs_biased_chain']:.3g}), K rows {row['max_abs_diff_k']:.3g}"
        )
    print("one node, median of --calls calls:")
    for row in costs:
        ratio = row["with_tree_inputs_us"] / row["chain_us"]
        print(
            f"  S={row['rows']}: chain {row['chain_us']} us,"
            f" with tree inputs {row['with_tree_inputs_us']} us ({ratio:.2f}x)"
        )
    if args.json:
        harness.write_json(args.json, {"meta": meta, "paths": paths, "costs": costs})
    return 0


if __name__ == "__main__":
    raise SystemExit(harness.cli(main))
