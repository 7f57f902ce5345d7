"""Is a draft model faster under a grammar when its own drafting is masked by the grammar too?

    python benchmarks/experiments/masked_draft.py ARTIFACT [--prompts structured_json] [--limit 20]
        [--repeats 1] [--gamma G] [--threads 2] [--json OUT]

Under a constraint the loop already drafts the grammar's forced tokens for free, cuts any
proposer's draft at its first forbidden token and masks the target's rows (docs/structured.md).
A draft model that knows nothing of the grammar often leaves the forced run or drafts a
forbidden token, so its drafts are kept short. Masking the draft model's own logits with the
grammar at every drafting step (the draft then follows the forced run and never leaves the
grammar) costs one mask per drafted token; `draft` does it (Proposer.constrain). This runs it
beside `draft-free`, the same draft model blind to the grammar (registered here, for this run
only), on the same generator, greedy and constrained, interleaved prompt by prompt
(specexport.bench.harness), and reports decode tok/s, the drafted and accepted tokens and the
grammar's cuts of each, and whether every output equals constrained target-only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "runtime"))

from specexport.bench import harness  # noqa: E402


def free_spec():
    """A ProposerSpec 'draft-free': the artifact's draft model drafting without the grammar (the
    loop still cuts its drafts at their first forbidden token)."""
    from specexport_runtime import registry
    from specexport_runtime.contract import DECODER
    from specexport_runtime.proposers import DraftModelProposer

    class FreeDraft(DraftModelProposer):
        name = "draft-free"

        def constrain(self, allowed) -> None:
            self.allowed = None

    def build(ctx):
        return FreeDraft(ctx.draft, ctx.manifest.target.embedding_rows, ctx.config.min_draft_prob)

    return registry.ProposerSpec(
        "draft-free", build, "the draft model, blind to the grammar", needs=(DECODER,), free=False, calibration="draft"
    )


def parser():
    ap = harness.script_parser(__doc__)
    harness.add_run_options(ap, prompts="structured_json", limit=20, max_new_tokens=384, repeats=1, threads=2)
    ap.add_argument("artifact", help="artifact folder with a draft model (specexport build)")
    ap.add_argument(
        "--gamma", type=int, default=None, help="fixed draft length (default: each proposer's adaptive controller)"
    )
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    from specexport_runtime import registry
    from specexport_runtime.api import load
    from specexport_runtime.structured import Grammar

    meta = harness.run_metadata(None if argv is None else [__file__, *argv], **vars(args))
    gen = load(args.artifact, threads=args.threads, shared_pool=True)
    prompts = [p for p in harness.load_prompt_set(args.prompts, args.limit) if p.schema is not None]
    if not prompts:
        raise harness.HarnessError(f"--prompts {args.prompts!r} holds no prompt with a JSON Schema")
    rows = []
    with registry.extended(free_spec()):
        gen.chat(list(harness.WARMUP_MESSAGES), max_new_tokens=8, speculative=False)
        for repeat in range(args.repeats):
            for prompt in prompts:
                grammar = Grammar.json_schema(prompt.schema)
                ids = harness.encode_prompt(gen.codec, prompt)
                limit = prompt.max_new_tokens or args.max_new_tokens
                base = gen.generate(ids, max_new_tokens=limit, grammar=grammar, speculative=False)
                order = ("draft", "draft-free") if repeat % 2 == 0 else ("draft-free", "draft")
                for name in order:
                    gen.forget_history()
                    r = gen.generate(ids, max_new_tokens=limit, grammar=grammar, proposer=name, gamma=args.gamma)
                    s = r.stats
                    rows.append(
                        {
                            "prompt": prompt.id,
                            "repeat": repeat,
                            "proposer": name,
                            "tok_s": round(s.tokens_per_second, 2),
                            "off_tok_s": round(base.stats.tokens_per_second, 2),
                            "drafted": s.drafted,
                            "accepted": s.accepted,
                            "grammar_cut": s.grammar_cut,
                            "identical": r.token_ids == base.token_ids,
                        }
                    )
    print(harness.header(meta))
    for name in ("draft", "draft-free"):
        mine = [r for r in rows if r["proposer"] == name]
        ratios = [r["tok_s"] / r["off_tok_s"] for r in mine]
        print(
            json.dumps(
                {
                    "proposer": name,
                    "median_x_off": round(float(np.median(ratios)), 3),
                    "drafted": sum(r["drafted"] for r in mine),
                    "accepted": sum(r["accepted"] for r in mine),
                    "grammar_cut": sum(r["grammar_cut"] for r in mine),
                    "identical": f"{sum(r['identical'] for r in mine)}/{len(mine)}",
                }
            )
        )
    if args.json:
        harness.write_json(args.json, {"meta": meta, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(harness.cli(main))
