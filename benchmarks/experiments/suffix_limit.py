"""Which suffix draft limit pays on a target: fixed limits against the runtime's tuned one.

    python benchmarks/suffix_limit.py ARTIFACT --prompts copy_edit --limit 32 \\
        --configs 1/16,2/32,auto [--threads 2] [--json OUT]

Each prompt runs target-only and then with the suffix proposer in every configuration, the order
alternating by prompt, on one loaded generator. A configuration is FACTOR/MAX_SPEC (a fixed limit:
SuffixConfig.fixed_limit(factor, max_spec)) or `auto` (the default SuffixConfig, whose limit
suffix.LimitTuner tunes). Every configuration gets its own tuner and an empty store of earlier
answers for each prompt, so none learns from another. Reports, per configuration, the speedup over
target-only as decode seconds summed over the prompts and as the median of the per-prompt ratios,
how many outputs equal target-only's (greedy: all must), and for `auto` the tuner's state
(scale -> tokens per second of its replays, the fitted seconds per call and per row).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from specexport_runtime.api import load
from specexport_runtime.suffix import LimitTuner, SuffixConfig

from specexport.bench import prompt_ids, resolve_prompts
from specexport.machine import cpu_model


def config_of(spec: str) -> SuffixConfig:
    if spec == "auto":
        return SuffixConfig()
    factor, max_spec = spec.split("/")
    return SuffixConfig.fixed_limit(float(factor), int(max_spec))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--prompts", default="copy_edit", help="prompt sets, comma-separated (bench --prompts)")
    ap.add_argument("--limit", type=int, default=32, help="prompts per set")
    ap.add_argument("--configs", default="1/16,2/32,auto", help="FACTOR/MAX_SPEC or auto, comma-separated")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    specs = args.configs.split(",")
    configs = {c: config_of(c) for c in specs}  # validated before the load
    gen = load(args.artifact, threads=args.threads, shared_pool=True)
    prompts = resolve_prompts(args.prompts.split(","), limit=args.limit)
    ids = [prompt_ids(gen, p) for p in prompts]
    gen.generate(ids[0], max_new_tokens=8, speculative=False)  # warm-up
    tuners = {c: LimitTuner() for c in specs}
    runs: dict[str, list[tuple[float, list[int]]]] = {c: [] for c in ["off", *specs]}
    for i, (p, x) in enumerate(zip(prompts, ids)):
        order = ["off", *specs] if i % 2 == 0 else ["off", *specs][::-1]
        for c in order:
            settings = {}
            if c != "off":
                gen.learned("suffix").tuner = tuners[c]
                gen.forget_history()
                settings = {"suffix": configs[c], "proposer": "suffix"}
            r = gen.generate(x, max_new_tokens=p.max_new_tokens, speculative=c != "off", **settings)
            runs[c].append((r.stats.total_seconds - r.stats.prefill_seconds, r.token_ids))
    base = runs["off"]
    result = {"artifact": str(args.artifact), "prompts": args.prompts, "count": len(prompts),
              "cpu": cpu_model(), "configs": {}}
    for c in specs:
        result["configs"][c] = {
            "speedup": round(sum(b[0] for b in base) / sum(r[0] for r in runs[c]), 3),
            "median_speedup": round(statistics.median(b[0] / r[0] for b, r in zip(base, runs[c])), 3),
            "identical": sum(b[1] == r[1] for b, r in zip(base, runs[c])),
            "tuner": tuners[c].describe() if len(configs[c].limit_scales) > 1 else None,
        }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
