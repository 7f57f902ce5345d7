"""Gamma policies of the adaptive controller against each other and a fixed gamma, in one run.

    python benchmarks/controller_ab.py ARTIFACT [--proposer hybrid] [--tolerances 0,0.03]
        [--fixed 8] [--prompts all] [--limit 3] [--max-new-tokens 128] [--repeats 1] [--threads 2]

One generator per controller setting (GeneratorConfig.controller, here gamma_tolerance:
0 takes the gamma of best expected speedup, t > 0 the longest gamma within t of it), all on the
same ONNX Runtime sessions (generators loaded separately ran ~5% apart on this CPU, which once
passed for a policy effect), each keeping its controllers between prompts as an application would;
speculation off and a fixed gamma run beside them. For every prompt all settings run back to back
in a rotating order, so host drift spreads over them; tok/s is end to end (prefill included) and greedy outputs are checked
against target-only. Prints the speedup of each setting over all prompts and by domain.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "runtime"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", help="artifact folder (specexport build)")
    ap.add_argument("--proposer", default=None, help="draft | ngram | hybrid (default: the artifact's)")
    ap.add_argument("--tolerances", default="0,0.03", help="comma list of gamma_tolerance values (default 0,0.03)")
    ap.add_argument("--fixed", type=int, default=8, help="the fixed gamma to compare with (0 = none; default 8)")
    ap.add_argument("--prompts", default="all", help="comma-separated domains, 'all', or JSONL files")
    ap.add_argument("--limit", type=int, default=3, help="prompts per domain (default 3)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1, help="passes over the prompts (default 1)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)

    from specexport.bench import prompt_ids, resolve_prompts
    from specexport_runtime.api import SpecGenerator, load

    tolerances = [float(t) for t in args.tolerances.split(",") if t]
    first = load(args.artifact, threads=args.threads, shared_pool=True)
    gens = {}
    for tol in tolerances:  # the same sessions (a second load's sessions ran ~5% apart), own controllers
        gen = SpecGenerator(first.root, first.manifest, first.codec, first.target, first.draft, first.calibration,
                            first.config.replace(controller={"gamma_tolerance": tol}))
        gens[f"tolerance {tol:g}"] = gen
    prompts = resolve_prompts([s for s in args.prompts.split(",") if s], limit=args.limit)
    settings = ["off"] + ([f"fixed {args.fixed}"] if args.fixed else []) + list(gens)
    ids = [prompt_ids(first, p) for p in prompts]
    first.generate(ids[0], max_new_tokens=8, speculative=False)  # warm-up, not timed
    totals = {s: [0, 0.0] for s in settings}
    by_domain: dict[tuple[str, str], list] = {}
    outputs: dict[tuple[int, str], list[int]] = {}
    for rep in range(args.repeats):
        for i, (prompt, prompt_ids_) in enumerate(zip(prompts, ids)):
            k = (i + rep) % len(settings)
            for setting in settings[k:] + settings[:k]:
                gen = gens.get(setting, first)
                kw = dict(max_new_tokens=args.max_new_tokens, domain=prompt.domain)
                if setting == "off":
                    kw["speculative"] = False
                else:
                    kw["proposer"] = args.proposer
                    if setting.startswith("fixed"):
                        kw["gamma"] = args.fixed
                start = time.perf_counter()
                result = gen.generate(prompt_ids_, **kw)
                seconds = time.perf_counter() - start
                tokens = outputs[(i, setting)] = list(result.token_ids)
                for key in (setting, (prompt.domain, setting)):
                    row = totals[key] if isinstance(key, str) else by_domain.setdefault(key, [0, 0.0])
                    row[0] += len(tokens)
                    row[1] += seconds
            print(f"  {rep + 1}/{args.repeats} {prompt.id}", file=sys.stderr, flush=True)
    mismatches = sum(tokens != outputs[(i, "off")] for (i, s), tokens in outputs.items())
    rate = lambda row: row[0] / row[1]  # noqa: E731
    off = rate(totals["off"])
    print(f"{len(prompts)} prompts x {args.repeats}, {args.max_new_tokens} new tokens, greedy, proposer"
          f" {args.proposer or first.default_proposer}; off {off:.1f} tok/s; outputs differing from off: {mismatches}")
    domains = list(dict.fromkeys(p.domain for p in prompts))
    print(f"{'setting':<16}{'all':>8}" + "".join(f"{d:>12}" for d in domains))
    for s in settings[1:]:
        cells = "".join(f"{rate(by_domain[(d, s)]) / rate(by_domain[(d, 'off')]):>11.2f}x" for d in domains)
        print(f"{s:<16}{rate(totals[s]) / off:>7.2f}x{cells}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    raise SystemExit(main())
