"""What does a suffix-proposer round cost on the CPU, and how big is its store?

    python benchmarks/experiments/suffix_cost.py [--request 2048] [--store 200000] [--rounds 2000] [--json OUT]
        [--datastore ARTIFACT_OR_DIR --text FILE --tokenizer tokenizer.json]

Synthetic token streams with text-like statistics (Zipf-distributed ids over a 49,152-token
vocabulary, with repeated phrases so that matches exist): a request of --request tokens and a
store of past responses filled to --store tokens. The request starts at --request tokens; each
round appends the accepted tokens of the previous round (1-5) to the request, then times the
proposer's work of a round: the commit of the previous one (request extended, score calibration
and draft-limit tuner fed) and `SuffixProposer.retrieve` (request and store matched, the better
draft chosen). Reports the median, p90 and p99 per round in ms, the share of rounds with a draft,
and the store's token count and memory (`SuffixStore.describe`), plus the time to fill it. With
--datastore (a folder holding retrieval/tokens.npy and retrieval/suffix_array.npy, e.g. an
artifact built with a recipe `retrieval` section) the corpus is matched too, and the request is
--text tokenized with --tokenizer (real text, so that the corpus has matches), its first
--request tokens as the start.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "runtime"))

from specexport.bench import harness  # noqa: E402

VOCAB = 49_152


def text_like(rng: np.random.Generator, n: int, phrases: list[np.ndarray]) -> list[int]:
    """Zipf tokens with a phrase from a shared pool every ~12 tokens (what makes text repeat)."""
    out: list[int] = []
    while len(out) < n:
        if rng.random() < 0.5:
            out.extend(phrases[int(rng.integers(len(phrases)))].tolist())
        else:
            out.extend((rng.zipf(1.3, size=6) % VOCAB).tolist())
    return out[:n]


def parser():
    ap = harness.script_parser(__doc__)
    ap.add_argument("--request", type=int, default=2048, help="request tokens at the start (it grows ~3 per round)")
    ap.add_argument("--store", type=int, default=200_000, help="tokens of past responses in the store")
    ap.add_argument("--rounds", type=int, default=2000, help="timed rounds")
    ap.add_argument(
        "--json", type=Path, default=None, metavar="OUT", help="write the machine, command and figures as JSON"
    )
    ap.add_argument("--datastore", type=Path, default=None, help="folder with retrieval/tokens.npy + suffix_array.npy")
    ap.add_argument("--text", type=Path, default=None, help="with --datastore: the request's text")
    ap.add_argument("--tokenizer", type=Path, default=None, help="with --datastore: a tokenizers JSON file")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.datastore is not None and (args.text is None or args.tokenizer is None):
        raise harness.HarnessError("--datastore needs --text and --tokenizer")
    if min(args.request, args.store, args.rounds) < 1:
        raise harness.HarnessError("--request, --store and --rounds must be at least 1")
    from specexport_runtime.datastore import Datastore
    from specexport_runtime.suffix import SuffixConfig, SuffixProposer, SuffixStore

    meta = harness.run_metadata(None if argv is None else [__file__, *argv], **vars(args))
    rng = np.random.default_rng(0)
    phrases = [(rng.zipf(1.3, size=int(rng.integers(4, 16))) % VOCAB) for _ in range(2000)]
    config = SuffixConfig(global_tokens=args.store)
    store = SuffixStore(args.store)
    t0 = time.perf_counter()
    while store.tokens < args.store * 0.999 and store.added < 100_000:
        store.add(text_like(rng, int(rng.integers(50, 400)), phrases))
    fill = time.perf_counter() - t0
    datastore = None
    if args.datastore is not None:
        from tokenizers import Tokenizer

        datastore = Datastore.open(
            args.datastore / "retrieval" / "tokens.npy", args.datastore / "retrieval" / "suffix_array.npy"
        )
        ids = Tokenizer.from_file(str(args.tokenizer)).encode(args.text.read_text(encoding="utf-8")).ids
        committed, stream = ids[: args.request], ids[args.request :] * (1 + args.rounds * 5 // max(1, len(ids)))
    else:
        committed = text_like(rng, max(16, args.request), phrases)
        stream = text_like(rng, args.rounds * 5 + 10, phrases)
    proposer = SuffixProposer(store, config, max_context=1 << 30, datastore=datastore)
    proposer.start(committed)
    times, drafted = [], 0
    pos = 0
    spent = 0.0  # the commit of the previous round (request extended, calibration and limit tuner fed)
    for _ in range(args.rounds):
        step = int(rng.integers(1, 6))
        new = stream[pos : pos + step]
        pos += step
        committed += new
        t = time.perf_counter()
        proposer.commit(committed, len(new))
        spent += time.perf_counter() - t
        t = time.perf_counter()
        tokens, _, _ = proposer.retrieve(committed)
        if tokens:
            proposer.use_last()  # as if verified: its commit records the round
        times.append(spent + time.perf_counter() - t)
        spent = 0.0
        drafted += bool(tokens)
    result = {
        "meta": meta,
        "request_tokens_at_end": len(committed),
        "rounds": args.rounds,
        "ms_per_round": harness.percentiles(1e3 * x for x in times),
        "rounds_with_a_draft": drafted / args.rounds,
        "store": store.describe(),
        "store_fill_seconds": round(fill, 2),
        "datastore": None if datastore is None else datastore.describe(),
    }
    print(harness.header(meta))
    print(json.dumps({k: v for k, v in result.items() if k != "meta"}, indent=2))
    if args.json:
        harness.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(harness.cli(main))
