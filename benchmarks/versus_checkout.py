"""This checkout's runtime against another checkout's on the same artifact, prompt by prompt.

    python benchmarks/versus_checkout.py BASELINE_CHECKOUT ARTIFACT [--current-artifact ART]
        [--modes off,hybrid] [--prompts all] [--limit 3] [--max-new-tokens 128] [--repeats 1]
        [--threads 2] [--json OUT]

What a change cost the paths it did not mean to touch (the chain path after tree verify, say):
BASELINE_CHECKOUT is a source tree of specexport at an earlier commit (`git worktree add
/tmp/base REF`); ARTIFACT an artifact it can load (built by it, or older). Each side runs in a
worker process of its own (specexport.bench.harness_workers, the same line protocol at both commits),
one generation at a time, so the other side's process sits idle:
    baseline MODE      the baseline checkout's runtime on ARTIFACT
    current MODE       this checkout's runtime on ARTIFACT
    current-build MODE this checkout's runtime on --current-artifact (the same recipe built by
                       this checkout: what its builder changed shows here), if given
for each MODE of --modes ("off": target only, or a proposer name). The run follows
specexport.bench.harness: a warm-up per method outside the set, then prompt by prompt every method
back to back in a rotated order, the suffix store emptied before every generation. Figures per
method: the median per-prompt tok/s ratio to `baseline MODE` with its 95% bootstrap interval.
Greedy outputs are compared with `baseline off` (with `baseline MODE` where off is not run; exit 1
if any differs).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "runtime"))

from specexport.bench import harness  # noqa: E402


def parser():
    ap = harness.script_parser(__doc__)
    ap.add_argument("baseline", type=Path, help="a specexport source tree at the baseline commit (git worktree add)")
    ap.add_argument("artifact", type=Path, help="an artifact both checkouts can load")
    ap.add_argument(
        "--current-artifact", type=Path, default=None, help="the same recipe built by this checkout (optional)"
    )
    ap.add_argument("--modes", default="off,hybrid", help="comma list: off and/or proposer names (default off,hybrid)")
    harness.add_run_options(ap, prompts="all", limit=3, max_new_tokens=128, repeats=1, threads=2)
    return ap


def main(argv=None) -> int:
    args = harness.parse_args(parser(), argv)
    from specexport.bench.harness_workers import SpecexportWorker
    from specexport_runtime.api import open_artifact

    base = args.baseline.resolve()
    if not any((base / "specexport" / p / "harness_workers.py").is_file() for p in ("bench", ".")):
        raise SystemExit(f"{base} is not a specexport checkout with a harness_workers.py")
    modes = [m for m in args.modes.split(",") if m]
    if not modes:
        raise SystemExit("--modes needs at least one mode")
    meta = harness.run_metadata(None if argv is None else [__file__, *argv], **vars(args))
    _, codec, _ = open_artifact(args.artifact, verify=False)
    cases = harness.make_cases(codec, harness.load_prompt_set(args.prompts, limit=args.limit))
    sides = [("baseline", base, args.artifact), ("current", None, args.artifact)]  # None: this checkout
    if args.current_artifact is not None:
        sides.append(("current-build", None, args.current_artifact))
    with tempfile.TemporaryDirectory() as logs:
        workers = [
            SpecexportWorker(art, args.threads, Path(logs) / f"{n}.log", checkout=checkout)
            for n, checkout, art in sides
        ]
        try:
            methods = [
                w.method(f"{n} {mode}", mode, args.max_new_tokens)
                for (n, _, _), w in zip(sides, workers)
                for mode in modes
            ]
            run = harness.run_interleaved(
                methods,
                cases,
                harness.warmup_case(codec, 8),
                args.repeats,
                settle=harness.SETTLE_SECONDS,
                progress=lambda s: print(f"  {s.case:<20} {s.method}", file=sys.stderr),
            )
        finally:
            for w in workers:
                w.close()
    rows, mismatches = [], 0
    for m in methods:
        side, mode = m.name.split(" ", 1)
        same = run.same_tokens(m.name, "baseline off" if "off" in modes else f"baseline {mode}")[0]
        mismatches += len(cases) - same
        ratio = None if side == "baseline" else run.ratio(m.name, f"baseline {mode}", harness.wall_tok_s)
        rows.append(
            {
                "method": m.name,
                "tok_s": run.median(m.name, harness.wall_tok_s),
                "vs_baseline": None if ratio is None else ratio["median"],
                "vs_baseline_ci95": None if ratio is None else ratio["ci95"],
                "identical_to_baseline_off": same,
                "prompts": len(cases),
            }
        )
    print(
        harness.preamble(
            meta,
            run,
            f"{len(cases)} prompts x {args.repeats}, {args.max_new_tokens} new tokens, greedy; baseline {base};"
            f" median per-prompt ratios; outputs differing from baseline off: {mismatches}",
        )
    )
    print(f"{'method':<28}{'tok/s':>8}{'vs baseline':>13}  {'[95% CI]':<13}{'same':>6}")
    for r in rows:
        ci = harness.ci_cell(r["vs_baseline_ci95"], "")
        vs = f"{r['vs_baseline']:.3f}x" if r["vs_baseline"] is not None else "-"
        print(f"{r['method']:<28}{r['tok_s']:>8.1f}{vs:>13}  {ci:<13}{r['identical_to_baseline_off']:>4}/{len(cases)}")
    if args.json:
        harness.write_json(args.json, {"meta": meta, "rows": rows, "run": run.to_dict()})
    return 1 if mismatches else 0


if __name__ == "__main__":
    raise SystemExit(harness.cli(main))
