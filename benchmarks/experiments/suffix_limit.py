"""Which suffix draft limit pays on a target: fixed limits against the runtime's tuned one.

    python benchmarks/experiments/suffix_limit.py ARTIFACT --prompts copy_edit --limit 32 \\
        --configs 1/16,2/32,auto [--repeats 1] [--threads 2] [--json OUT]

On one loaded generator, target-only and the suffix proposer in every configuration run as
methods of a specexport.bench.harness run: one warm-up generation each on a prompt outside the set,
then prompt by prompt every method back to back in a rotated order, the store of earlier answers
emptied before every generation. A configuration is FACTOR/MAX_SPEC (a fixed limit:
SuffixConfig.fixed_limit(factor, max_spec)) or `auto` (the default SuffixConfig, whose limit
suffix.LimitTuner tunes); each has its own tuner, kept across its generations, so none learns
from another. Every prompt gets its prompt file's max_new_tokens unless --max-new-tokens is
given. Reports, per configuration, the
speedup over target-only as decode seconds summed over the prompts and as the median of the
per-prompt ratios of decode tok/s (with its 95% bootstrap interval), how many outputs equal
target-only's (greedy: all must), and for `auto` the tuner's state (scale -> tokens per second of
its replays, the fitted seconds per call and per row).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "runtime"))

from specexport.bench import harness  # noqa: E402


def config_of(spec: str):
    from specexport_runtime.suffix import SuffixConfig

    if spec == "auto":
        return SuffixConfig()
    factor, sep, max_spec = spec.partition("/")
    try:
        return SuffixConfig.fixed_limit(float(factor), int(max_spec))
    except ValueError as exc:
        raise harness.HarnessError(f"--configs {spec!r}: want FACTOR/MAX_SPEC or auto ({exc})") from None


def parser():
    ap = harness.script_parser(__doc__)
    ap.add_argument("artifact", type=Path, help="artifact folder (specexport build)")
    ap.add_argument(
        "--configs", default="1/16,2/32,auto", help="FACTOR/MAX_SPEC or auto, comma-separated (default %(default)s)"
    )
    harness.add_run_options(ap, prompts="copy_edit", limit=32, max_new_tokens=None, repeats=1, threads=2)
    return ap


def main(argv=None) -> int:
    args = harness.parse_args(parser(), argv)
    from specexport.bench.harness_workers import generation_row, inprocess_method
    from specexport.bench.prompts import DEFAULT_MAX_NEW_TOKENS
    from specexport_runtime.api import load
    from specexport_runtime.suffix import LimitTuner

    specs = [c.strip() for c in args.configs.split(",") if c.strip()]
    configs = {c: config_of(c) for c in specs}  # checked before the load
    meta = harness.run_metadata(None if argv is None else [__file__, *argv], **vars(args))
    gen = load(args.artifact, threads=args.threads, shared_pool=True)
    prompts = harness.load_prompt_set(args.prompts, limit=args.limit)
    tuners = {c: LimitTuner() for c in specs}
    new = args.max_new_tokens or DEFAULT_MAX_NEW_TOKENS  # cases carry their own limit when it is None
    learned = gen.learned("suffix")  # the store of earlier answers and the draft-limit tuner
    default_tuner = learned.tuner

    def suffix_run(spec: str):
        def run(case: harness.Case) -> dict:
            learned.tuner = tuners[spec]
            try:
                return generation_row(gen, case.ids, "suffix", case.max_new_tokens or new, suffix=configs[spec])
            finally:
                learned.tuner = default_tuner

        return run

    off = inprocess_method(gen, "off", "off", new)
    methods = [off] + [harness.Method(c, suffix_run(c), off.reset, off.memory) for c in specs]
    cases = harness.make_cases(gen.codec, prompts, per_prompt_limit=args.max_new_tokens is None)
    run = harness.run_interleaved(methods, cases, harness.warmup_case(gen.codec, 8), args.repeats)
    decode = {m.name: sum(s.result["decode_seconds"] for s in run.samples_of(m.name)) for m in methods}
    result = {
        "meta": meta,
        "artifact": str(args.artifact),
        "prompts": args.prompts,
        "count": len(prompts),
        "memory": run.memory_notes(),
        "configs": {},
    }
    for c in specs:
        ratio = run.ratio(c, "off", "tok_s")
        same, total = run.same_tokens(c, "off")
        result["configs"][c] = {
            "speedup": round(decode["off"] / decode[c], 3),
            "median_speedup": round(ratio["median"], 3),
            "median_speedup_ci95": ratio["ci95"],
            "identical": f"{same}/{total}",
            "tuner": tuners[c].describe(gen.verify_cost.line()) if len(configs[c].limit_scales) > 1 else None,
        }
    print(
        harness.preamble(
            meta,
            run,
            f"{len(prompts)} prompts ({args.prompts}), suffix proposer; speedup over "
            "target-only: summed decode seconds and the median per-prompt ratio [95% CI]",
        )
    )
    for c, r in result["configs"].items():
        ci = harness.ci_cell(r["median_speedup_ci95"])
        print(
            f"  {c:<10} {r['speedup']:.3f}x  median {r['median_speedup']:.3f}x {ci}  identical {r['identical']}"
            + (f"  tuner {r['tuner']}" if r["tuner"] else "")
        )
    if args.json:
        harness.write_json(args.json, {**result, "run": run.to_dict()})
    return 0


if __name__ == "__main__":
    raise SystemExit(harness.cli(main))
