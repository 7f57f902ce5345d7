"""Does turning ONNX Runtime's weight repacking off (load(..., prepack=False)) change exactness?

    python benchmarks/experiments/prepack_exactness.py ARTIFACT [--prompts all] [--limit 1]
        [--max-new-tokens 128] [--threads 2] [--json OUT]

For repacked and mapped weights in turn: greedy output with the artifact's default proposer
against target-only output per prompt, and the target's logits of 9 tokens fed in one call
against the same 9 tokens one call each after a 30-token prefix (max |difference|, argmax
agreement); then whether target-only output is the same in both settings. Nothing is timed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "runtime"))

from specexport.bench import harness  # noqa: E402


def parser():
    ap = harness.script_parser(__doc__)
    ap.add_argument("artifact", type=Path, help="artifact folder")
    harness.add_run_options(ap, prompts="all", limit=1, max_new_tokens=128, repeats=None, threads=2)
    return ap


def row_check(model, ids: list[int]) -> tuple[float, bool]:
    """9 tokens after a 30-token prefix in one call against one call each."""
    model.reset()
    model.forward(ids[:30])
    prefix = model.length
    joint = model.forward(ids[30:39], last_rows=9).copy()  # [9, V]
    model.truncate(prefix)
    apart = np.stack([model.forward([t]).copy()[-1] for t in ids[30:39]])  # [9, V]
    return float(np.abs(joint - apart).max()), bool((joint.argmax(-1) == apart.argmax(-1)).all())


def main(argv=None) -> int:
    args = harness.parse_args(parser(), argv)
    from specexport_runtime.api import load

    meta = harness.run_metadata(None if argv is None else [__file__, *argv], **vars(args))
    print(harness.header(meta))
    outputs, settings = {}, {}
    for prepack in (True, False):
        gen = load(args.artifact, threads=args.threads, prepack=prepack)
        cases = harness.make_cases(gen.codec, harness.load_prompt_set(args.prompts, args.limit))
        long = [c for c in cases if len(c.ids) >= 39]
        if not long:
            raise harness.HarnessError("the row check needs a prompt of at least 39 tokens; none of --prompts has one")
        pairs = []
        for case in cases:
            off = gen.generate(list(case.ids), max_new_tokens=args.max_new_tokens, speculative=False).token_ids
            on = gen.generate(list(case.ids), max_new_tokens=args.max_new_tokens).token_ids
            gen.forget_history()
            pairs.append((off, on))
        diff, argmax = row_check(gen.target, list(long[0].ids))
        name = "repacked" if prepack else "mapped"
        same = sum(a == b for a, b in pairs)
        print(f"{name}: speculative == target-only {same}/{len(pairs)}; 9-row call vs 1-row calls: max |diff|")
        print(f"    {diff:.3g}, argmax {'equal' if argmax else 'DIFFERS'}")
        outputs[prepack] = [off for off, _ in pairs]
        settings[name] = {
            "speculative_equals_target_only": same,
            "prompts": len(pairs),
            "max_abs_diff_9_rows": diff,
            "argmax_equal": argmax,
        }
    same = sum(a == b for a, b in zip(outputs[True], outputs[False]))
    print(f"target-only output, repacked == mapped: {same}/{len(outputs[True])}")
    if args.json:
        doc = {"meta": meta, "settings": settings, "target_only_repacked_equals_mapped": same}
        harness.write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(harness.cli(main))
