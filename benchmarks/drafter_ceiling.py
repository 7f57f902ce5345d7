"""The replay-accuracy ceiling of a Gemma 4 E2B-shaped target: its assistant's drafts replaced by the
recorded greedy answer (acceptance 1.0), rounds of 1 + gamma tokens at each --gammas, against
target-only decoding, through the runtime's real SpeculativeLoop (random-init weights).

    python benchmarks/drafter_ceiling.py [--target-layers 35] [--gammas 4,8] [--prompt-tokens 64]
        [--tokens 128] [--repeats 5] [--threads 2] [--graph fused|portable] [--json OUT]

The target is assistant_cost.py's random-init Gemma4TextConfig of E2B's widths (hidden 1536, MLP
6144 and twice that on K/V-sharing layers, 8 heads of 256 / 512, one K/V head, per-layer inputs of
256, vocabulary 262144, 4 sliding : 1 full, 20 of 35 layers sharing K/V) with --target-layers
layers; `--shape tiny` is a small Gemma 4 of the same layout, for checking the script. It is
built as an assistant's target is (its final-normed hidden rows as a feature output, the
build's bitwise padding: padded attention in the fused form, 2-row calls in the portable one,
fp32) and run by the runtime (engine.OrtModel) on --threads threads. The full 35-layer shape
takes ~17 GiB of fp32 weights in ONNX Runtime (and ~9 GiB of fp16 torch weights while it is
written): run it on a machine with ~24 GiB free.

Measured, after one untimed warm-up generation of each method on another prompt:
  generations  target-only, and replay at each gamma (the recorded greedy answer drafted, a fixed
               gamma, nothing else drafting), --tokens new tokens after a --prompt-tokens prompt,
               interleaved in rotated order, --repeats times; decode tok/s excludes the prefill;
               each replay's ratio is the median over repeats of replay / target-only of the same
               repeat; output checked against the recorded target-only answer
  call costs   a 1-row call and a (1 + gamma)-row call at a cache of prompt + tokens / 2
               positions, best of --repeats rounds of the median of --calls calls, interleaved;
               the call-cost bound of a round of 1 + gamma tokens is (1 + gamma) x 1-row /
               (1 + gamma)-row: what replay would reach if everything but the target's calls were free
"""

from __future__ import annotations

import gc
import statistics
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np

REPO = Path(__file__).resolve().parents[1]
for _p in (REPO, REPO / "runtime", Path(__file__).resolve().parent):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

# the support modules beside this script (after the path set-up: runs from a checkout)
from assistant_cost import target_config  # noqa: E402
from hybrid_ceiling import run_loop  # noqa: E402
from hybrid_graphs import Graph  # noqa: E402
from hybrid_timing import Subject, call_ids  # noqa: E402

from specexport.bench import harness  # noqa: E402

SHAPES = ("e2b", "tiny")
# bitwise padding of an fp32 target (build/graphs.py BITWISE_FUSED / BITWISE_PORTABLE): (min_rows, cache_pad)
PADDING = {"fused": (1, 1), "portable": (2, 0)}


def parser():
    ap = harness.script_parser(__doc__)
    ap.add_argument("--shape", choices=SHAPES, default="e2b", help="e2b (default) or tiny (a small Gemma 4, checks)")
    ap.add_argument("--target-layers", type=int, default=35, help="target layers of the e2b shape (default 35)")
    ap.add_argument("--gammas", default="4,8", help="comma list of the replay's fixed gammas (default 4,8)")
    ap.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (random ids; default 64)")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per generation (default 128)")
    ap.add_argument("--repeats", type=int, default=5, help="generations per method; medians (default 5)")
    ap.add_argument("--calls", type=int, default=9, help="timed calls per call-cost cell and round (default 9)")
    ap.add_argument("--graph", choices=tuple(PADDING), default="fused", help="graph form (default fused)")
    ap.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads (default 2)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights and token ids (default 0)")
    ap.add_argument("--json", default=None, metavar="OUT", help="write the machine, command and figures here")
    return ap


def tiny_config():
    """A small Gemma 4 of the E2B layout: 5 layers (4 sliding : 1 full), none sharing K/V,
    per-layer inputs, one K/V head of 16 / 32."""
    from transformers import Gemma4TextConfig

    return Gemma4TextConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        global_head_dim=32,
        sliding_window=16,
        layer_types=["sliding_attention"] * 4 + ["full_attention"],
        num_kv_shared_layers=0,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=512,
        final_logit_softcapping=30.0,
        max_position_embeddings=1024,
    )


def build_target(args, root: Path, max_context: int) -> Graph:
    """The target graph as an assistant's target is built (feature layer L, bitwise padding)."""
    import time

    import torch
    from transformers import AutoModelForCausalLM

    from specexport.graphs.decoder import build_decoder
    from specexport.models.config import normalize
    from specexport_runtime import contract

    start = time.perf_counter()
    config = tiny_config() if args.shape == "tiny" else target_config(args.target_layers)
    torch.manual_seed(args.seed)
    # fp16 in memory (half of fp32's); the writer converts one weight at a time to fp32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float16).eval()
    params = sum(p.numel() for p in model.parameters())
    norm = normalize(model.config, max_context)
    min_rows, cache_pad = PADDING[args.graph]
    result = build_decoder(
        model,
        root / "target",
        max_context,
        kv_layout=contract.layout_for_form(args.graph).name,
        min_rows=min_rows,
        pad_attention=cache_pad > 0,
        feature_layers=(norm.num_layers,),
        norm=norm,
        dtype=torch.float32,
    )
    del model
    gc.collect()
    seconds = time.perf_counter() - start
    label = f"gemma4-{args.shape}-{norm.num_layers}"
    return Graph(
        label, "fp32", args.graph, result.path, result.spec, params, result.bytes, seconds, min_rows, cache_pad
    )


def open_subject(graph: Graph, max_context: int, args) -> Subject:
    from specexport_runtime.engine import OrtModel, SessionConfig

    config = SessionConfig(threads=args.threads, shared_pool=True)
    model = OrtModel(
        graph.path, graph.spec, max_context, config, min_rows=graph.min_rows, cache_pad=graph.cache_pad
    )  # fmt: skip
    return Subject(graph, model, None, graph.spec.embedding_rows)


def call_bound(one_row: float, rows: float, gamma: int) -> float:
    """The tok/s ratio a round of 1 + gamma accepted tokens reaches against 1-row steps when only
    the target's calls cost anything: (1 + gamma) 1-row calls' time / one (1 + gamma)-row call's."""
    return (1 + gamma) * one_row / rows


def call_costs(s: Subject, args, past: int) -> dict[int, float]:
    """Seconds of a call of each row count (1, 1 + gamma) at a cache of `past` positions."""
    rng = np.random.default_rng(args.seed + 1)
    ids = call_ids(rng, s.vocab, past + 1 + max(args.gammas))
    s.model.reset()
    s.model.forward(ids[:past])
    sizes = [1] + [1 + g for g in args.gammas]

    def cell(n: int):
        return lambda: s.model.forward(ids[past : past + n], last_rows=n)

    for n in sizes:  # warm-up: every size once, untimed
        cell(n)()
        s.model.truncate(past)
    best = harness.best_medians(
        [(str(n), cell(n)) for n in sizes], args.repeats, args.calls, before=lambda: s.model.truncate(past)
    )
    return {int(n): t for n, t in best.items()}


def ceiling(s: Subject, args) -> dict:
    """Target-only and replay generations, interleaved; the recorded answers first (untimed)."""
    rng = np.random.default_rng(args.seed + 2)
    warm, prompt = call_ids(rng, s.vocab, args.prompt_tokens), call_ids(rng, s.vocab, args.prompt_tokens)
    longest = args.tokens + max(args.gammas) + 2
    plain = SimpleNamespace(ceiling_gamma=1)
    for p in (warm, prompt):
        s.answers[tuple(p)] = run_loop(s, "target-only", p, longest, plain)["tokens"]
    cells = [("target-only", 0)] + [("replay", g) for g in args.gammas]
    for method, g in cells:  # one untimed warm-up generation of each
        run_loop(s, method, warm, args.tokens, SimpleNamespace(ceiling_gamma=g))
    samples: dict[tuple[str, int], list[dict]] = {c: [] for c in cells}
    for r in range(args.repeats):
        for method, g in harness.rotated(cells, r):
            samples[method, g].append(run_loop(s, method, prompt, args.tokens, SimpleNamespace(ceiling_gamma=g)))
    answer = s.answers[tuple(prompt)][: args.tokens + 1]
    base = samples["target-only", 0]
    out = {"target_only_tok_s": statistics.median(x["tok_s"] for x in base)}
    out["target_only_equal_to_recorded"] = all(x["tokens"][: args.tokens + 1] == answer for x in base)
    out["replay"] = []
    for g in args.gammas:
        runs = samples["replay", g]
        drafted, accepted = sum(x["drafted"] for x in runs), sum(x["accepted"] for x in runs)
        out["replay"].append(
            {
                "gamma": g,
                "tok_s": statistics.median(x["tok_s"] for x in runs),
                "vs_target_only": statistics.median(x["tok_s"] / b["tok_s"] for x, b in zip(runs, base)),
                "rounds": statistics.median(x["rounds"] for x in runs),
                "tokens_per_round": statistics.median(x["decode_tokens"] / x["rounds"] for x in runs if x["rounds"]),
                "acceptance": accepted / drafted if drafted else 0.0,
                "equal_to_target_only": all(x["tokens"][: args.tokens + 1] == answer for x in runs),
            }
        )
    return out


def report(doc: dict) -> str:
    t = doc["target"]
    lines = [
        f"target: {t['label']} ({t['params'] / 1e9:.3g} B parameters, {t['bytes'] / 2**30:.2f} GiB graph,"
        f" built in {t['build_seconds']:.0f} s), {t['form']} graph, fp32",
        f"target-only: {doc['target_only_tok_s']:.2f} tok/s; call at a {doc['past']}-position cache:"
        f" 1 row {doc['calls_ms']['1']:.2f} ms",
        f"{'gamma':>5} {'replay tok/s':>13} {'x target-only':>14} {'call bound':>11} {'of bound':>9}"
        f" {'rows ms':>8} {'acceptance':>11} {'tok/round':>10} {'equal':>6}",
    ]
    for r in doc["replay"]:
        lines.append(
            f"{r['gamma']:>5} {r['tok_s']:>13.2f} {r['vs_target_only']:>14.3f} {r['call_bound']:>11.3f}"
            f" {r['vs_target_only'] / r['call_bound']:>9.3f} {r['rows_ms']:>8.2f} {r['acceptance']:>11.3f}"
            f" {r['tokens_per_round']:>10.2f} {'yes' if r['equal_to_target_only'] else 'NO':>6}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.gammas = harness.int_list(args.gammas, "--gammas")
    meta = harness.run_metadata(None if argv is None else [__file__, *argv], **vars(args))
    max_context = args.prompt_tokens + args.tokens + 2 * max(args.gammas) + 16
    with tempfile.TemporaryDirectory(prefix="drafter-ceiling.") as scratch:
        graph = build_target(args, Path(scratch), max_context)
        s = open_subject(graph, max_context, args)
        past = args.prompt_tokens + args.tokens // 2
        costs = call_costs(s, args, past)
        doc = {"meta": meta, "past": past, **ceiling(s, args)}
        del s
    doc["target"] = {
        "label": graph.kind,
        "form": graph.form,
        "params": graph.params,
        "bytes": graph.bytes,
        "build_seconds": graph.build_seconds,
    }
    doc["calls_ms"] = {str(n): t * 1e3 for n, t in sorted(costs.items())}
    for r in doc["replay"]:
        g = r["gamma"]
        r["rows_ms"] = costs[1 + g] * 1e3
        r["call_bound"] = call_bound(costs[1], costs[1 + g], g)
    print(harness.header(meta))
    print(report(doc))
    if args.json:
        harness.write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(harness.cli(main))
