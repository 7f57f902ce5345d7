"""What a verify row and a draft step cost on a target, and the acceptance speculation then needs.

    python benchmarks/verify_cost.py ARTIFACT [ARTIFACT ...] [--past 200] [--sizes 1,2,3,4,5,9]
        [--repeats 5] [--calls 20] [--threads 2] [--speedups 1.2,1.3,1.5] [--json OUT]

For each artifact, on one loaded generator (one shared thread pool, as `specexport bench` and the
runtime CLI run it): the median seconds
of a target call over S rows at a --past-token cache (S = 1 is the decode step), interleaved
across artifacts and sizes, each size's best median over --repeats; and the median seconds of the
artifact's draft step (one row of its draft model or EAGLE-3 head at the same cache length).
Reported per artifact: v(S), the S-row call over the 1-row step; r, the mean cost of one more row
((v(max S) - 1) / (max S - 1)); c, the draft step over the target step; and for each --speedups
goal the per-token acceptance alpha that a round of the best gamma needs to reach it, by the
bench's own round model (bench_stats.theoretical_speedup: E / (gamma c + v(gamma + 1)), E =
sum alpha^i). Proposers that cost nothing (lookup, suffix) are the c = 0 column.

Tokens are random ids (costs do not depend on the text); nothing is generated, so outputs are not
compared.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
from specexport_runtime.api import load

from specexport.bench_stats import theoretical_speedup
from specexport.machine import cpu_model

# draft lengths searched for the needed acceptance: 1..16, the range the recorded results used
# (docs/performance.md); constants.MAX_GAMMA allows longer drafts, which these CPU costs never favour
SEARCHED_GAMMAS = range(1, 17)


def _timed(fn, calls: int) -> float:
    """Median seconds of `calls` calls of fn()."""
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


class Probe:
    """One artifact's target (and draft) at a fixed cache length, timed call by call."""

    def __init__(self, path: Path, threads: int | None, past: int, seed: int):
        self.path = path
        self.gen = load(path, threads=threads, shared_pool=True)  # as bench and the runtime CLI run
        self.past = past
        rng = np.random.default_rng(seed)
        vocab = self.gen.manifest.target.vocab_size
        self.ids = rng.integers(100, min(vocab, 30000), past + 64).tolist()
        self.gen.target.truncate(0)
        self.gen.target.forward(self.ids[:past])  # the cache every timed call starts from
        draft = self.gen.draft
        self.head = bool(self.gen.manifest.draft is not None and self.gen.manifest.draft.vocab_map)
        if draft is not None:
            draft.truncate(0)
            if self.head:  # a head reads the target's features [S, F]
                width = self.gen.manifest.draft.feature_width
                self.features = rng.standard_normal((past, width)).astype(np.float32)
                draft.forward(self.ids[1 : past + 1], features=self.features)
            else:
                draft.forward(self.ids[:past])

    def target(self, s: int) -> None:
        self.gen.target.forward(self.ids[self.past : self.past + s], last_rows=s)
        self.gen.target.truncate(self.past)

    def draft(self) -> None:
        d = self.gen.draft
        if self.head:
            d.forward([self.ids[self.past]], features=self.features[-1:])
        else:
            d.forward([self.ids[self.past]])
        d.truncate(self.past)


def needed_alpha(goal: float, c: float, costs: dict) -> dict:
    """The smallest alpha (to 0.01) whose best gamma reaches `goal` x, and that gamma; None when
    even alpha = 1 does not."""
    costs = {**costs, "draft_step_s": c * costs["decode_s"]}
    for a in np.arange(0.0, 1.0001, 0.01):
        best = max((theoretical_speedup(float(a), g, costs) for g in SEARCHED_GAMMAS),
                   key=lambda r: r["speedup"] or 0.0)
        if (best["speedup"] or 0.0) >= goal:
            return {"alpha": round(float(a), 2), "gamma": best["gamma"]}
    return {"alpha": None, "gamma": None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifacts", type=Path, nargs="+")
    ap.add_argument("--past", type=int, default=200, help="cache length of every timed call")
    ap.add_argument("--sizes", default="1,2,3,4,5,9", help="target call sizes S (1 = decode; comma list)")
    ap.add_argument("--repeats", type=int, default=5, help="rounds over all artifacts and sizes")
    ap.add_argument("--calls", type=int, default=20, help="timed calls per size and round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--speedups", default="1.2,1.3,1.5", help="round speedups to find the needed acceptance of")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    sizes = sorted({int(s) for s in args.sizes.split(",")} | {1})
    goals = [float(g) for g in args.speedups.split(",")]
    probes = [Probe(p, args.threads, args.past, args.seed) for p in args.artifacts]
    times: dict[tuple[int, str], list[float]] = {}
    for rep in range(args.repeats):
        for i in range(len(probes)):
            p = probes[(i + rep) % len(probes)]  # rotated order: drift spreads over artifacts
            for s in sizes:
                times.setdefault((id(p), f"S{s}"), []).append(_timed(lambda: p.target(s), args.calls))
            if p.gen.draft is not None:
                times.setdefault((id(p), "draft"), []).append(_timed(p.draft, args.calls))
    rows = []
    for p in probes:
        t = {k: min(v) for (pid, k), v in times.items() if pid == id(p)}
        decode = t["S1"]
        costs = {"decode_s": decode, "target_s": {s: t[f"S{s}"] for s in sizes if s > 1}}
        v = {s: t[f"S{s}"] / decode for s in sizes}
        top = max(sizes)
        row = {"artifact": str(p.path), "precision": p.gen.manifest.target.precision, "decode_ms": round(decode * 1e3, 2),
               "v": {str(s): round(x, 3) for s, x in v.items()},
               "r": round((v[top] - 1) / (top - 1), 3) if top > 1 else None,
               "c": round(t["draft"] / decode, 3) if "draft" in t else None,
               "needed_alpha": {}}
        for goal in goals:
            row["needed_alpha"][str(goal)] = {"free proposer": needed_alpha(goal, 0.0, costs)}
            if row["c"] is not None:
                row["needed_alpha"][str(goal)]["draft"] = needed_alpha(goal, row["c"], costs)
        rows.append(row)
    print(f"{cpu_model()}: target calls at a {args.past}-token cache, {args.threads} threads; v(S) = S-row call / 1-row call")
    for row in rows:
        vs = " ".join(f"v({s})={x}" for s, x in row["v"].items() if s != "1")
        print(f"{row['artifact']}  [{row['precision']}]  decode {row['decode_ms']} ms  {vs}  r={row['r']}  c={row['c']}")
        for goal, need in row["needed_alpha"].items():
            parts = [f"{k}: alpha >= {n['alpha']} (gamma {n['gamma']})" if n["alpha"] is not None else f"{k}: unreachable"
                     for k, n in need.items()]
            print(f"    {goal}x needs  " + ";  ".join(parts))
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_model(), "settings": vars(args) | {"artifacts": [str(a) for a in args.artifacts],
                                                                    "json": str(args.json)}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
