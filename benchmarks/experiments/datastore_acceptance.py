"""How often would a corpus datastore's drafts be accepted, by match length and score?

    python benchmarks/experiments/datastore_acceptance.py ARTIFACT
        [--prompts benchmarks/prompts/code_completion.jsonl] [--limit 30] [--max-new-tokens 128] [--json OUT]

ARTIFACT must carry a datastore (recipe `retrieval`). For each prompt the target's greedy answer
is generated (target-only); then at every answer position the datastore proposes a draft from the
context so far exactly as the suffix proposer asks it (datastore.propose with the default
SuffixConfig and its depth), and the draft is compared with the answer's next tokens: the first
token right or not, and how many tokens in a row match (what greedy verification would accept).
Positions are bucketed by the match length m and by the draft's score; a bucket whose drafts
are accepted often and that holds many positions is where corpus drafts could replace the draft
model. Positions where the request itself offers a suffix draft of score >= 1 (the suffix
proposer's own source) are counted apart, since there the datastore is not needed.

Nothing is timed: this measures what the corpus could give, not its cost (suffix_cost.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "runtime"))

from specexport.bench import harness  # noqa: E402

M_BUCKETS = ((1, 3), (3, 5), (5, 8), (8, 12), (12, 1 << 30))
SCORE_BUCKETS = ((0.0, 1.0), (1.0, 2.0), (2.0, 4.0), (4.0, float("inf")))


def matched(draft: list[int], truth: list[int]) -> int:
    """Leading tokens of `draft` equal to `truth` (what greedy verification accepts)."""
    k = 0
    while k < len(draft) and k < len(truth) and draft[k] == truth[k]:
        k += 1
    return k


def summary(rows: list[dict]) -> dict:
    drafted = sum(r["drafted"] for r in rows)
    accepted = sum(r["accepted"] for r in rows)
    return {
        "positions": len(rows),
        "drafted": drafted,
        "first_token_right": round(sum(r["accepted"] > 0 for r in rows) / len(rows), 3) if rows else None,
        "accepted_per_draft": round(accepted / len(rows), 2) if rows else None,
        "token_acceptance": round(accepted / drafted, 3) if drafted else None,
    }


def parser():
    ap = harness.script_parser(__doc__)
    ap.add_argument("artifact", type=Path, help="an artifact with a corpus datastore (recipe retrieval)")
    harness.add_run_options(
        ap,
        prompts=str(REPO / "benchmarks" / "prompts" / "code_completion.jsonl"),
        limit=30,
        max_new_tokens=128,
        repeats=None,
        threads=2,
    )
    return ap


def main(argv=None) -> int:
    args = harness.parse_args(parser(), argv)
    from specexport_runtime.api import load
    from specexport_runtime.suffix import RequestSuffix, SuffixConfig

    meta = harness.run_metadata(None if argv is None else [__file__, *argv], **vars(args))
    gen = load(args.artifact, threads=args.threads)
    store = gen.datastore
    if store is None:
        raise harness.HarnessError(f"{args.artifact} has no datastore (recipe retrieval)")
    config = SuffixConfig()
    rows = []
    for p in harness.load_prompt_set(args.prompts, limit=args.limit):
        ids = harness.encode_prompt(gen.codec, p)
        answer = gen.generate(ids, max_new_tokens=args.max_new_tokens, speculative=False).token_ids
        request = RequestSuffix()
        request.reset(ids)
        context = list(ids)
        for i, token in enumerate(answer):
            draft, score, m = store.propose(context[-config.max_depth :], config, args.max_new_tokens)
            _, own_score, _ = request.propose(context[-config.max_depth :], config, args.max_new_tokens)
            if draft:
                rows.append(
                    {
                        "prompt": p.id,
                        "position": i,
                        "m": m,
                        "score": score,
                        "drafted": len(draft),
                        "accepted": matched(draft, answer[i:]),
                        "request_score": own_score,
                    }
                )
            request.extend([token])
            context.append(token)
    report = {
        "artifact": str(args.artifact),
        "datastore": store.describe(),
        "all": summary(rows),
        "by_match_length": {
            f"{lo}-{hi - 1}" if hi < 1 << 30 else f"{lo}+": summary([r for r in rows if lo <= r["m"] < hi])
            for lo, hi in M_BUCKETS
        },
        "by_score": {f"{lo:g}-{hi:g}": summary([r for r in rows if lo <= r["score"] < hi]) for lo, hi in SCORE_BUCKETS},
        "where_request_has_no_draft": summary([r for r in rows if r["request_score"] < 1.0]),
    }
    print(harness.header(meta))
    print(f"{args.artifact}: datastore {report['datastore']}; drafts at {len(rows)} answer positions")
    for group in ("by_match_length", "by_score"):
        for key, s in report[group].items():
            print(f"  {group[3:]:13s} {key:8s} {s}")
    print(f"  {'all':22s} {report['all']}")
    print(f"  {'no request draft':22s} {report['where_request_has_no_draft']}")
    if args.json:
        harness.write_json(args.json, {"meta": meta, "report": report, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(harness.cli(main))
