"""Side by side on one CPU: transformers generate versus a specexport artifact.

    python benchmarks/compare_transformers.py ARTIFACT [--model builtin:smollm2-135m-instruct]
        [--prompts code,copy_edit] [--limit 3] [--max-new-tokens 96] [--threads 2] [--repeats 1]
        [--assistant MODEL] [--json OUT]

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
tok/s is end to end (new tokens / wall seconds, prefill included) for every method, so the
numbers are comparable across libraries. "identical" compares each method's tokens with hf
greedy (up to the first EOS, which is not counted). See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing


def _strip_eos(ids, eos: set[int]) -> list[int]:
    out = []
    for t in ids:
        if int(t) in eos:
            break
        out.append(int(t))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", help="artifact folder (specexport build)")
    ap.add_argument("--model", default="builtin:smollm2-135m-instruct",
                    help="transformers source of the same target (folder, .gguf, hub id or builtin:NAME)")
    ap.add_argument("--assistant", default=None, help="PyTorch draft model for hf assisted generation (optional)")
    ap.add_argument("--prompts", default="code,copy_edit", help="comma-separated domains or JSONL files")
    ap.add_argument("--limit", type=int, default=3, help="prompts per domain (default 3)")
    ap.add_argument("--max-new-tokens", type=int, default=96, help="tokens per prompt (default 96)")
    ap.add_argument("--gamma", type=int, default=4, help="specexport draft length (default 4)")
    ap.add_argument("--threads", type=int, default=2, help="torch and ONNX Runtime threads (default 2)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per prompt and method (default 1)")
    ap.add_argument("--json", default=None, help="write the rows as JSON to this file")
    args = ap.parse_args(argv)

    import torch
    from transformers import GenerationConfig

    from specexport.bench import prompt_ids, resolve_prompts
    from specexport.sources import load_model, load_tokenizer, resolve_source
    from specexport_runtime.api import load

    torch.set_num_threads(args.threads)
    prompts = resolve_prompts([s for s in args.prompts.split(",") if s], limit=args.limit)
    gen = load(args.artifact, threads=args.threads)
    eos = set(gen.manifest.tokenizer.eos_token_ids)
    source = resolve_source(args.model)
    model = load_model(source)
    tokenizer = load_tokenizer(source)
    assistant = load_model(resolve_source(args.assistant)) if args.assistant else None
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos))
    ids = {p.id: prompt_ids(gen, p) for p in prompts}

    def hf(options=None, **kwargs):
        def run(pid: str, n: int) -> list[int]:
            x = torch.tensor([ids[pid]], dtype=torch.long)
            config = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=sorted(eos), pad_token_id=pad,
                                      **(options or {}))
            with torch.inference_mode():
                out = model.generate(x, attention_mask=torch.ones_like(x), generation_config=config, **kwargs)
            return _strip_eos(out[0, x.shape[1]:].tolist(), eos)
        return run

    def se(**kwargs):
        def run(pid: str, n: int) -> list[int]:
            return gen.generate(ids[pid], max_new_tokens=n, **kwargs).token_ids
        return run

    methods = [("hf greedy", hf()), ("hf prompt lookup (10)", hf({"prompt_lookup_num_tokens": 10}))]
    if assistant is not None:
        methods.append(("hf assisted", hf(assistant_model=assistant)))
    methods.append(("specexport off", se(speculative=False)))
    if gen.draft is not None:
        methods.append((f"specexport draft (gamma {args.gamma})", se(proposer="draft", gamma=args.gamma)))
    methods.append((f"specexport ngram (gamma {args.gamma})", se(proposer="ngram", gamma=args.gamma)))

    warm = prompts[0].id
    for _, run in methods:  # warm-up: first-call allocations, lazy initialisation
        run(warm, 8)

    # prompts outer, methods inner in a rotating order: drift of a shared machine spreads evenly
    totals = {name: [0, 0.0] for name, _ in methods}
    outputs: dict[str, dict[str, list[int]]] = {name: {} for name, _ in methods}
    for i, p in enumerate(prompts):
        for rep in range(args.repeats):
            k = (i * args.repeats + rep) % len(methods)
            for name, run in methods[k:] + methods[:k]:
                t0 = time.perf_counter()
                out = run(p.id, args.max_new_tokens)
                totals[name][1] += time.perf_counter() - t0
                totals[name][0] += len(out)
                outputs[name][p.id] = out
                print(f"  {name:<28} {p.id:<16} {len(out):4d} tokens", file=sys.stderr)
    reference = outputs["hf greedy"]
    rows = []
    for name, _ in methods:
        tokens, seconds = totals[name]
        same = [outputs[name][p.id] == reference[p.id] for p in prompts]
        rows.append({"method": name, "tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
                     "identical": sum(same), "prompts": len(prompts)})
    base = rows[0]["tok_s"]
    print(f"\n{len(prompts)} prompts ({args.prompts}, {args.limit} per domain), greedy, max {args.max_new_tokens} new "
          f"tokens, {args.threads} threads, {args.repeats} repeat(s); tok/s end to end (prefill included)")
    print(f"{'method':<30} {'tok/s':>8} {'x hf greedy':>12}  identical to hf greedy")
    for r in rows:
        r["ratio"] = r["tok_s"] / base
        ident = "yes" if r["identical"] == r["prompts"] else f"no ({r['identical']}/{r['prompts']} prompts)"
        print(f"{r['method']:<30} {r['tok_s']:8.1f} {r['ratio']:11.2f}x  {ident}")
    if assistant is None:
        print("(hf assisted: no PyTorch draft given; the artifact's draft is an ONNX int8 copy. Use --assistant MODEL.)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
