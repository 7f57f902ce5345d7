"""What a call of each graph costs, a verify row and a draft step, and the acceptance speculation then needs.

    python benchmarks/experiments/verify_cost.py ARTIFACT [ARTIFACT ...] [--past 200] [--sizes 1,2,3,4,5,9]
        [--draft-sizes 1] [--repeats 5] [--calls 20] [--threads 2] [--speedups 1.2,1.3,1.5] [--json OUT]

For each artifact, on one loaded generator (one shared thread pool, as `specexport bench` and the
runtime CLI run it): the median seconds of a target call over S rows (--sizes; S = 1 is the
decode step) and of a draft call over S rows (--draft-sizes; the draft model's or EAGLE-3 head's
step at S = 1) at a --past-token cache, each the best of --repeats medians over --calls calls,
artifacts rotated each repeat so machine drift spreads over them. Reported per artifact and
graph (its precision and cache layout: portable time_major or fused head_major_inplace): the ms
per call and its ratio to the first artifact's decode step; v(S), the S-row call over the 1-row
step; r, the mean cost of one more row ((v(max S) - 1) / (max S - 1)); c, the draft step over the
target step; and for each --speedups goal the per-token acceptance alpha that a round of the best
gamma needs to reach it, by the bench's own round model (bench_stats.theoretical_speedup:
E / (gamma c + v(gamma + 1)), E = sum alpha^i). Proposers that cost nothing (lookup, suffix) are
the c = 0 column. Comparing a portable and a fused build, or draft precisions, is one run with
both artifacts.

Tokens are random ids (costs do not depend on the text); nothing is generated, so outputs are not
compared.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "runtime"))

from specexport.bench import harness  # noqa: E402

# draft lengths searched for the needed acceptance: 1..16, the range the recorded results used
# (docs/performance.md); constants.MAX_GAMMA allows longer drafts, which these CPU costs never favour
SEARCHED_GAMMAS = range(1, 17)


class Probe:
    """One artifact's target (and draft) at a fixed cache length, timed call by call."""

    def __init__(self, path: Path, threads: int | None, past: int, seed: int):
        from specexport_runtime.api import load

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
                self.features = rng.standard_normal((past + 64, width)).astype(np.float32)
                draft.forward(self.ids[1 : past + 1], features=self.features[:past])
            else:
                draft.forward(self.ids[:past])

    def label(self, role: str) -> str:
        entry = self.gen.manifest.target if role == "target" else self.gen.manifest.draft
        return f"{self.path.name}/{role} ({entry.precision}, {entry.kv_layout})"

    def target(self, s: int) -> None:
        self.gen.target.forward(self.ids[self.past : self.past + s], last_rows=s)
        self.gen.target.truncate(self.past)

    def draft(self, s: int) -> None:
        d, rows = self.gen.draft, self.ids[self.past : self.past + s]
        if self.head:
            d.forward(rows, last_rows=s, features=self.features[self.past : self.past + s])
        else:
            d.forward(rows, last_rows=s)
        d.truncate(self.past)


def needed_alpha(goal: float, c: float, costs: dict) -> dict:
    """The smallest alpha (to 0.01) whose best gamma reaches `goal` x, and that gamma; None when
    even alpha = 1 does not."""
    from specexport.bench.stats import theoretical_speedup

    costs = {**costs, "draft_step_s": c * costs["decode_s"]}
    for a in np.arange(0.0, 1.0001, 0.01):
        best = max(
            (theoretical_speedup(float(a), g, costs) for g in SEARCHED_GAMMAS), key=lambda r: r["speedup"] or 0.0
        )
        if (best["speedup"] or 0.0) >= goal:
            return {"alpha": round(float(a), 2), "gamma": best["gamma"]}
    return {"alpha": None, "gamma": None}


def sizes(text: str, option: str) -> list[int]:
    """Call sizes of a comma list, sorted, with 1 (the decode step) always in."""
    return sorted(set(harness.int_list(text, option)) | {1})


def parser():
    ap = harness.script_parser(__doc__)
    ap.add_argument("artifacts", type=Path, nargs="+", help="artifact folders (specexport build)")
    ap.add_argument("--past", type=int, default=200, help="cache length of every timed call (default 200)")
    ap.add_argument(
        "--sizes", default="1,2,3,4,5,9", help="target call sizes S, comma list (1 = decode; default %(default)s)"
    )
    ap.add_argument("--draft-sizes", default="1", help="draft call sizes S, comma list (default 1: the draft step)")
    ap.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="rounds over all artifacts and sizes; the best median is kept (default 5)",
    )
    ap.add_argument("--calls", type=int, default=20, help="timed calls per size and round (default 20)")
    ap.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads (default 2)")
    ap.add_argument(
        "--speedups",
        default="1.2,1.3,1.5",
        help="round speedups to find the needed acceptance of (default %(default)s)",
    )
    ap.add_argument("--seed", type=int, default=0, help="seed of the random token ids (default 0)")
    ap.add_argument("--json", default=None, metavar="OUT", help="write the machine, command and rows as JSON here")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    target_sizes, draft_sizes = sizes(args.sizes, "--sizes"), sizes(args.draft_sizes, "--draft-sizes")
    goals = [float(g) for g in args.speedups.split(",")]
    meta = harness.run_metadata(None if argv is None else [__file__, *argv], **vars(args))
    probes = [Probe(p, args.threads, args.past, args.seed) for p in args.artifacts]
    times: dict[tuple[int, str, int], list[float]] = {}  # (probe, role, S) -> median seconds per round
    for rep in range(args.repeats):
        for p in harness.rotated(probes, rep):
            calls = [("target", s, p.target) for s in target_sizes]
            calls += [("draft", s, p.draft) for s in draft_sizes] if p.gen.draft is not None else []
            for role, s, fn in calls:
                seconds = harness.median_seconds(lambda fn=fn, s=s: fn(s), args.calls)
                times.setdefault((id(p), role, s), []).append(seconds)
    base = min(times[(id(probes[0]), "target", 1)])
    rows = []
    for p in probes:
        t = {(role, s): min(v) for (pid, role, s), v in times.items() if pid == id(p)}
        decode = t[("target", 1)]
        costs = {"decode_s": decode, "target_s": {s: t[("target", s)] for s in target_sizes if s > 1}}
        v = {s: t[("target", s)] / decode for s in target_sizes}
        top = max(target_sizes)
        row = {
            "artifact": str(p.path),
            "precision": p.gen.manifest.target.precision,
            "calls": {
                p.label(role): {
                    str(s): {"ms": round(sec * 1e3, 3), "vs_first_decode": round(sec / base, 3)}
                    for (r, s), sec in t.items()
                    if r == role
                }
                for role in ("target", "draft")
                if any(r == role for r, _ in t)
            },
            "decode_ms": round(decode * 1e3, 2),
            "v": {str(s): round(x, 3) for s, x in v.items()},
            "r": round((v[top] - 1) / (top - 1), 3) if top > 1 else None,
            "c": round(t[("draft", 1)] / decode, 3) if ("draft", 1) in t else None,
            "needed_alpha": {},
        }
        for goal in goals:
            row["needed_alpha"][str(goal)] = {"free proposer": needed_alpha(goal, 0.0, costs)}
            if row["c"] is not None:
                row["needed_alpha"][str(goal)]["draft"] = needed_alpha(goal, row["c"], costs)
        rows.append(row)
    print(harness.header(meta))
    print(
        f"calls at a {args.past}-token cache, {args.threads} threads, best of {args.repeats} medians of {args.calls}"
        " calls; v(S) = S-row call / 1-row call; ratio: to the first artifact's decode step"
    )
    for row in rows:
        for label, by_size in row["calls"].items():
            cells = "  ".join(f"S={s} {x['ms']:.2f} ms ({x['vs_first_decode']:.2f})" for s, x in by_size.items())
            print(f"{label:<60} {cells}")
        vs = " ".join(f"v({s})={x}" for s, x in row["v"].items() if s != "1")
        print(f"  {vs}  r={row['r']}  c={row['c']}")
        for goal, need in row["needed_alpha"].items():
            parts = [
                f"{k}: unreachable" if n["alpha"] is None else f"{k}: alpha >= {n['alpha']} (gamma {n['gamma']})"
                for k, n in need.items()
            ]
            print(f"    {goal}x needs  " + ";  ".join(parts))
    if args.json:
        harness.write_json(args.json, {"meta": meta, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(harness.cli(main))
