"""Python overhead and memory flatness of the runtime on one long generation.

Reports, for speculation off and on: time inside ONNX Runtime session calls (both models) vs
total generation time, i.e. the share spent in Python around them, and the resident memory
(RSS) after the first 100 tokens vs at the end.

    python benchmarks/runtime_overhead.py ARTIFACT [--tokens 2000] [--proposer draft|ngram]
"""

from __future__ import annotations

import argparse
import json

import psutil

from specexport_runtime.api import load

PROMPT = "Write a long, detailed tutorial about binary search trees in Python, with code for every operation."


def measure(gen, speculative: bool, proposer: str | None, tokens: int) -> dict:
    process = psutil.Process()
    rss: list[int] = []
    for model in (gen.target, gen.draft):
        if model is not None:
            model.stats.__init__()  # count this generation's calls only
    count = 0
    run = gen.events(gen.codec.encode_chat([{"role": "user", "content": PROMPT}]), max_new_tokens=tokens,
                     speculative=speculative, proposer=proposer, gamma=None)
    for _ in run.pieces():
        count += 1
        rss.append(process.memory_info().rss)
    stats = run.stats
    ort_seconds = gen.target.stats.seconds + (gen.draft.stats.seconds if gen.draft is not None else 0.0)
    total = stats.total_seconds
    early = rss[min(len(rss) - 1, 20)]
    return {
        "speculative": speculative,
        "new_tokens": stats.new_tokens,
        "tokens_per_second": round(stats.tokens_per_second, 1),
        "total_s": round(total, 2),
        "onnxruntime_s": round(ort_seconds, 2),
        "python_share": round(1 - ort_seconds / total, 4),
        "rss_mb_early": round(early / 2**20, 1),
        "rss_mb_end": round(rss[-1] / 2**20, 1),
        "rss_growth": round(rss[-1] / early - 1, 4),
        "finish": stats.new_tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact")
    parser.add_argument("--tokens", type=int, default=2000, help="new tokens to generate (default 2000)")
    parser.add_argument("--proposer", choices=["draft", "ngram"], default=None)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    gen = load(args.artifact, threads=args.threads, shared_pool=True)
    gen.generate("warm up", max_new_tokens=8)
    rows = [measure(gen, False, None, args.tokens), measure(gen, True, args.proposer, args.tokens)]
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
