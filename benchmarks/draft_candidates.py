"""Which quantized / layer-skipped copy of the target makes the cheapest useful draft?

    python benchmarks/draft_candidates.py ARTIFACT [--model builtin:smollm2-135m-instruct]
        [--candidates int8,int8-head4,mix8,int4-128,int4a-32,skip14-16,skip25-28]
        [--prompts code,chat,structured] [--limit 3] [--tokens 96] [--json OUT]

For each candidate draft (a fused graph of the target's model, quantized as named below) it
reports the top-1 agreement with the artifact target's greedy output, teacher-forced over the
prompts (the fraction of positions where the draft's argmax is the target's next token: the
acceptance of a greedy draft token, without the speculative loop), and the draft's decode step
(median ms per 1-token call at a 200-token past, 2 threads). Both numbers together give the
expected speedup E / (gamma c + v) of docs/benchmarking.md.

Candidates:
    int8          MatMulNBits 8-bit, block 32, symmetric (the recipe's int8 draft)
    int8-B        8-bit everywhere, block B (fewer scales per weight than block 32)
    int8-head4    int8 layers, 4-bit output projection
    mixK          int8 for the first and last K layers and the output projection, int4 block 128 between
    int4-B        4-bit everywhere, block B
    int4a-32      4-bit asymmetric block 32 layers, int8 output projection
    skipA-B       int8 copy without layers A .. B-1
    ggufA         the GGUF checkpoint's own blocks, no re-quantization: Q4_1 layers as 4-bit
                  MatMulNBits (zero point 0) plus the min term (block sums of x @ m), the Q8_0
                  output projection as 8-bit MatMulNBits; layers at MatMulNBits accuracy_level A
                  (1: fp32 arithmetic, the target's own values; 4: int8 activations), the head at 4.
                  Only for a GGUF source with Q4_1 layers and a Q8_0 token_embd (SmolLM2's).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _quantize(src: Path, out: Path, plan) -> Path:
    """plan: [(bits, block, symmetric, predicate)] applied in order to the MatMul nodes the
    predicate selects (a node quantized by one step is a MatMulNBits for the next)."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    from specexport.quantize import ACCURACY_LEVEL, _save

    proto = onnx.load(str(src))
    for bits, block, symmetric, pick in plan:
        skip = [n.name for n in proto.graph.node if n.op_type == "MatMul" and not pick(n)]
        quantizer = MatMulNBitsQuantizer(proto, bits=bits, block_size=block, is_symmetric=symmetric,
                                         accuracy_level=ACCURACY_LEVEL, nodes_to_exclude=skip)
        quantizer.process()
        proto = quantizer.model.model
    return _save(proto, out)


def _is_head(node) -> bool:
    return node.input[1].startswith("lm_head")


def _layer(node) -> int | None:
    name = node.input[1]  # fused.py names layer weights l{i}_...
    return int(name[1 : name.index("_")]) if name[:1] == "l" and name[1:2].isdigit() else None


def make_candidate(name: str, model, work: Path, max_context: int, gguf_path: Path | None = None):
    """-> (graph path, graph spec) of candidate `name`."""
    import torch

    from specexport.fused import build_fused

    every = lambda n: True  # noqa: E731
    if name.startswith("skip"):
        a, b = map(int, name[4:].split("-"))
        model = copy.deepcopy(model)
        layers = model.model.layers
        model.model.layers = torch.nn.ModuleList([m for i, m in enumerate(layers) if not a <= i < b])
        model.config.num_hidden_layers = len(model.model.layers)
    raw = build_fused(model, work / f"{name}-raw", max_context, tie_lm_head=False)
    L = raw.spec.num_layers
    if name == "int8" or name.startswith("skip"):
        plan = [(8, 32, True, every)]
    elif name.startswith("int8-") and name[5:].isdigit():
        plan = [(8, int(name[5:]), True, every)]
    elif name == "int8-head4":
        plan = [(8, 32, True, lambda n: not _is_head(n)), (4, 32, True, every)]
    elif name.startswith("mix"):
        k = int(name[3:])
        keep8 = lambda n: _is_head(n) or (_layer(n) is not None and (_layer(n) < k or _layer(n) >= L - k))  # noqa: E731
        plan = [(8, 32, True, keep8), (4, 128, True, every)]
    elif name.startswith("int4a-"):
        plan = [(4, int(name[6:]), False, lambda n: not _is_head(n)), (8, 32, True, every)]
    elif name.startswith("int4-"):
        plan = [(4, int(name[5:]), True, every)]
    elif name.startswith("gguf") and name[4:].isdigit():
        if gguf_path is None:
            raise SystemExit(f"candidate {name!r} needs a GGUF --model")
        return gguf_blocks_graph(raw.path, gguf_path, model, work / name, int(name[4:])), raw.spec
    else:
        raise SystemExit(f"unknown candidate {name!r}; see --help")
    return _quantize(raw.path, work / name, plan), raw.spec


def _q4_1(tensor):
    """GGUF Q4_1 tensor -> d, m [N, nb] float32 and q [N, nb, 32] uint8 (w = d q + m)."""
    import numpy as np

    raw = tensor.data.reshape(tensor.data.shape[0], -1, 20)  # per block: d fp16, m fp16, 16 bytes of nibbles
    d = raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    nibbles = raw[..., 4:20]
    return d, m, np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)  # elements 0..15, then 16..31


def _q8_0(tensor):
    """GGUF Q8_0 tensor -> d [N, nb] float32 and q [N, nb, 32] int8 (w = d q)."""
    import numpy as np

    raw = tensor.data.reshape(tensor.data.shape[0], -1, 34)
    return raw[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32), raw[..., 2:34].copy().view(np.int8)


def _rows_of(hf_weight, blocks_deq):
    """perm with hf_weight[r] == blocks_deq[perm[r]] bit for bit (transformers reorders q / k rows)."""
    import numpy as np

    index = {row.tobytes(): i for i, row in enumerate(blocks_deq)}
    perm = np.array([index.get(row.tobytes(), -1) for row in hf_weight])
    if (perm < 0).any():
        raise SystemExit("GGUF blocks do not dequantize to the transformers weights bit for bit")
    return perm


def gguf_blocks_graph(raw_path: Path, gguf_path: Path, model, out: Path, layer_accuracy: int) -> Path:
    """Rewrite the weight MatMuls of a fused graph (untied head) into the checkpoint's own blocks."""
    import gguf
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    from specexport.quantize import _save

    tensors = {t.name: t for t in gguf.GGUFReader(str(gguf_path)).tensors}
    parts = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",), "gate_up": ("ffn_gate", "ffn_up"),
             "down": ("ffn_down",)}
    hf_names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
    params = dict(model.model.layers.named_parameters())
    proto = onnx.load(str(raw_path))
    nodes, inits, dropped = [], [], set()
    for node in proto.graph.node:
        weight = node.input[1] if node.op_type == "MatMul" else ""
        layer, kind = _layer(node) if weight else None, weight.split("_", 1)[1].rsplit("_", 1)[0] if weight[:1] == "l" else ""
        if layer is not None and kind in parts:
            blocks = []
            for part in parts[kind]:
                d, m, q = _q4_1(tensors[f"blk.{layer}.{part}.weight"])
                hf = params[f"{layer}.{hf_names[part]}.weight"].detach().numpy()
                perm = _rows_of(hf, (d[..., None] * q + m[..., None]).reshape(q.shape[0], -1))
                blocks.append((d[perm], m[perm], q[perm]))
            d, m, q = (np.concatenate(a, 0) for a in zip(*blocks))  # rows: q|k|v or gate|up, as the graph
            N, nb, _ = q.shape
            x, p = node.input[0], f"gg{layer}_{kind}"
            inits += [numpy_helper.from_array((q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8), p + "_q"),
                      numpy_helper.from_array(d.reshape(-1), p + "_d"),
                      numpy_helper.from_array(np.zeros((N, (nb + 1) // 2), np.uint8), p + "_zp"),
                      numpy_helper.from_array(np.ascontiguousarray(m.T), p + "_m"),  # [nb, N]
                      numpy_helper.from_array(np.array([0, 0, nb, 32], np.int64), p + "_blocks"),
                      numpy_helper.from_array(np.array([-1], np.int64), p + "_last")]
            nodes += [  # y = x @ (d q)  +  blocksum(x) @ m
                helper.make_node("MatMulNBits", [x, p + "_q", p + "_d", p + "_zp"], [p + "_dq"], domain="com.microsoft",
                                 K=nb * 32, N=N, bits=4, block_size=32, accuracy_level=layer_accuracy),
                helper.make_node("Reshape", [x, p + "_blocks"], [p + "_xb"]),  # [1, S, nb, 32]
                helper.make_node("ReduceSum", [p + "_xb", p + "_last"], [p + "_sum"], keepdims=0),  # [1, S, nb]
                helper.make_node("MatMul", [p + "_sum", p + "_m"], [p + "_min"]),
                helper.make_node("Add", [p + "_dq", p + "_min"], list(node.output)),
            ]
            dropped.add(weight)
        elif weight and _is_head(node):
            d, q = _q8_0(tensors["token_embd.weight"])
            N, nb, _ = q.shape
            inits += [numpy_helper.from_array((q.astype(np.int16) + 128).astype(np.uint8), "gg_head_q"),
                      numpy_helper.from_array(d.reshape(-1), "gg_head_d")]  # default zero point 128: w = d q
            nodes.append(helper.make_node("MatMulNBits", [node.input[0], "gg_head_q", "gg_head_d"], list(node.output),
                                          domain="com.microsoft", K=nb * 32, N=N, bits=8, block_size=32, accuracy_level=4))
            dropped.add(weight)
        else:
            nodes.append(node)
    kept = [i for i in proto.graph.initializer if i.name not in dropped]
    del proto.graph.initializer[:]
    proto.graph.initializer.extend(kept + inits)
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)
    return _save(proto, out)


def agreement(model, sequences) -> float:
    hits = total = 0
    for prompt, out in sequences:
        model.reset()
        model.forward(prompt[:-1])
        seq, pos, preds = prompt + out, len(prompt) - 1, []
        while pos < len(seq) - 1:
            n = min(model.max_rows, len(seq) - 1 - pos)
            preds += model.forward(seq[pos : pos + n], last_rows=n).argmax(-1).tolist()
            pos += n
        hits += sum(int(a == b) for a, b in zip(preds, out))
        total += len(out)
    return hits / total


def step_ms(model, past: int = 200, calls: int = 30, repeats: int = 3) -> float:
    model.reset()
    model.forward(list(range(3, 3 + past)))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            model.truncate(past)
            model.forward([5])
        times.append((time.perf_counter() - start) / calls * 1000)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", help="artifact whose target defines the reference outputs")
    ap.add_argument("--model", default="builtin:smollm2-135m-instruct", help="transformers source of the same target")
    ap.add_argument("--candidates", default="int8,int8-head4,mix8,int4-128,int4a-32,skip14-16,skip25-28")
    ap.add_argument("--prompts", default="code,chat,structured", help="comma-separated domains or JSONL files")
    ap.add_argument("--limit", type=int, default=3, help="prompts per domain (default 3)")
    ap.add_argument("--tokens", type=int, default=96, help="greedy target tokens per prompt (default 96)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None, help="write the rows as JSON to this file")
    args = ap.parse_args(argv)
    logging.disable(logging.INFO)  # the quantizer logs every tensor

    from specexport.bench import prompt_ids, resolve_prompts
    from specexport.sources import load_model, resolve_source
    from specexport_runtime.api import load
    from specexport_runtime.engine import OrtModel, SessionConfig

    gen = load(args.artifact, threads=args.threads)
    prompts = resolve_prompts([s for s in args.prompts.split(",") if s], limit=args.limit)
    sequences = []
    for p in prompts:
        ids = prompt_ids(gen, p)
        sequences.append((ids, list(gen.generate(ids, max_new_tokens=args.tokens, speculative=False).token_ids)))
    max_context = gen.manifest.max_context
    del gen
    source = resolve_source(args.model)
    model = load_model(source, "float32")
    gguf_path = Path(source.location) / source.gguf_file if source.kind == "gguf" else None
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in [c for c in args.candidates.split(",") if c]:
            path, spec = make_candidate(name, model, Path(tmp), max_context, gguf_path)
            draft = OrtModel(path, spec, max_context, SessionConfig(threads=args.threads))
            row = {"candidate": name, "agreement": agreement(draft, sequences), "step_ms": step_ms(draft),
                   "layers": spec.num_layers}
            rows.append(row)
            print(f"{name:<14} agreement {row['agreement']:.3f}  step {row['step_ms']:.2f} ms", flush=True)
            del draft
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
