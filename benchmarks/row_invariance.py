"""Do a token's logits depend on how many rows its call had? Per target precision, accuracy level
and provider, with and without row padding (contract 1.2 min_rows), plus what padding costs.

    python benchmarks/row_invariance.py [--model builtin:smollm2-135m-instruct]
        [--configs fp32,int8-l0,int8-l4,int4-l0,int4-l4,gguf-l1,gguf-l4] [--provider cpu]
        [--prompts chat,code] [--limit 2] [--past 200] [--repeats 5] [--json OUT]

Each configuration is a fused graph of the model (specexport/fused.py, quantized_target.py):
    fp32        float32 weights
    int8-lA     int8 round-to-nearest, block 32, int8 head, MatMulNBits accuracy_level A
    int4-lA     int4 likewise (int8 head)
    gguf-lA     the GGUF checkpoint's own blocks (a GGUF --model only), head from its blocks
For each, `rowcheck.row_invariance` compares the rows of tokens fed one per call with the same
tokens' rows inside calls of 2, 3, 5, 9 and 17 rows, on real prompt text (the first tokens of
each prompt as the cache, the next 17 as the tokens), once with min_rows 1 and once with 2; it
reports whether every row is bitwise equal, the max |logit| difference and the argmax agreement.
Costs: median ms of a 1-row call at a --past-token cache with min_rows 1 and 2, and of a 9-row
verify call, interleaved across configurations.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "runtime"))

DEFAULT_CONFIGS = "fp32,int8-l0,int8-l4,int4-l0,int4-l4,gguf-l1,gguf-l4"
MAX_CONTEXT = 1024


def build_config(name: str, model, blocks, out: Path):
    """-> ExportResult of configuration `name` (module docstring)."""
    from specexport.fused import build_fused
    from specexport.quantized_target import QuantizedWeights

    if name == "fp32":
        return build_fused(model, out, MAX_CONTEXT, min_rows=2)
    precision, level = name.split("-l")
    if precision == "gguf" and not blocks:
        raise SystemExit(f"configuration {name!r} needs a GGUF --model")
    head = "checkpoint" if precision == "gguf" else "int8"
    weights = QuantizedWeights(precision, 32, int(level), head, "fp32", blocks if precision == "gguf" else {})
    return build_fused(model, out, MAX_CONTEXT, weights=weights, min_rows=2)


def invariance(result, provider: str, sequences: list[tuple[list[int], list[int]]], min_rows: int) -> dict:
    """row_invariance over every (prefix, tokens) pair, pooled."""
    from specexport_runtime.engine import OrtModel, SessionConfig
    from specexport_runtime.rowcheck import row_invariance

    model = OrtModel(result.path, result.spec, MAX_CONTEXT, SessionConfig(provider=provider), min_rows=min_rows)
    reports = [row_invariance(model, prefix, tokens) for prefix, tokens in sequences]
    rows = sum(r.rows for r in reports)
    return {"bitwise": all(r.bitwise for r in reports), "max_abs_diff": max(r.max_abs_diff for r in reports),
            "argmax_agreement": sum(r.argmax_agreement * r.rows for r in reports) / rows, "rows": rows}


def call_costs(results: dict, provider: str, past: int, repeats: int, calls: int = 20) -> dict:
    """{name: {"s1": ms, "s1_padded": ms, "s9": ms}} medians, configurations interleaved."""
    from specexport_runtime.engine import OrtModel, SessionConfig

    models = {}
    for name, result in results.items():
        for rows in (1, 2):
            models[(name, rows)] = OrtModel(result.path, result.spec, MAX_CONTEXT, SessionConfig(provider=provider, threads=2),
                                            min_rows=rows)
    times: dict = {key: {1: [], 9: []} for key in models}
    for _ in range(repeats):
        for key, model in models.items():
            model.reset()
            model.forward(list(range(3, 3 + past)))
            for S in (1, 9) if key[1] == 1 else (1,):
                start = time.perf_counter()
                for _ in range(calls):
                    model.truncate(past)
                    model.forward([5] * S, last_rows=S)
                times[key][S].append((time.perf_counter() - start) / calls * 1000)
    med = lambda v: statistics.median(v)  # noqa: E731
    return {name: {"s1": med(times[(name, 1)][1]), "s1_padded": med(times[(name, 2)][1]), "s9": med(times[(name, 1)][9])}
            for name in results}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="builtin:smollm2-135m-instruct", help="transformers source (a GGUF for gguf-lA)")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"comma list (default {DEFAULT_CONFIGS})")
    ap.add_argument("--provider", default="cpu", help="ONNX Runtime provider: cpu or cuda (default cpu)")
    ap.add_argument("--prompts", default="chat,code", help="prompt domains or JSONL files (default chat,code)")
    ap.add_argument("--limit", type=int, default=2, help="prompts per domain (default 2)")
    ap.add_argument("--past", type=int, default=200, help="cache length for the timed calls (default 200)")
    ap.add_argument("--repeats", type=int, default=5, help="timing repeats; medians are reported (default 5)")
    ap.add_argument("--json", default=None, help="write the rows as JSON to this file")
    args = ap.parse_args(argv)

    from specexport.bench import resolve_prompts
    from specexport.sources import load_model, load_tokenizer, resolve_source

    source = resolve_source(args.model)
    model = load_model(source, "float32")
    blocks = {}
    if source.kind == "gguf":
        from specexport.formats.gguf import read_gguf_blocks

        blocks = read_gguf_blocks(Path(source.location) / source.gguf_file)
    tok = load_tokenizer(source)
    sequences = []
    for prompt in resolve_prompts([s for s in args.prompts.split(",") if s], limit=args.limit):
        text = prompt.text if prompt.text is not None else "\n".join(content for _, content in prompt.messages)
        ids = tok(text)["input_ids"]
        ids = (ids * (40 // max(1, len(ids)) + 1))[:40]  # plain text: 23 tokens of cache, 17 to compare
        sequences.append((ids[:23], ids[23:40]))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: build_config(name, model, blocks, Path(tmp) / name) for name in args.configs.split(",") if name}
        costs = call_costs(results, args.provider, args.past, args.repeats)
        for name, result in results.items():
            row = {"config": name, "provider": args.provider, **costs[name]}
            for min_rows in (1, 2):
                row[f"min_rows_{min_rows}"] = invariance(result, args.provider, sequences, min_rows)
            rows.append(row)
            one, two = row["min_rows_1"], row["min_rows_2"]
            print(f"{name:<9} 1-row calls: {'bitwise' if one['bitwise'] else 'differ'} (max |diff| {one['max_abs_diff']:.2g},"
                  f" argmax {one['argmax_agreement']:.1%})  padded: {'bitwise' if two['bitwise'] else 'differ'}"
                  f" ({two['max_abs_diff']:.2g})  decode {row['s1']:.2f} ms, padded {row['s1_padded']:.2f} ms"
                  f" ({row['s1_padded'] / row['s1']:.2f}x), verify(9) {row['s9']:.2f} ms ({row['s9'] / row['s1']:.2f}x)",
                  flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
