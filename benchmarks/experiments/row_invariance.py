"""Do a token's logits depend on how many rows its call had? Per target precision, accuracy level
and provider, unpadded, with padded calls and with padded attention (contract 1.2), plus what
each padding costs.

    python benchmarks/experiments/row_invariance.py [--model builtin:smollm2-135m-instruct]
        [--configs fp32,int8-l0,int8-l4,int4-l0,int4-l4,gguf-l1,gguf-l4] [--provider cpu]
        [--prompts chat,code] [--limit 2] [--past 200] [--repeats 5] [--json OUT]

Each configuration is a fused graph of the model (specexport/graphs/decoder.py, quantized_target.py):
    fp32        float32 weights
    int8-lA     int8 round-to-nearest, block 32, int8 head, MatMulNBits accuracy_level A
    int4-lA     int4 likewise (int8 head)
    gguf-lA     the GGUF checkpoint's own blocks (a GGUF --model only), head from its blocks
For each, `rowcheck.row_invariance` compares the rows of tokens fed one per call with the same
tokens' rows inside calls of 2, 3, 5, 9 and 17 rows, on real prompt text (the first tokens of
each prompt as the cache, the next 17 as the tokens), three ways: unpadded (1-row calls),
padded calls (min_rows 2: the runtime feeds every call at least 2 rows) and padded attention
(a graph whose GroupQueryAttention gets one extra row, cache_pad 1); it reports whether every
row is bitwise equal, the max |logit| difference and the argmax agreement. Costs: median ms of a
1-row call at a --past-token cache each way, and of a 9-row verify call, the models rotated each
repeat so machine drift spreads over them (specexport.bench.harness).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "runtime"))

from specexport.bench import harness  # noqa: E402

DEFAULT_CONFIGS = "fp32,int8-l0,int8-l4,int4-l0,int4-l4,gguf-l1,gguf-l4"
MAX_CONTEXT = 1024


WAYS = {"unpadded": (False, 1), "padded calls": (False, 2), "padded attention": (True, 1)}  # (graph, min_rows)


def build_config(name: str, model, blocks, out: Path, pad_attention: bool):
    """-> ExportResult of configuration `name` (module docstring), its attention padded or not."""
    from specexport.graphs.decoder import build_decoder
    from specexport.graphs.quantized_target import QuantizedWeights

    if name == "fp32":
        return build_decoder(model, out, MAX_CONTEXT, min_rows=2, pad_attention=pad_attention)
    precision, level = name.split("-l")
    if precision == "gguf" and not blocks:
        raise harness.HarnessError(f"configuration {name!r} needs a GGUF --model")
    head = "checkpoint" if precision == "gguf" else "int8"
    weights = QuantizedWeights(precision, 32, int(level), head, "fp32", blocks if precision == "gguf" else {})
    return build_decoder(model, out, MAX_CONTEXT, weights=weights, min_rows=2, pad_attention=pad_attention)


def _model(graphs: dict, way: str, provider: str, threads: int | None = None):
    from specexport_runtime.engine import OrtModel, SessionConfig

    padded, min_rows = WAYS[way]
    result = graphs[padded]
    return OrtModel(
        result.path,
        result.spec,
        MAX_CONTEXT,
        SessionConfig(provider=provider, threads=threads),
        min_rows=min_rows,
        cache_pad=int(padded),
    )


def invariance(graphs: dict, way: str, provider: str, sequences: list[tuple[list[int], list[int]]]) -> dict:
    """row_invariance over every (prefix, tokens) pair, pooled."""
    from specexport.build.rowcheck import row_invariance

    model = _model(graphs, way, provider)
    reports = [row_invariance(model, prefix, tokens) for prefix, tokens in sequences]
    rows = sum(r.rows for r in reports)
    return {
        "bitwise": all(r.bitwise for r in reports),
        "max_abs_diff": max(r.max_abs_diff for r in reports),
        "argmax_agreement": sum(r.argmax_agreement * r.rows for r in reports) / rows,
        "rows": rows,
    }


def call_costs(configs: dict, provider: str, past: int, repeats: int, calls: int = 20) -> dict:
    """{name: {way: decode ms, ..., "verify9": ms}}: medians over repeats of the median call, the
    models rotated each repeat."""
    models = {(name, way): _model(graphs, way, provider, threads=2) for name, graphs in configs.items() for way in WAYS}
    times: dict = {key: [] for key in models} | {(name, "verify9"): [] for name in configs}
    for rep in range(repeats):
        for (name, way), model in harness.rotated(list(models.items()), rep):
            model.reset()
            model.forward(list(range(3, 3 + past)))
            for S, key in ((1, (name, way)),) + (((9, (name, "verify9")),) if way == "unpadded" else ()):

                def call(model=model, S=S):
                    model.truncate(past)
                    model.forward([5] * S, last_rows=S)

                times[key].append(harness.median_seconds(call, calls) * 1000)
    out: dict = {name: {} for name in configs}
    for (name, key), values in times.items():
        out[name][key] = statistics.median(values)
    return out


def parser():
    ap = harness.script_parser(__doc__)
    ap.add_argument("--model", default="builtin:smollm2-135m-instruct", help="transformers source (a GGUF for gguf-lA)")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"comma list (default {DEFAULT_CONFIGS})")
    ap.add_argument("--provider", default="cpu", help="ONNX Runtime provider: cpu or cuda (default cpu)")
    ap.add_argument("--prompts", default="chat,code", help="prompt domains or JSONL files (default chat,code)")
    ap.add_argument("--limit", type=int, default=2, help="prompts per domain (default 2)")
    ap.add_argument("--past", type=int, default=200, help="cache length for the timed calls (default 200)")
    ap.add_argument("--repeats", type=int, default=5, help="timing repeats; medians are reported (default 5)")
    ap.add_argument("--json", default=None, metavar="OUT", help="write the machine, command and rows as JSON here")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    from specexport.models.sources import load_model, load_tokenizer, resolve_source

    meta = harness.run_metadata(None if argv is None else [__file__, *argv], **vars(args))

    source = resolve_source(args.model)
    model = load_model(source, "float32")
    blocks = {}
    if source.kind == "gguf":
        from specexport.formats.gguf import read_gguf_blocks

        blocks = read_gguf_blocks(Path(source.location) / source.gguf_file)
    tok = load_tokenizer(source)
    sequences = []
    for prompt in harness.load_prompt_set(args.prompts, limit=args.limit):
        text = prompt.text if prompt.text is not None else "\n".join(content for _, content in prompt.messages)
        ids = tok(text)["input_ids"]
        ids = (ids * (40 // max(1, len(ids)) + 1))[:40]  # plain text: 23 tokens of cache, 17 to compare
        sequences.append((ids[:23], ids[23:40]))
    rows = []
    print(harness.header(meta))
    with tempfile.TemporaryDirectory() as tmp:
        configs = {
            name: {
                pad: build_config(name, model, blocks, Path(tmp) / f"{name}-{int(pad)}", pad) for pad in (False, True)
            }
            for name in args.configs.split(",")
            if name
        }
        costs = call_costs(configs, args.provider, args.past, args.repeats)
        for name, graphs in configs.items():
            row = {"config": name, "provider": args.provider, "ms": costs[name]}
            parts = []
            for way in WAYS:
                row[way] = r = invariance(graphs, way, args.provider, sequences)
                state = (
                    "bitwise"
                    if r["bitwise"]
                    else f"differ {r['max_abs_diff']:.2g} (argmax {r['argmax_agreement']:.1%})"
                )
                ratio = costs[name][way] / costs[name]["unpadded"]
                parts.append(f"{way}: {state}, {costs[name][way]:.2f} ms ({ratio:.2f}x)")
            rows.append(row)
            print(f"{name:<9} " + "; ".join(parts) + f"; verify(9) {costs[name]['verify9']:.2f} ms", flush=True)
    if args.json:
        harness.write_json(args.json, {"meta": meta, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(harness.cli(main))
