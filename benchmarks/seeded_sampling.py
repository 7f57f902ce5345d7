"""Seeded noise against rejection sampling: acceptance and speed of sampled speculation, per domain.

    python benchmarks/seeded_sampling.py ARTIFACT [--proposer P] [--temperatures 0.7,1.0]
        [--gamma G] [--prompts all] [--limit 2] [--max-new-tokens 128] [--repeats 1] [--threads 2]
        [--json OUT]

Methods, per temperature T of --temperatures, all on one generator (the same ONNX Runtime
sessions), every request with a seed (the same seed for a prompt in every method):
  off T        the target alone (seeded noise: the reference tokens of `noise T`)
  rejection T  the proposer (default: the artifact's) with rejection sampling from the seed's
               stream (seeded_noise false; the gamma policy is then fixed, as today's seeded requests)
  noise T      the proposer with per-position seeded noise (seeded.py; the default for seeded
               requests; the gamma policy adaptive)
--gamma fixes gamma for both speculative methods instead (the same policy for both). The run
follows specexport.bench.harness (warm-up outside the set, prompt by prompt every method back to back
in a rotated order, the suffix store emptied before every generation). Figures per method:
acceptance (accepted / drafted), tokens per verify call (accepted + 1 over rounds), the median
per-prompt speedup over `off T` (95% bootstrap interval) and by domain; `noise T`'s outputs are
compared with `off T`'s (exit 1 if any differs: with fp32 targets the equality is numerical,
not bitwise, docs/performance.md).
"""

from __future__ import annotations

import sys
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "runtime"))

from specexport.bench import harness  # noqa: E402


def parser():
    ap = harness.script_parser(__doc__)
    ap.add_argument("artifact", help="artifact folder (specexport build)")
    ap.add_argument("--proposer", default=None, help="proposer of the speculative methods (default: the artifact's)")
    ap.add_argument("--temperatures", default="0.7,1.0", help="comma list of temperatures > 0 (default 0.7,1.0)")
    ap.add_argument(
        "--gamma", type=int, default=None, help="fixed gamma for both speculative methods (default: each one's policy)"
    )
    harness.add_run_options(ap, prompts="all", limit=2, max_new_tokens=128, repeats=1, threads=2)
    return ap


def _temperatures(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or any(not 0 < t <= 2 for t in values):
        raise harness.HarnessError(f"--temperatures must be a comma list of numbers in (0, 2], got {text!r}")
    return values


def _sum(run, method: str, key: str) -> float:
    return sum(s.result[key] for s in run.samples if s.method == method)


def main(argv=None) -> int:
    args = harness.parse_args(parser(), argv)
    from specexport.bench.harness_workers import SPECEXPORT_MEMORY, generation_row
    from specexport_runtime.api import load

    temps = _temperatures(args.temperatures)
    meta = harness.run_metadata(None if argv is None else [__file__, *argv], **vars(args))
    gen = load(args.artifact, threads=args.threads, shared_pool=True)
    proposer = args.proposer or gen.config.proposer
    prompts = harness.load_prompt_set(args.prompts, limit=args.limit)

    def method(name: str, mode: str, temperature: float, noise: bool) -> harness.Method:
        def run(case: harness.Case) -> dict:
            seed = zlib.crc32(case.id.encode())  # one seed per prompt, the same in every method
            opts = dict(temperature=temperature, seed=seed, seeded_noise=noise)
            return generation_row(gen, case.ids, mode, args.max_new_tokens, args.gamma, **opts)

        return harness.Method(name, run, gen.forget_history, SPECEXPORT_MEMORY)

    methods = []
    for t in temps:
        methods += [method(f"off {t}", "off", t, True), method(f"rejection {t}", proposer, t, False)]
        methods.append(method(f"noise {t}", proposer, t, True))
    cases = harness.make_cases(gen.codec, prompts)
    run = harness.run_interleaved(
        methods,
        cases,
        harness.warmup_case(gen.codec, 8),
        args.repeats,
        progress=lambda s: print(f"  {s.case:<20} {s.method:<14}", file=sys.stderr),
    )
    domain_of = {c.id: c.domain for c in cases}
    domains = list(dict.fromkeys(domain_of.values()))
    rows, mismatches = [], 0
    for m in methods:
        if m.name.startswith("off"):
            continue
        off = "off " + m.name.split()[1]
        rounds, drafted = _sum(run, m.name, "rounds"), _sum(run, m.name, "drafted")
        ratio = run.ratio(m.name, off, harness.wall_tok_s)
        row = {
            "method": m.name,
            "acceptance": _sum(run, m.name, "accepted") / drafted if drafted else None,
            "tokens_per_call": (_sum(run, m.name, "accepted") + rounds) / rounds if rounds else None,
            "tok_s": run.median(m.name, harness.wall_tok_s),
            "off_tok_s": run.median(off, harness.wall_tok_s),
            "vs_off": ratio["median"],
            "vs_off_ci95": ratio["ci95"],
            "vs_off_by_domain": harness.by_domain(ratio["per_case"], domain_of),
        }
        if m.name.startswith("noise"):
            same, total = run.same_tokens(m.name, off, gen.eos)
            row["identical"] = f"{same}/{total}"
            mismatches += total - same
        rows.append(row)
    print(
        harness.preamble(
            meta,
            run,
            f"{len(cases)} prompts x {args.repeats}, {args.max_new_tokens} new tokens, proposer {proposer},"
            f" gamma {args.gamma or 'policy'}; median per-prompt speedups over the target alone at the same"
            f" temperature; noise outputs differing from off: {mismatches}",
        )
    )
    head = f"{'method':<16}{'accept':>7}{'tok/call':>9}{'tok/s':>7}{'off':>7}{'vs off':>8}  {'[95% CI]':<13}"
    print(head + "".join(f"{d:>11}" for d in domains))
    for r in rows:
        print(
            f"{r['method']:<16}{r['acceptance'] or 0:>7.2f}{r['tokens_per_call'] or 0:>9.2f}{r['tok_s']:>7.1f}"
            f"{r['off_tok_s']:>7.1f}{r['vs_off']:>7.2f}x  {harness.ci_cell(r['vs_off_ci95']):<13}"
            + "".join(f"{r['vs_off_by_domain'][d]:>10.2f}x" for d in domains)
        )
    if args.json:
        harness.write_json(args.json, {"meta": meta, "rows": rows, "run": run.to_dict()})
    return 1 if mismatches else 0


if __name__ == "__main__":
    raise SystemExit(harness.cli(main))
