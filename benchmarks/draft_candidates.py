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
    int8-head4    int8 layers, 4-bit output projection
    mixK          int8 for the first and last K layers and the output projection, int4 block 128 between
    int4-B        4-bit everywhere, block B
    int4a-32      4-bit asymmetric block 32 layers, int8 output projection
    skipA-B       int8 copy without layers A .. B-1
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


def make_candidate(name: str, model, work: Path, max_context: int):
    """-> (graph path, number of layers) of candidate `name`."""
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
    else:
        raise SystemExit(f"unknown candidate {name!r}; see --help")
    return _quantize(raw.path, work / name, plan), raw.spec


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
    model = load_model(resolve_source(args.model), "float32")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in [c for c in args.candidates.split(",") if c]:
            path, spec = make_candidate(name, model, Path(tmp), max_context)
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
