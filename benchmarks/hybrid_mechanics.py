"""What speculation costs on a hybrid target with recurrent state (LFM2's gated short convolutions,
or Qwen3.5's Gated DeltaNet, between attention layers), against an attention-only model of the
same size: the mechanics, which do not depend on the weights (random-init models; nothing is
fetched).

    python benchmarks/hybrid_mechanics.py [--shape lfm2-1.2b] [--precisions fp32,int4] [--forms fused]
        [--past 600] [--gammas 4,8] [--tokens 64] [--repeats 7] [--threads 2] [--json OUT]

Models: per precision and graph form, a random-init hybrid of --shape (lfm2-1.2b: transformers'
config of LiquidAI/LFM2-1.2B, specexport.plan.sizes; qwen3.5-0.8b: an assumed Qwen3.5-0.8B
shape, not read from the real config.json, hybrid_graphs.SHAPES) and beside it an attention-only
twin (a Llama; for Qwen3.5 a Qwen3) of the same hidden size, layers, heads, KV heads, head size,
MLP width and vocabulary (every layer attention). fp32 graphs, and
int4 targets (MatMulNBits, round-to-nearest, the quantized-target path of the fused form). Each
graph gets the padding a bitwise target is built with (build/graphs.py BITWISE_FUSED): fp32 fused
padded attention; int4 padded calls (every call at least 2 rows: MatMulNBits' 1-row path gives
other low bits than its multi-row one, so the "1-row call" of an int4 target is its padded 2-row
call, the one target-only decoding pays); portable none.

Figures (each a median over --repeats, warm-up calls and runs outside the measured set):
  verify cost   one call of 1 + gamma rows against a 1-row call with --past positions in the
                cache (each call rolled back after timing); the models of a precision and form
                interleaved call by call, in rotated order. The host share is the part of the
                call spent outside ONNX Runtime's run (binding, state bookkeeping).
  rollback      the hybrid's state bookkeeping (recurrent.StateHistory: bind, store, and the
                rollback in truncate) timed call by call inside the ceiling runs below, as a share
                of their decode time; and a round (a call of 1 + gamma rows, then a rollback to
                half the draft accepted) with the bookkeeping against the same round without it
                (the states bound in place, nothing kept: no rollback possible), interleaved.
  ceiling       the real SpeculativeLoop, greedy, --tokens new tokens after a --prompt-tokens
                prompt: target-only decoding; a replay proposer drafting the recorded greedy answer
                (acceptance 1.0) at a fixed gamma of --ceiling-gamma; an always-wrong proposer
                (its first token is never the target's) under the adaptive draft-length policy
                (adaptive.GammaController, kept across runs as the generator keeps it), measured
                once the policy has switched speculation off (the warm-up run lets it react).
                Decode tok/s exclude the prefill; ratios are per repeat (adjacent runs), then the
                median.
  limits        what bounds each figure: the call-cost ceiling of the replay ((1 + gamma) x a
                1-row call / a (1 + gamma)-row call), the share of decode time outside ONNX Runtime
                (the loop's Python: argmax, verify, proposer, bookkeeping), the always-wrong
                policy's probe rounds.

Code: this script parses the options, runs the groups and prints the report; beside it,
hybrid_graphs.py builds the models and graphs (the shapes, the twin's config), hybrid_timing.py
times the calls (the subjects, verify cost, rollback rounds) and hybrid_ceiling.py runs the loop
(the proposers, the ceiling).

Memory: a 1.2B-parameter fp32 graph is ~4.7 GB on disk and ~6 GB resident; --apart fp32 measures
the two models of a precision one after the other (not interleaved) so only one is on disk and in
memory at a time. Graphs go to a temporary folder deleted as soon as they are measured, or are
kept (and reused) in --work.
"""

from __future__ import annotations

import gc
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for _p in (REPO, REPO / "runtime", Path(__file__).resolve().parent):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

# the support modules beside this script (after the path set-up: runs from a checkout)
from hybrid_ceiling import METHODS, ceiling  # noqa: E402
from hybrid_graphs import ASSUMED, FORMS, KINDS, PRECISIONS, SHAPES, build_graph, describe, shape_config  # noqa: E402
from hybrid_timing import load_subject, rollback_rounds, verify_cost  # noqa: E402

from specexport.bench import harness  # noqa: E402
from specexport.errors import HarnessError  # noqa: E402

# --------------------------------------------------------------------------- report


def limits(verify: list[dict], rollback: list[dict], ceil: list[dict], gamma: int) -> list[str]:
    lines = []
    cost = {r["model"]: r["calls"] for r in verify}
    for row in ceil:
        name, rep, wrong, base = row["model"], row["replay"], row["always-wrong"], row["target-only"]
        calls = cost.get(name, {})
        one, full = calls.get("1"), calls.get(str(gamma + 1))
        if one and full and rep["acceptance"] > 0:
            bound = (gamma + 1) * one["run_ms"] / full["run_ms"]
            lines.append(
                f"{name}: replay {rep['vs_target_only']:.2f}x against a call-cost bound of {bound:.2f}x"
                f" ((1 + {gamma}) x {one['run_ms']:.1f} ms / {full['run_ms']:.1f} ms); ONNX Runtime's runs are"
                f" {rep['run_share']:.0%} of its decode time (target-only {base['run_share']:.0%}), the state"
                f" bookkeeping {rep['bookkeeping_share']:.1%}"
            )
        probe = wrong["rounds"] / max(1, wrong["rounds"] + wrong["plain_steps"])
        ctl = wrong["controller_after"]
        lines.append(
            f"{name}: always-wrong {wrong['vs_target_only']:.3f}x: {probe:.1%} of its target calls drafted"
            f" (policy off after {wrong['policy_reacted_after_rounds']} drafted rounds in the warm-up; in the"
            f" runs {wrong['draft_per_round']:.1f} tokens drafted a round; afterwards it is"
            f" {'on' if ctl['speculating'] else 'off'}, alpha {ctl['alpha']:.3f}, timed ms by rows"
            f" {fmt_costs(ctl['timed_ms'])}); ONNX Runtime's runs {wrong['run_share']:.0%} of its decode time"
        )
    for r in verify:
        worst = max(c["host_share"] for c in r["calls"].values())
        lines.append(f"{r['model']}: verify calls are {1 - worst:.0%}+ inside ONNX Runtime (host share <= {worst:.1%})")
    return lines


def fmt_costs(costs: dict) -> str:
    return ", ".join(f"{r}: {v:.0f}" for r, v in costs.items()) or "none"


def fmt(x: float, spec: str = ".2f") -> str:
    return format(x, spec)


def report(doc: dict) -> str:
    out = [f"\n{doc['shape_line']}"] if doc.get("shape_line") else []
    gammas = doc["settings"]["gammas"]
    out.append(f"\n### Verify cost (past {doc['settings']['past']}, median ms per call; x = against the 1-row call)\n")
    head = "| model | 1 row ms |" + "".join(f" {1 + g} rows ms | x |" for g in gammas) + " host share |"
    out += [head, "|" + "---|" * (3 + 2 * len(gammas))]
    for r in doc["verify"]:
        c = r["calls"]
        cells = "".join(f" {fmt(c[str(1 + g)]['ms'])} | {fmt(c[str(1 + g)]['vs_1_row'])}x |" for g in gammas)
        host = max(v["host_share"] for v in c.values())
        out.append(f"| {r['model']} | {fmt(c['1']['ms'])} |{cells} {host:.1%} |")
    out.append("\n### Rollback overhead (hybrid; a round = 1 + gamma rows, then rollback to half the draft)\n")
    out += [
        "| model | gamma | round ms | without bookkeeping ms | A/B overhead | bind us | store us | truncate us"
        " | direct share |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["rollback"]:
        out.append(
            f"| {r['model']} | {r['gamma']} | {fmt(r['round_ms_with'])} | {fmt(r['round_ms_without'])} |"
            f" {r['overhead_ab']:+.1%} | {fmt(r['bind_us'], '.0f')} | {fmt(r['store_us'], '.0f')} |"
            f" {fmt(r['truncate_us'], '.0f')} | {r['direct_share']:.2%} |"
        )
    s = doc["settings"]
    out.append(
        f"\n### Ceiling (SpeculativeLoop, greedy, {s['tokens']} tokens after {s['prompt_tokens']} prompt tokens,"
        f" decode tok/s)\n"
    )
    out += [
        f"| model | target-only | replay g{s['ceiling_gamma']} | x | acceptance | bookkeeping share |"
        " always-wrong | x | drafted rounds | outputs equal |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["ceiling"]:
        t, rep, w = r["target-only"], r["replay"], r["always-wrong"]
        equal = all(r[m]["equal_to_target_only"] for m in METHODS)
        probes = f"{w['rounds']:.0f}/{w['rounds'] + w['plain_steps']:.0f}"
        out.append(
            f"| {r['model']} | {fmt(t['tok_s'], '.1f')} | {fmt(rep['tok_s'], '.1f')} | {rep['vs_target_only']:.2f}x |"
            f" {rep['acceptance']:.2f} | {rep['bookkeeping_share']:.2%} | {fmt(w['tok_s'], '.1f')} |"
            f" {w['vs_target_only']:.3f}x | {probes} | {'yes' if equal else 'NO'} |"
        )
    out.append("\n### What limits each figure\n")
    out += [f"- {line}" for line in doc["limits"]]
    return "\n".join(out)


# --------------------------------------------------------------------------- main


def parser():
    ap = harness.script_parser(__doc__)
    ap.add_argument(
        "--shape",
        default="lfm2-1.2b",
        help=f"model shape: {', '.join(SHAPES)} (default lfm2-1.2b: transformers' config of LiquidAI/LFM2-1.2B;"
        " qwen3.5-0.8b: an assumed Qwen3.5-0.8B shape, not read from the real config.json: vocab 248320, hidden"
        " 1024, 24 layers of 3 Gated DeltaNet then 1 gated full attention, heads 8/2 x 256, partial rotary 0.25,"
        " DeltaNet heads 16/16 x 128, MLP 3584, tied embeddings; its attention-only twin is a Qwen3 of the same"
        " hidden, layers, heads, MLP width and vocabulary)",
    )
    ap.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=INT",
        help="change one integer of the shape's config (e.g. num_hidden_layers=8: the layer pattern's first"
        " ones), repeatable; the attention-only twin follows",
    )
    ap.add_argument("--precisions", default="fp32,int4", help="comma list of fp32, int4 (default fp32,int4)")
    ap.add_argument(
        "--forms",
        default="fused",
        help="comma list of graph forms: fused (head_major_inplace), portable (time_major; fp32 only) (default fused)",
    )
    ap.add_argument(
        "--apart",
        default="",
        help="comma list of precisions whose hybrid and attention-only models are measured one after the other"
        " instead of interleaved (one model on disk and in memory at a time; default none)",
    )
    ap.add_argument("--kinds", default="hybrid,attention", help="comma list of hybrid, attention (default both)")
    ap.add_argument("--past", type=int, default=600, help="cache positions before a timed verify call (default 600)")
    ap.add_argument("--gammas", default="4,8", help="draft lengths whose 1 + gamma-row calls are timed (default 4,8)")
    ap.add_argument("--ceiling-gamma", type=int, default=8, help="the replay proposer's fixed gamma (default 8)")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per ceiling generation (default 64)")
    ap.add_argument("--prompt-tokens", type=int, default=32, help="prompt length of the ceiling runs (default 32)")
    ap.add_argument(
        "--warmup-tokens",
        type=int,
        default=400,
        help="most tokens of the always-wrong warm-up run that lets the policy react (default 400)",
    )
    ap.add_argument("--repeats", type=int, default=7, help="measurements per figure; medians are reported (default 7)")
    ap.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads (default 2)")
    ap.add_argument(
        "--pool",
        choices=("shared", "own"),
        default="shared",
        help="shared: the models run on ONNX Runtime's process-wide thread pool, as the CLIs do (no idle pool"
        " spins while the other model runs); own: a pool per session (default shared)",
    )
    ap.add_argument("--max-rows", type=int, default=64, help="rows of one call the runtime's buffers hold (default 64)")
    ap.add_argument("--block-size", type=int, default=32, help="int4 block size (default 32)")
    ap.add_argument("--accuracy-level", type=int, default=4, help="int4 MatMulNBits accuracy_level (default 4)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights and token ids (default 0)")
    ap.add_argument(
        "--work", default=None, metavar="DIR", help="keep the graphs here and reuse them (default: a temporary folder)"
    )
    ap.add_argument("--json", default=None, metavar="OUT", help="write the machine, command, settings and figures here")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.gammas = harness.int_list(args.gammas, "--gammas")
    precisions = [p for p in args.precisions.split(",") if p]
    forms = [f for f in args.forms.split(",") if f]
    apart = {p for p in args.apart.split(",") if p}
    kinds = [k for k in args.kinds.split(",") if k]
    if any(k not in KINDS for k in kinds) or not kinds:
        raise HarnessError(f"--kinds takes a comma list of {', '.join(KINDS)}, got {args.kinds!r}")
    if any(p not in PRECISIONS for p in precisions) or not precisions:
        raise HarnessError(f"--precisions takes a comma list of {', '.join(PRECISIONS)}, got {args.precisions!r}")
    if any(f not in FORMS for f in forms) or not forms:
        raise HarnessError(f"--forms takes a comma list of {', '.join(FORMS)}, got {args.forms!r}")
    for name in ("repeats", "threads", "tokens", "prompt_tokens", "past", "ceiling_gamma"):
        if getattr(args, name) < 1:
            raise HarnessError(f"--{name.replace('_', '-')} must be at least 1")
    if max(args.gammas + [args.ceiling_gamma]) + 1 >= args.max_rows:
        raise HarnessError("--max-rows must exceed every 1 + gamma")
    cfg = shape_config(args.shape, args.override)
    meta = harness.run_metadata(None if argv is None else [__file__, *argv], **vars(args))
    meta["threads"] = args.threads
    max_context = max(
        args.past + max(args.gammas) + 8, args.prompt_tokens + args.warmup_tokens + args.ceiling_gamma + 8
    )
    print(harness.header(meta))
    doc_shape = describe(args.shape, cfg)
    print(f"threads: {args.threads} (pool {args.pool}); {doc_shape}; max_context {max_context}", flush=True)
    root = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="hybrid-mechanics-"))
    root.mkdir(parents=True, exist_ok=True)
    doc = {"meta": meta, "settings": {**vars(args)}, "shape": cfg, "models": [], "verify": [], "rollback": []}
    doc["shape_line"], doc["shape_note"] = doc_shape, ASSUMED.get(args.shape, "")
    doc["ceiling"] = []
    try:
        for precision in precisions:
            for form in forms:
                if precision == "int4" and form != "fused":
                    print(f"skipped: int4 {form} (quantized targets are written in the fused form)", flush=True)
                    continue
                groups = [[k] for k in kinds] if precision in apart else [kinds]
                for kinds in groups:
                    measure_group(kinds, precision, form, cfg, max_context, args, root, doc)
    finally:
        if not args.work:
            shutil.rmtree(root, ignore_errors=True)
    doc["limits"] = limits(doc["verify"], doc["rollback"], doc["ceiling"], args.ceiling_gamma)
    print(report(doc))
    if args.json:
        harness.write_json(args.json, doc)
    return 0


def measure_group(kinds, precision, form, cfg, max_context, args, root: Path, doc: dict) -> None:
    graphs = []
    for kind in kinds:
        print(f"building {kind} {precision} {form} ...", flush=True)
        graph = build_graph(kind, precision, form, cfg, max_context, args, root)
        print(
            f"  {graph.params / 1e6:.0f} M parameters, {graph.bytes / 2**30:.2f} GiB, {graph.build_seconds:.0f} s",
            flush=True,
        )
        graphs.append(graph)
        doc["models"].append(
            {"model": graph.label, "parameters": graph.params, "bytes": graph.bytes, "build_s": graph.build_seconds}
        )
    subjects = [load_subject(g, max_context, args) for g in graphs]
    label = " and ".join(s.label for s in subjects)
    print(f"verify cost: {label}", flush=True)
    doc["verify"] += verify_cost(subjects, args)
    print(f"rollback rounds: {label}", flush=True)
    doc["rollback"] += rollback_rounds(subjects, args)
    print(f"ceiling: {label}", flush=True)
    doc["ceiling"] += ceiling(subjects, args)
    del subjects
    gc.collect()
    if not args.work:
        for g in graphs:
            shutil.rmtree(g.path.parent, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(harness.cli(main))
