"""Is an EAGLE-3 head's in-loop acceptance what its teacher-forced quality predicts?

    python benchmarks/experiments/head_agreement.py ARTIFACT [--prompts code,chat,...] [--limit 2]
        [--max-new-tokens 96] [--bigram JSON] [--threads 2] [--json OUT]

For each prompt: the target's greedy answer (target-only, the runtime); then, teacher forced on
prompt + answer, the head's step-0 prediction at every answer position from the fused target's
own features (row t pairs the features of position t with token t+1 and predicts token t+2), and
its top-1 agreement with the answer; then the same prompt with `--proposer eagle` at gamma 1,
whose first-position acceptance is that same prediction made inside the loop (its output must
equal the target-only answer). Close figures mean the runtime drafts what the head knows; a gap
would point at the loop (features, alignment, rollback).

--bigram JSON (a train-draft answer cache, e.g. ~/.cache/specexport/train-draft/instructions-*.json:
token-id lists) adds a baseline on the same rows: the most frequent successor of token t+1 in
those answers, as a guess for token t+2. A head near that figure has learned little beyond token
statistics from the target's features.
"""

from __future__ import annotations

import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "runtime"))

from specexport.bench import harness  # noqa: E402


def parser():
    ap = harness.script_parser(__doc__)
    ap.add_argument("artifact", type=Path, help="an artifact with an EAGLE-3 head (recipe draft.eagle3)")
    ap.add_argument(
        "--bigram",
        type=Path,
        default=None,
        help="a train-draft answer cache (JSON of token-id lists) whose bigram successors are the baseline",
    )
    harness.add_run_options(
        ap, prompts="code,chat,structured,copy_edit,creative", limit=2, max_new_tokens=96, repeats=None, threads=2
    )
    return ap


def main(argv=None) -> int:
    args = harness.parse_args(parser(), argv)
    from specexport.build.validate import FeedRunner
    from specexport_runtime.api import load
    from specexport_runtime.engine import OrtModel, SessionConfig

    meta = harness.run_metadata(None if argv is None else [__file__, *argv], **vars(args))
    successor = bigram_successors(args.bigram) if args.bigram else None
    gen = load(args.artifact, threads=args.threads)
    m = gen.manifest
    if m.draft is None or not m.draft.vocab_map:
        raise harness.HarnessError(f"{args.artifact} has no EAGLE-3 head")
    d2t = np.load(args.artifact / m.draft.vocab_map)
    total = {"hits": 0, "rows": 0, "accepted": 0, "drafted": 0, "bigram": 0}
    rows = []
    print(harness.header(meta))
    for p in harness.load_prompt_set(args.prompts, limit=args.limit):
        ids = harness.encode_prompt(gen.codec, p)
        answer = gen.generate(ids, max_new_tokens=args.max_new_tokens, speculative=False).token_ids
        seq = ids + answer
        runner = FeedRunner(args.artifact / m.target.graph, m.target.graph_spec())
        runner.run(seq, list(range(len(seq))))
        n = len(seq) - 2
        head = OrtModel(
            args.artifact / m.draft.graph,
            m.draft.graph_spec(),
            len(seq) + 2,
            SessionConfig(provider="cpu", threads=args.threads),
            max_rows=len(seq),
        )
        pred = d2t[head.forward(seq[1 : n + 1], last_rows=n, features=runner.features[:n]).argmax(-1)]
        first = len(ids) - 2  # rows predicting answer tokens
        ok = pred[first:] == np.asarray(seq[first + 2 :])
        big = None
        if successor is not None:  # token t+1 -> its most frequent successor, as the guess for t+2
            big = np.asarray([successor.get(t, -1) for t in seq[first + 1 : n + 1]]) == np.asarray(seq[first + 2 :])
            total["bigram"] += int(big.sum())
        loop = gen.generate(ids, max_new_tokens=args.max_new_tokens, proposer="eagle", gamma=1)
        st = loop.stats
        acc, drafted = (st.accepted_at[0], st.drafted_at[0]) if st.drafted_at else (0, 0)
        total["hits"] += int(ok.sum())
        total["rows"] += ok.size
        total["accepted"] += acc
        total["drafted"] += drafted
        row = {
            "id": p.id,
            "teacher_forced": round(float(ok.mean()), 3),
            "in_loop_first": round(acc / drafted, 3) if drafted else None,
            "same_output": loop.token_ids == answer,
        }
        if big is not None:
            row["bigram_baseline"] = round(float(big.mean()), 3)
        rows.append(row)
        print(json.dumps(row))
    summary = {
        "teacher_forced": round(total["hits"] / max(1, total["rows"]), 3),
        "in_loop_first": round(total["accepted"] / max(1, total["drafted"]), 3),
    }
    if successor is not None:
        summary["bigram_baseline"] = round(total["bigram"] / max(1, total["rows"]), 3)
    print(json.dumps(summary))
    if args.json:
        harness.write_json(args.json, {"meta": meta, "rows": rows, "summary": summary})
    return 0


def bigram_successors(path: Path) -> dict[int, int]:
    """token -> its most frequent successor over the token-id lists of a JSON cache (a dict of
    lists or a list of lists; other values are skipped)."""
    data = json.loads(path.read_text())
    seqs = data.values() if isinstance(data, dict) else data
    counts: dict[int, Counter] = defaultdict(Counter)
    for s in seqs:
        if isinstance(s, list) and all(isinstance(t, int) for t in s):
            for a, b in zip(s, s[1:], strict=False):
                counts[a][b] += 1
    return {a: c.most_common(1)[0][0] for a, c in counts.items()}


if __name__ == "__main__":
    raise SystemExit(harness.cli(main))
