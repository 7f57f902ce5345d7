"""Is an EAGLE-3 head's in-loop acceptance what its teacher-forced quality predicts?

    python benchmarks/head_agreement.py ARTIFACT [--prompts code,chat,...] [--limit 2] [--max-new-tokens 96]

For each prompt: the target's greedy answer (target-only, the runtime); then, teacher forced on
prompt + answer, the head's step-0 prediction at every answer position from the fused target's
own features (row t pairs the features of position t with token t+1 and predicts token t+2), and
its top-1 agreement with the answer; then the same prompt with `--proposer eagle` at gamma 1,
whose first-position acceptance is that same prediction made inside the loop (its output must
equal the target-only answer). Close figures mean the runtime drafts what the head knows; a gap
would point at the loop (features, alignment, rollback).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from specexport_runtime.api import load
from specexport_runtime.engine import OrtModel, SessionConfig

from specexport.bench import prompt_ids, resolve_prompts
from specexport.validate import FeedRunner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", type=Path, help="an artifact with an EAGLE-3 head (recipe draft.eagle3)")
    ap.add_argument("--prompts", default="code,chat,structured,copy_edit,creative", help="prompt sets (bench --prompts)")
    ap.add_argument("--limit", type=int, default=2, help="prompts per set")
    ap.add_argument("--max-new-tokens", type=int, default=96, help="answer length")
    args = ap.parse_args()
    gen = load(args.artifact)
    m = gen.manifest
    if m.draft is None or not m.draft.vocab_map:
        raise SystemExit(f"error: {args.artifact} has no EAGLE-3 head")
    d2t = np.load(args.artifact / m.draft.vocab_map)
    total = {"hits": 0, "rows": 0, "accepted": 0, "drafted": 0}
    for p in resolve_prompts(args.prompts.split(","), limit=args.limit):
        ids = prompt_ids(gen, p)
        answer = gen.generate(ids, max_new_tokens=args.max_new_tokens, speculative=False).token_ids
        seq = ids + answer
        runner = FeedRunner(args.artifact / m.target.graph, m.target.graph_spec())
        runner.run(seq, list(range(len(seq))))
        n = len(seq) - 2
        head = OrtModel(args.artifact / m.draft.graph, m.draft.graph_spec(), len(seq) + 2, SessionConfig(provider="cpu"),
                        max_rows=len(seq))
        pred = d2t[head.forward(seq[1 : n + 1], last_rows=n, features=runner.features[:n]).argmax(-1)]
        first = len(ids) - 2  # rows predicting answer tokens
        ok = pred[first:] == np.asarray(seq[first + 2 :])
        loop = gen.generate(ids, max_new_tokens=args.max_new_tokens, proposer="eagle", gamma=1)
        st = loop.stats
        acc, drafted = (st.accepted_at[0], st.drafted_at[0]) if st.drafted_at else (0, 0)
        total["hits"] += int(ok.sum())
        total["rows"] += ok.size
        total["accepted"] += acc
        total["drafted"] += drafted
        print(json.dumps({"id": p.id, "teacher_forced": round(float(ok.mean()), 3),
                          "in_loop_first": round(acc / drafted, 3) if drafted else None,
                          "same_output": loop.token_ids == answer}))
    print(json.dumps({"teacher_forced": round(total["hits"] / max(1, total["rows"]), 3),
                      "in_loop_first": round(total["accepted"] / max(1, total["drafted"]), 3)}))


if __name__ == "__main__":
    main()
