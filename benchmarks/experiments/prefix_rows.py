"""Does a K/V row depend on where a prefill was split? The property prefix reuse rests on
(docs/prefix-cache.md, Exactness): the rows of a prompt prefilled in one call against the same
prompt prefilled in two calls split at various points, and against its second half fed one token
per call, for the target and the draft graph of an artifact.

    python benchmarks/experiments/prefix_rows.py ARTIFACT [--lengths 5,17,40,120,250]
        [--threads 2] [--seed 0] [--json OUT]

Prompts are random token ids (the rows' invariance does not depend on the text). For each length N
the splits are 1, 2, N/3, N/2, N-2 and N-1; each model is called through OrtModel.forward as the
runtime calls it (padded calls and padded attention included: min_rows, cache_pad of the
manifest entry). Reported per model and length: the max |difference| of any K/V row and of the
last logits row, split vs one call and token by token vs one call (0 = bitwise equal).
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "runtime"))

from specexport.bench import harness  # noqa: E402


def max_diff(a, b) -> float:
    return max(float(abs(x - y).max()) for x, y in zip(a, b))


def measure(model, n: int, rng) -> dict:
    """Max |diff| of K/V rows and last logits of N random ids: split prefills and a token-by-token tail."""
    import numpy as np

    vocab = model.spec.embedding_rows
    ids = rng.integers(0, vocab, n).tolist()
    model.reset()
    full_logits = model.forward(ids).copy()  # [1, V]
    full = [r.copy() for r in model.kv_rows(0, n)]  # per buffer [n, H_kv, D]
    split_kv = split_logits = 0.0
    for at in sorted({1, 2, n // 3, n // 2, n - 2, n - 1}):
        if not 0 < at < n:
            continue
        model.reset()
        model.forward(ids[:at])
        logits = model.forward(ids[at:]).copy()
        split_kv = max(split_kv, max_diff(full, model.kv_rows(0, n)))
        split_logits = max(split_logits, float(np.abs(logits - full_logits).max()))
    model.reset()
    model.forward(ids[: max(1, n // 2)])
    for t in ids[max(1, n // 2) :]:
        logits = model.forward([t]).copy()
    step_kv = max_diff(full, model.kv_rows(0, n))
    model.reset()
    return {
        "split_kv": split_kv,
        "split_logits": split_logits,
        "steps_kv": step_kv,
        "steps_logits": float(np.abs(logits - full_logits).max()) if n > 1 else 0.0,
    }


def parser():
    ap = harness.script_parser(__doc__)
    ap.add_argument("artifact", help="artifact folder (specexport build)")
    ap.add_argument("--lengths", default="5,17,40,120,250", help="prompt lengths N (default 5,17,40,120,250)")
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads (default 2)")
    ap.add_argument("--seed", type=int, default=0, help="random ids' seed (default 0)")
    ap.add_argument("--json", default=None, metavar="OUT", help="write the machine, command and results as JSON here")
    return ap


def main(argv=None) -> int:
    import numpy as np

    from specexport_runtime.api import load

    args = parser().parse_args(argv)
    lengths = harness.int_list(args.lengths, "--lengths", minimum=2)
    meta = harness.run_metadata(None if argv is None else [__file__, *argv], **vars(args))
    gen = load(args.artifact, threads=args.threads)
    print(harness.header(meta))
    print(
        f"{'model':<7} {'class':<10} {'N':>5} {'split K/V':>10} {'split logits':>13}"
        f" {'steps K/V':>10} {'steps logits':>13}"
    )
    results = []
    for role, model in (("target", gen.target), ("draft", gen.draft)):
        if model is None or model.spec.is_head:
            continue
        entry = getattr(gen.manifest, role)
        rng = np.random.default_rng(args.seed)
        for n in lengths:
            if n + 1 >= gen.manifest.max_context:
                continue
            r = {"model": role, "exactness": entry.exactness, "n": n, **measure(model, n, rng)}
            results.append(r)
            print(
                f"{role:<7} {entry.exactness or '-':<10} {n:>5} {r['split_kv']:>10.3g} {r['split_logits']:>13.3g}"
                f" {r['steps_kv']:>10.3g} {r['steps_logits']:>13.3g}"
            )
    if args.json:
        harness.write_json(args.json, {"meta": meta, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(harness.cli(main))
