"""A system prompt prefilled at build time: the first request's time to first token with the stored
rows against without them, and the prompt's own prefill time.

    python benchmarks/system_prompt_ttft.py ARTIFACT [--repeats 5] [--threads 2] [--max-new-tokens 16]
        [--json OUT]

ARTIFACT was built with `specexport build ... --system-prompt FILE`. One process loads it once.
A repeat measures, in alternating order from repeat to repeat:
    stored  the first request of [system prompt, question] as a device serves it: the prefix pool
            emptied and the stored prompt not yet checked, so the request streams the target's
            stored rows into its cache (sha256 checked) but the last, and prefills that row (the
            check) with what follows the system prompt; the draft's rows follow the first token
    cold    the same messages with cache_prompt false: the whole prompt prefilled
    prefill the system prompt's stored ids alone, prefilled with cache_prompt false (one token
            generated): the time the stored rows should save
Time to first token = the call (gen.events on the chat's prompt ids) to its first round's tokens,
in process. The drop
is cold - stored; the goal is drop / prefill within 0.9..1.1: reported as the ratio of the medians
over repeats and as the median of each repeat's own ratio (its three runs are adjacent in time,
so a drift of the machine's other load cancels in it). Answers of
stored and cold must be identical (greedy).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "runtime"))

from specexport.bench import harness  # noqa: E402

QUESTION = "Write a Python function that returns the n-th Fibonacci number."


def first_token(gen, ids: list[int], n: int, **settings) -> tuple[float, list[int]]:
    """(ms to the first round's tokens, every token id) of one generation from prompt ids."""
    start = time.perf_counter()
    run = gen.events(ids, max_new_tokens=n, **settings)
    first, tokens = None, []
    for new, _, _ in run:
        if new and first is None:
            first = time.perf_counter()
        tokens += new
    return 1000 * ((first or time.perf_counter()) - start), tokens


def parser():
    ap = harness.script_parser(__doc__)
    ap.add_argument("artifact", help="artifact folder built with --system-prompt")
    ap.add_argument("--repeats", type=int, default=5, help="repeats (default 5)")
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads (default 2)")
    ap.add_argument("--max-new-tokens", type=int, default=16, help="tokens per answer at most (default 16)")
    ap.add_argument("--json", default=None, metavar="OUT", help="write the machine, command and results as JSON here")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    for name in ("repeats", "threads", "max_new_tokens"):
        if getattr(args, name) < 1:
            raise harness.HarnessError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    from specexport_runtime.api import load

    meta = harness.run_metadata(None if argv is None else [__file__, *argv], **vars(args))
    gen = load(args.artifact, threads=args.threads, shared_pool=True)
    stored = gen.prefix_cache.stored
    if stored is None:
        raise harness.HarnessError(f"{args.artifact!r} has no stored system prompt (build it with --system-prompt)")
    system = (Path(args.artifact) / stored.entry.text).read_text(encoding="utf-8")
    messages = [{"role": "system", "content": system}, {"role": "user", "content": QUESTION}]
    chat_ids, ids = gen.prepare_chat(messages).ids, [int(i) for i in stored.ids]
    first_token(gen, gen.prepare_chat([{"role": "user", "content": "Say hello."}]).ids, 4, cache_prompt=False)
    rows: dict[str, list[float]] = {"stored": [], "cold": [], "prefill": []}
    same = 0
    for rep in range(args.repeats):
        order = ("stored", "cold", "prefill") if rep % 2 == 0 else ("prefill", "cold", "stored")
        texts = {}
        for what in order:
            if what == "stored":
                gen.prefix_cache.pool.clear()
                stored.checked = False  # the first request's whole path: read, check, seed
                ms, texts[what] = first_token(gen, chat_ids, args.max_new_tokens)
                if gen.prefix_cache.describe()["cached_tokens"] == 0:
                    raise harness.HarnessError(f"the stored system prompt was not used: {stored.describe()}")
            elif what == "cold":
                ms, texts[what] = first_token(gen, chat_ids, args.max_new_tokens, cache_prompt=False)
            else:
                ms, _ = first_token(gen, ids, 1, cache_prompt=False)
            rows[what].append(ms)
            print(f"  repeat {rep + 1} {what:<8} {ms:8.1f} ms", file=sys.stderr)
        same += texts["stored"] == texts["cold"]
    med = {k: statistics.median(v) for k, v in rows.items()}
    drop = med["cold"] - med["stored"]
    print(
        harness.preamble(
            meta,
            None,
            f"first request ({len(chat_ids)} ids) over a {stored.entry.tokens}-id stored system prompt,"
            f" {args.repeats} repeats,"
            f" greedy, medians; stored = its rows restored, cold = cache_prompt false",
        )
    )
    ratio = drop / med["prefill"]
    paired = statistics.median((c - s) / p for s, c, p in zip(rows["stored"], rows["cold"], rows["prefill"]))
    print(f"{'stored ms':>10} {'cold ms':>9} {'drop ms':>9} {'prefill ms':>11} {'drop/prefill':>13} {'per repeat':>10}")
    figures = f"{med['stored']:>10.1f} {med['cold']:>9.1f} {drop:>9.1f} {med['prefill']:>11.1f}"
    print(f"{figures} {ratio:>13.3f} {paired:>10.3f}")
    print(f"answers equal: {same}/{args.repeats}")
    if args.json:
        harness.write_json(
            args.json,
            {"meta": meta, "ms": rows, "medians": med, "equal": same}
            | {"drop_over_prefill": ratio, "paired_drop_over_prefill": paired},
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(harness.cli(main))
