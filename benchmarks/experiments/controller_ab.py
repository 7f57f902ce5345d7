"""Gamma policies of the adaptive controller against each other and a fixed gamma, in one run.

    python benchmarks/experiments/controller_ab.py ARTIFACT [--proposer hybrid] [--tolerances 0,0.03]
        [--fixed 8] [--prompts all] [--limit 3] [--max-new-tokens 128] [--repeats 1] [--threads 2] [--json OUT]

One generator per controller setting (GeneratorConfig.controller, here gamma_tolerance:
0 takes the gamma of best expected speedup, t > 0 the longest gamma within t of it), all on the
same ONNX Runtime sessions (generators loaded separately ran ~5% apart on this CPU, which once
passed for a policy effect), each keeping its controllers between prompts as an application would;
speculation off and a fixed gamma run beside them. The run follows specexport.bench.harness: one
warm-up generation per setting on a prompt outside the set, then prompt by prompt every setting
back to back in a rotated order, each generator's store of earlier answers emptied before every
generation. tok/s is end to end (prefill included); the speedup of a setting is the median over
prompts of its per-prompt ratio to off (95% bootstrap interval), over all prompts and by domain.
Greedy outputs are checked against target-only (exit 1 if any differs).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "runtime"))

from specexport.bench import harness  # noqa: E402


def parser():
    ap = harness.script_parser(__doc__)
    ap.add_argument("artifact", help="artifact folder (specexport build)")
    ap.add_argument("--proposer", default=None, help="draft | ngram | hybrid (default: the artifact's)")
    ap.add_argument("--tolerances", default="0,0.03", help="comma list of gamma_tolerance values (default 0,0.03)")
    ap.add_argument("--fixed", type=int, default=8, help="the fixed gamma to compare with (0 = none; default 8)")
    harness.add_run_options(ap, prompts="all", limit=3, max_new_tokens=128, repeats=1, threads=2)
    return ap


def main(argv=None) -> int:
    args = harness.parse_args(parser(), argv)
    from specexport.bench.harness_workers import SPECEXPORT_MEMORY, generation_row
    from specexport_runtime.api import SpecGenerator, load

    tolerances = [float(t) for t in args.tolerances.split(",") if t.strip()]
    meta = harness.run_metadata(None if argv is None else [__file__, *argv], **vars(args))
    first = load(args.artifact, threads=args.threads, shared_pool=True)
    proposer = first.resolve_proposer(args.proposer)
    prompts = harness.load_prompt_set(args.prompts, limit=args.limit)

    def method(name: str, gen, mode: str, gamma: int | None = None) -> harness.Method:
        def run(case: harness.Case) -> dict:
            return generation_row(gen, case.ids, mode, args.max_new_tokens, gamma, domain=case.domain)

        return harness.Method(name, run, gen.forget_history, SPECEXPORT_MEMORY)

    methods = [method("off", first, "off")]
    if args.fixed:
        methods.append(method(f"fixed {args.fixed}", first, proposer, args.fixed))
    for tol in tolerances:  # the same sessions (a second load's sessions ran ~5% apart), own controllers
        gen = SpecGenerator(
            root=first.root,
            manifest=first.manifest,
            codec=first.codec,
            target=first.target,
            draft=first.draft,
            calibration=first.calibration,
            config=first.config.replace(controller={"gamma_tolerance": tol}),
        )
        methods.append(method(f"tolerance {tol:g}", gen, proposer))
    cases = harness.make_cases(first.codec, prompts)
    run = harness.run_interleaved(
        methods,
        cases,
        harness.warmup_case(first.codec, 8),
        args.repeats,
        progress=lambda s: print(f"  {s.case:<20} {s.method:<16}", file=sys.stderr),
    )
    domain_of = {c.id: c.domain for c in cases}
    domains = list(dict.fromkeys(domain_of.values()))
    rows = []
    for m in methods[1:]:
        ratio = run.ratio(m.name, "off", harness.wall_tok_s)
        by_domain = harness.by_domain(ratio["per_case"], domain_of)
        same, total = run.same_tokens(m.name, "off")
        rows.append(
            {
                "setting": m.name,
                "speedup": ratio["median"],
                "ci95": ratio["ci95"],
                "by_domain": by_domain,
                "identical": same,
                "prompts": total,
            }
        )
    mismatches = sum(r["prompts"] - r["identical"] for r in rows)
    print(
        harness.preamble(
            meta,
            run,
            f"{len(cases)} prompts x {args.repeats}, {args.max_new_tokens} new tokens, "
            f"greedy, proposer {proposer}; off {run.median('off', harness.wall_tok_s):.1f} tok/s; "
            f"median per-prompt speedup over off; outputs differing from off: {mismatches}",
        )
    )
    print(f"{'setting':<16}{'all':>8}  {'[95% CI]':<13}" + "".join(f"{d:>12}" for d in domains))
    for r in rows:
        ci = harness.ci_cell(r["ci95"])
        cells = "".join(f"{r['by_domain'][d]:>11.2f}x" for d in domains)
        print(f"{r['setting']:<16}{r['speedup']:>7.2f}x  {ci:<13}{cells}")
    if args.json:
        harness.write_json(args.json, {"meta": meta, "rows": rows, "run": run.to_dict()})
    return 1 if mismatches else 0


if __name__ == "__main__":
    raise SystemExit(harness.cli(main))
