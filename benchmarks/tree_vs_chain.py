"""Draft trees against draft chains from the same proposer, per domain, in one run.

    python benchmarks/tree_vs_chain.py ARTIFACT [--proposer suffix] [--nodes 8,16,32] [--gamma G]
        [--prompts all] [--limit 3] [--max-new-tokens 128] [--repeats 1] [--threads 2] [--json OUT]

ARTIFACT must hold a tree graph (`specexport build ... --tree-verify`); with --proposer eagle
(EAGLE-3 head trees against the same head's chains) also the head's tree graph, which a build
with an EAGLE-3 head and tree_verify writes. --gamma fixes the chain length and the eagle tree
depth (default: the artifact's gamma policy, adaptive). Methods, all on one
generator (the same ONNX Runtime sessions): off (target only), chain (the proposer drafting
chains: tree_nodes 0) and tree N for each N of --nodes (drafts of up to N tokens as trees,
verified in one tree-graph call). The run follows specexport.bench.harness: a warm-up generation per
method on a prompt outside the set, then prompt by prompt every method back to back in a
rotated order, the suffix store of earlier answers emptied before every generation. Figures per
method: the median per-prompt speedup over off and over chain (95% bootstrap interval), by
domain; tokens per verify call (accepted + 1 over rounds: the mean accepted length plus the
target's token); drafted rows per verify call; milliseconds per target call (verify and plain
steps together); the share of rounds verified as trees. Greedy outputs are compared with off's
(exit 1 if any differs; a tree graph's rows are numerically, not bitwise, the chain graph's).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "runtime"))

from specexport.bench import harness  # noqa: E402


def parser():
    ap = harness.script_parser(__doc__)
    ap.add_argument("artifact", help="artifact folder with a tree graph (specexport build --tree-verify)")
    ap.add_argument(
        "--proposer", default="suffix", help="a proposer that drafts trees: suffix, hybrid or eagle (default suffix)"
    )
    ap.add_argument("--gamma", type=int, default=None, help="fixed draft length / eagle tree depth (default adaptive)")
    ap.add_argument("--nodes", default="8,16,32", help="comma list of tree sizes (drafted tokens; default 8,16,32)")
    harness.add_run_options(ap, prompts="all", limit=3, max_new_tokens=128, repeats=1, threads=2)
    return ap


def _sum(run, method: str, key: str) -> float:
    return sum(s.result[key] for s in run.samples if s.method == method)


def main(argv=None) -> int:
    args = harness.parse_args(parser(), argv)
    from specexport.bench.harness_workers import SPECEXPORT_MEMORY, generation_row
    from specexport_runtime.api import load

    sizes = harness.int_list(args.nodes, "--nodes")
    meta = harness.run_metadata(None if argv is None else [__file__, *argv], **vars(args))
    gen = load(args.artifact, threads=args.threads, shared_pool=True)
    if gen.tree is None:
        raise SystemExit(f"{args.artifact} has no tree graph: build it with --tree-verify")
    if args.proposer == "eagle" and gen.head_tree is None:
        raise SystemExit(f"{args.artifact} has no EAGLE-3 head tree graph: build its head recipe with --tree-verify")
    prompts = harness.load_prompt_set(args.prompts, limit=args.limit)

    def method(name: str, mode: str, nodes: int = 0) -> harness.Method:
        def run(case: harness.Case) -> dict:
            extra = {"tree_nodes": nodes} if mode != "off" else {}
            return generation_row(gen, case.ids, mode, args.max_new_tokens, args.gamma, **extra)

        return harness.Method(name, run, gen.forget_history, SPECEXPORT_MEMORY)

    methods = [method("off", "off"), method("chain", args.proposer)]
    methods += [method(f"tree {n}", args.proposer, n) for n in sizes]
    cases = harness.make_cases(gen.codec, prompts)
    run = harness.run_interleaved(
        methods,
        cases,
        harness.warmup_case(gen.codec, 8),
        args.repeats,
        progress=lambda s: print(f"  {s.case:<20} {s.method:<10}", file=sys.stderr),
    )
    domain_of = {c.id: c.domain for c in cases}
    domains = list(dict.fromkeys(domain_of.values()))
    rows = []
    for m in methods[1:]:
        rounds = _sum(run, m.name, "rounds")
        calls = _sum(run, m.name, "calls")
        row = {"method": m.name, "identical": run.same_tokens(m.name, "off")[0], "prompts": len(cases)}
        for base in ("off", "chain"):
            if base == m.name:
                continue
            ratio = run.ratio(m.name, base, harness.wall_tok_s)
            row[f"vs_{base}"] = ratio["median"]
            row[f"vs_{base}_ci95"] = ratio["ci95"]
            row[f"vs_{base}_by_domain"] = harness.by_domain(ratio["per_case"], domain_of)
        row["tokens_per_call"] = (_sum(run, m.name, "accepted") + rounds) / rounds if rounds else None
        row["rows_per_call"] = _sum(run, m.name, "drafted") / rounds + 1 if rounds else None
        row["ms_per_target_call"] = 1000 * _sum(run, m.name, "target_seconds") / calls if calls else None
        row["tree_share"] = _sum(run, m.name, "tree_rounds") / rounds if rounds else 0.0
        rows.append(row)
    mismatches = sum(r["prompts"] - r["identical"] for r in rows)
    print(
        harness.preamble(
            meta,
            run,
            f"{len(cases)} prompts x {args.repeats}, {args.max_new_tokens} new tokens, greedy, proposer"
            f" {args.proposer}; off {run.median('off', harness.wall_tok_s):.1f} tok/s; median per-prompt"
            f" speedups; outputs differing from off: {mismatches}",
        )
    )
    head = f"{'method':<10}{'vs off':>8}  {'[95% CI]':<13}{'vs chain':>9}  {'[95% CI]':<13}"
    print(head + f"{'tok/call':>9}{'rows/call':>10}{'ms/call':>8}{'trees':>7}" + "".join(f"{d:>12}" for d in domains))
    for r in rows:
        cells = []
        for base in ("off", "chain"):
            if f"vs_{base}" in r:
                ci = harness.ci_cell(r[f"vs_{base}_ci95"])
                cells.append(f"{r[f'vs_{base}']:>7.2f}x  {ci:<13}")
            else:
                cells.append(f"{'-':>8}  {'':<13}")
        stats = (
            f"{r['tokens_per_call'] or 0:>9.2f}{r['rows_per_call'] or 0:>10.2f}"
            f"{r['ms_per_target_call'] or 0:>8.1f}{r['tree_share']:>7.0%}"
        )
        key = "vs_chain_by_domain" if "vs_chain" in r else "vs_off_by_domain"
        print(f"{r['method']:<10}{''.join(cells)}{stats}" + "".join(f"{r[key][d]:>11.2f}x" for d in domains))
    print("by domain: the tree rows' speedup over chain, the chain row's over off")
    if args.json:
        harness.write_json(args.json, {"meta": meta, "rows": rows, "run": run.to_dict()})
    return 1 if mismatches else 0


if __name__ == "__main__":
    raise SystemExit(harness.cli(main))
