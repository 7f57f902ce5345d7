"""Side by side on one CPU, interleaved prompt by prompt: transformers generate versus a specexport artifact.

    python benchmarks/compare_transformers.py ARTIFACT [--model builtin:smollm2-135m-instruct]
        [--prompts code,copy_edit] [--limit 3] [--max-new-tokens 96] [--threads 2] [--repeats 1]
        [--gamma 4] [--assistant MODEL] [--json OUT]

One process, the same prompt token ids (the artifact's chat template) and greedy decoding for
every method:
    hf greedy          model.generate(do_sample=False)
    hf prompt lookup   the same with prompt_lookup_num_tokens=10
    hf assisted        the same with assistant_model=MODEL, only with --assistant (the default
                       artifact's draft is an int8 ONNX copy of the target, which has no
                       PyTorch form, so there is none by default)
    specexport off     the artifact's target alone (speculative=False)
    specexport draft   speculation with the artifact's draft model (fixed --gamma, default 4)
    specexport ngram   speculation with n-gram prompt lookup (same gamma)
The run follows specexport.bench.harness: one short warm-up generation per method on a prompt outside
the measured set; then prompt by prompt, each repeat runs every method back to back in a rotated
order; specexport's suffix store is emptied before every generation (transformers keeps nothing
between calls). tok/s is end to end (new tokens / wall seconds of the call, prefill included),
the only definition that means the same for both libraries: per prompt the median over repeats,
then the median over prompts. `x hf greedy` is the median over prompts of the per-prompt ratio
with its 95% bootstrap interval; "identical" counts prompts whose tokens equal hf greedy's (up to
the first EOS, which is not counted). See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing
sys.path.insert(0, str(REPO / "runtime"))

from specexport.bench import harness  # noqa: E402

WARMUP_TOKENS = 8


def parser() -> argparse.ArgumentParser:
    ap = harness.script_parser(__doc__)
    ap.add_argument("artifact", help="artifact folder (specexport build)")
    ap.add_argument(
        "--model",
        default="builtin:smollm2-135m-instruct",
        help="transformers source of the same target (folder, .gguf, hub id or builtin:NAME)",
    )
    ap.add_argument("--assistant", default=None, help="PyTorch draft model for hf assisted generation (optional)")
    ap.add_argument("--gamma", type=int, default=4, help="specexport draft length (default 4)")
    harness.add_run_options(ap, prompts="code,copy_edit", limit=3, max_new_tokens=96, repeats=1, threads=2)
    return ap


def main(argv=None) -> int:
    args = harness.parse_args(parser(), argv)

    import torch
    from transformers import GenerationConfig

    from specexport.bench.harness_workers import inprocess_method
    from specexport.models.sources import load_model, load_tokenizer, resolve_source
    from specexport_runtime.api import load

    torch.set_num_threads(args.threads)
    prompts = harness.load_prompt_set(args.prompts, limit=args.limit)
    meta = harness.run_metadata(None if argv is None else [__file__, *argv], **vars(args))
    gen = load(args.artifact, threads=args.threads)
    eos = set(gen.manifest.tokenizer.eos_token_ids)
    source = resolve_source(args.model)
    model = load_model(source)
    tokenizer = load_tokenizer(source)
    assistant = load_model(resolve_source(args.assistant)) if args.assistant else None
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos))

    def hf(name: str, options=None, **kwargs) -> harness.Method:
        def run(case: harness.Case) -> dict:
            x = torch.tensor([case.ids], dtype=torch.long)
            config = GenerationConfig(
                max_new_tokens=case.max_new_tokens or args.max_new_tokens,
                do_sample=False,
                eos_token_id=sorted(eos),
                pad_token_id=pad,
                **(options or {}),
            )
            with torch.inference_mode():
                out = model.generate(x, attention_mask=torch.ones_like(x), generation_config=config, **kwargs)
            return {"tokens": harness.until_eos(out[0, x.shape[1] :].tolist(), eos)}

        return harness.Method(name, run, info={"engine": "transformers"})

    methods = [hf("hf greedy"), hf("hf prompt lookup (10)", {"prompt_lookup_num_tokens": 10})]
    if assistant is not None:
        methods.append(hf("hf assisted", assistant_model=assistant))
    methods.append(inprocess_method(gen, "specexport off", "off", args.max_new_tokens))
    if gen.draft is not None:
        methods.append(
            inprocess_method(gen, f"specexport draft (gamma {args.gamma})", "draft", args.max_new_tokens, args.gamma)
        )
    methods.append(
        inprocess_method(gen, f"specexport ngram (gamma {args.gamma})", "ngram", args.max_new_tokens, args.gamma)
    )

    def progress(s: harness.Sample) -> None:
        print(f"  {s.method:<28} {s.case:<16} {len(s.result['tokens']):4d} tokens", file=sys.stderr)

    run = harness.run_interleaved(
        methods,
        harness.make_cases(gen.codec, prompts),
        harness.warmup_case(gen.codec, WARMUP_TOKENS),
        args.repeats,
        progress=progress,
    )
    rows = []
    for m in methods:
        ratio = run.ratio(m.name, "hf greedy", harness.wall_tok_s)
        same, total = run.same_tokens(m.name, "hf greedy")
        rows.append(
            {
                "method": m.name,
                "tok_s": run.median(m.name, harness.wall_tok_s),
                "ratio": ratio["median"],
                "ratio_ci95": ratio["ci95"],
                "identical": same,
                "prompts": total,
            }
        )
    print(
        harness.preamble(
            meta,
            run,
            f"{len(prompts)} prompts ({args.prompts}, {args.limit} per domain), greedy, "
            f"max {args.max_new_tokens} new tokens, {args.threads} threads, {args.repeats} repeat(s), "
            "interleaved prompt by prompt; tok/s end to end (prefill included), median over prompts",
        )
    )
    print(f"{'method':<30} {'tok/s':>8} {'x hf greedy':>12}  {'[95% CI]':<13}  identical to hf greedy")
    for r in rows:
        ident = "yes" if r["identical"] == r["prompts"] else f"no ({r['identical']}/{r['prompts']} prompts)"
        ci = harness.ci_cell(r["ratio_ci95"])
        print(f"{r['method']:<30} {r['tok_s']:8.1f} {r['ratio']:11.2f}x  {ci:<13}  {ident}")
    if assistant is None:
        print(
            "(hf assisted: no PyTorch draft given; the artifact's draft is an ONNX int8 copy. Use --assistant MODEL.)"
        )
    if args.json:
        harness.write_json(args.json, {"meta": meta, "rows": rows, "run": run.to_dict()})
    return 0


if __name__ == "__main__":
    raise SystemExit(harness.cli(main))
