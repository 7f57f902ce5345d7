"""What a grammar costs per token in constrained target-only decoding.

    python benchmarks/experiments/constraint_cost.py ARTIFACT [--prompts calibration/structured_json.jsonl]
        [--limit 20] [--threads 2] [--json OUT]

For each prompt that carries a JSON Schema, one constrained target-only generation (greedy) with
the grammar's work timed apart: the masks of each call (llguidance), applying them to the
logits rows, and committing the emitted tokens to the matcher. Reported: target milliseconds per
token (the step, mask included) and grammar milliseconds per token, and their ratio: what
constrained decoding adds to a step. One warm-up generation on a prompt outside the set comes
first (specexport.bench.harness); the grammar engine is built before timing.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "runtime"))

from specexport.bench import harness  # noqa: E402

PARTS = ("masks", "apply", "commit")


def timed(acc: dict, name: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[name] += time.perf_counter() - start

    return wrapper


def measure(gen, rows: list[dict]) -> dict:
    """Grammar and target seconds over constrained target-only generations of `rows`."""
    from specexport_runtime import structured

    acc = dict.fromkeys(PARTS, 0.0)
    matcher, module = structured.Matcher, structured
    saved = (matcher.masks, matcher.commit, module.apply_mask)
    matcher.masks, matcher.commit = timed(acc, "masks", saved[0]), timed(acc, "commit", saved[1])
    module.apply_mask = timed(acc, "apply", saved[2])
    tokens, target = 0, 0.0
    try:
        for row in rows:
            grammar = structured.Grammar.json_schema(row["schema"])
            r = gen.chat(row["messages"], max_new_tokens=row["max_new_tokens"], grammar=grammar, speculative=False)
            tokens += len(r.token_ids)
            target += r.stats.prefill_seconds + r.stats.target_seconds
    finally:
        matcher.masks, matcher.commit, module.apply_mask = saved
    grammar_s = sum(acc.values())
    return {
        "prompts": len(rows),
        "tokens": tokens,
        "target_ms_per_token": round(target / tokens * 1e3, 4),
        "grammar_ms_per_token": round(grammar_s / tokens * 1e3, 4),
        **{f"{k}_ms_per_token": round(v / tokens * 1e3, 4) for k, v in acc.items()},
        "grammar_share_of_step": round(grammar_s / target, 4),
    }


def parser():
    ap = harness.script_parser(__doc__)
    ap.add_argument("artifact", help="artifact folder (specexport build)")
    ap.add_argument(
        "--prompts",
        default=str(REPO / "calibration" / "structured_json.jsonl"),
        help="a JSONL file of chat prompts; those with a 'schema' are measured",
    )
    ap.add_argument("--limit", type=int, default=20, help="prompts with a schema to measure (default 20)")
    ap.add_argument("--threads", type=int, default=None, help="ONNX Runtime intra-op threads (default: all cores)")
    ap.add_argument("--json", default=None, metavar="OUT", help="write the machine, command and result as JSON here")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.limit < 1:
        raise harness.HarnessError(f"--limit must be at least 1, got {args.limit}")
    from specexport_runtime.api import load

    path = Path(args.prompts)
    if not path.is_file():
        raise harness.HarnessError(f"--prompts {args.prompts!r} is not a file")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    rows = [r for r in rows if "schema" in r][: args.limit]
    if not rows:
        raise harness.HarnessError(f"{args.prompts!r} holds no prompt with a 'schema'")
    meta = harness.run_metadata(None if argv is None else [__file__, *argv], **vars(args))
    gen = load(args.artifact, threads=args.threads, shared_pool=True)
    gen.constraints()  # the engine (tokenizer for llguidance) is built once, not timed
    gen.chat(list(harness.WARMUP_MESSAGES), max_new_tokens=8, grammar=gen_grammar())
    result = measure(gen, rows)
    print(harness.header(meta))
    print(json.dumps(result))
    if args.json:
        harness.write_json(args.json, {"meta": meta, "result": result})
    return 0


def gen_grammar():
    from specexport_runtime.structured import Grammar

    return Grammar.json_object()


if __name__ == "__main__":
    raise SystemExit(harness.cli(main))
