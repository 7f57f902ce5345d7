"""Prefix reuse through the server: a multi-turn chat over a long system prompt, each turn sending
the whole history, against the same messages on a server that prefills them from scratch.

    python benchmarks/prefix_reuse.py ARTIFACT [--turns 6] [--system-tokens 1000]
        [--max-new-tokens 32] [--repeats 3] [--threads 2] [--proposer P] [--json OUT]

One process loads the artifact once and starts the real server (uvicorn + the app, on a random
local port, no API key). A repeat is one conversation: a system prompt of about --system-tokens
tokens (coding guidelines, deterministic) and --turns short user questions; each turn's answer
(greedy, --max-new-tokens tokens at most) joins the history of the next. Per turn the same
messages go twice to the server, in alternating order from repeat to repeat:
    warm   the request as a client sends it: the server reuses the longest cached prefix
    fresh  the same messages with `cache_prompt: false`: the whole history is prefilled, which
           is what a server that never saw the conversation does (the pool is neither read nor
           written, so the warm path's pool is what its own turns left)
Each repeat starts with an empty pool. Time to first token = the streaming request's call to its
first non-empty content delta, from the client's side; cached tokens from the usage chunk. Per
turn the median over repeats, and the ratio fresh / warm of the medians. The answers of the two
paths must be identical, token for token (greedy; exact for a `bitwise` artifact).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "runtime"))

from specexport.bench import harness  # noqa: E402

GUIDELINES = [
    "Write small functions with one purpose each, and name them for what they return.",
    "Check every argument at the boundary of a module and raise a typed error naming the value.",
    "Prefer plain data structures and pure functions; keep state in one place and say who owns it.",
    "Comments state shapes and invariants, not history; documentation is a reference, one table per question.",
    "Tests compare against an independent reference and must be able to fail.",
    "Measure speed in benchmarks with medians over repeats, never in unit tests.",
    "Keep modules under five hundred lines, and split them by responsibility before they grow.",
    "Never swallow an exception: handle it where the caller can act, or let it propagate with context.",
]
QUESTIONS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Now make it iterative.",
    "Add a docstring and a type hint.",
    "Write a test for it.",
    "What is its time complexity?",
    "Rewrite it in JavaScript.",
    "Explain the difference briefly.",
    "Give one more test case.",
]


def system_prompt(codec, tokens: int) -> str:
    """Guidelines, repeated in numbered sections, until the text holds at least `tokens` tokens."""
    lines = ["You are a coding assistant inside an editor. Follow the team's guidelines below."]
    k = 0
    while len(codec.encode("\n".join(lines))) < tokens:
        lines.append(f"{k + 1}. {GUIDELINES[k % len(GUIDELINES)]}")
        k += 1
    return "\n".join(lines)


def stream(client, model: str, messages: list[dict], n: int, proposer: str, cache: bool) -> dict:
    """One streamed chat completion: time to first content, its text, its cached tokens."""
    start = time.perf_counter()
    first, text, usage = None, [], None
    chunks = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=n,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"proposer": proposer, "cache_prompt": cache},
    )
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text.append(chunk.choices[0].delta.content)
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return {
        "ttft_ms": 1000 * ((first or time.perf_counter()) - start),
        "text": "".join(text),
        "prompt_tokens": usage.prompt_tokens,
        "cached_tokens": cached,
    }


def parser() -> argparse.ArgumentParser:
    ap = harness.script_parser(__doc__)
    ap.add_argument("artifact", help="artifact folder (specexport build)")
    ap.add_argument("--turns", type=int, default=6, help=f"user turns, 1..{len(QUESTIONS)} (default 6)")
    ap.add_argument("--system-tokens", type=int, default=1000, help="system prompt tokens, about (default 1000)")
    ap.add_argument("--proposer", default=None, help="the proposer of every request (default: the artifact's)")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="tokens per answer at most (default 32)")
    ap.add_argument("--repeats", type=int, default=3, help="conversations (default 3)")
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads (default 2)")
    ap.add_argument("--json", default=None, metavar="OUT", help="write the machine, command and results as JSON here")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if not 1 <= args.turns <= len(QUESTIONS):
        raise harness.HarnessError(f"--turns must be in 1..{len(QUESTIONS)}, got {args.turns}")
    for name in ("system_tokens", "max_new_tokens", "repeats", "threads"):
        if getattr(args, name) < 1:
            raise harness.HarnessError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    import openai

    from specexport.bench.harness_workers import LocalServer
    from specexport_runtime.api import load

    meta = harness.run_metadata(None if argv is None else [__file__, *argv], **vars(args))
    gen = load(args.artifact, threads=args.threads, shared_pool=True)
    proposer = gen.resolve_proposer(args.proposer)
    server = LocalServer(gen)
    client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)
    model = server.state.model
    system = system_prompt(gen.codec, args.system_tokens)
    warmup = [{"role": "user", "content": "Say hello."}]
    stream(client, model, warmup, 4, proposer, False)  # sessions warm, outside the measured set
    rows: dict[int, dict[str, list]] = {
        t: {"warm": [], "fresh": [], "cached": [], "prompt": []} for t in range(args.turns)
    }
    same = total = 0
    try:
        for rep in range(args.repeats):
            gen.prefix_cache.pool.clear()
            messages = [{"role": "system", "content": system}]
            for t in range(args.turns):
                messages.append({"role": "user", "content": QUESTIONS[t]})
                order = ("warm", "fresh") if (rep + t) % 2 == 0 else ("fresh", "warm")
                got = {p: stream(client, model, messages, args.max_new_tokens, proposer, p == "warm") for p in order}
                rows[t]["warm"].append(got["warm"]["ttft_ms"])
                rows[t]["fresh"].append(got["fresh"]["ttft_ms"])
                rows[t]["cached"].append(got["warm"]["cached_tokens"])
                rows[t]["prompt"].append(got["warm"]["prompt_tokens"])
                same += got["warm"]["text"] == got["fresh"]["text"]
                total += 1
                print(
                    f"  repeat {rep + 1} turn {t + 1}: warm {got['warm']['ttft_ms']:7.1f} ms"
                    f" ({got['warm']['cached_tokens']}/{got['warm']['prompt_tokens']} cached),"
                    f" fresh {got['fresh']['ttft_ms']:7.1f} ms",
                    file=sys.stderr,
                )
                messages.append({"role": "assistant", "content": got["warm"]["text"]})
    finally:
        server.close()
    turns = []
    for t in range(args.turns):
        warm, fresh = statistics.median(rows[t]["warm"]), statistics.median(rows[t]["fresh"])
        turns.append(
            {
                "turn": t + 1,
                "prompt_tokens": int(statistics.median(rows[t]["prompt"])),
                "cached_tokens": int(statistics.median(rows[t]["cached"])),
                "warm_ttft_ms": warm,
                "fresh_ttft_ms": fresh,
                "fresh_over_warm": fresh / warm if warm > 0 else float("nan"),
            }
        )
    print(
        harness.preamble(
            meta,
            None,
            f"{args.turns} turns over a {len(gen.codec.encode(system))}-token system prompt, {args.repeats}"
            f" conversation(s), greedy, {args.max_new_tokens} tokens an answer, proposer {proposer};"
            " warm = reusing the server's cached prefix, fresh = the same messages with cache_prompt false",
        )
    )
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'warm ms':>9} {'fresh ms':>9} {'fresh/warm':>10}")
    for row in turns:
        print(
            f"{row['turn']:>4} {row['prompt_tokens']:>7} {row['cached_tokens']:>7} {row['warm_ttft_ms']:>9.1f}"
            f" {row['fresh_ttft_ms']:>9.1f} {row['fresh_over_warm']:>10.2f}"
        )
    print(f"answers equal: {same}/{total}")
    if args.json:
        harness.write_json(args.json, {"meta": meta, "turns": turns, "answers_equal": f"{same}/{total}"})
    return 0


if __name__ == "__main__":
    raise SystemExit(harness.cli(main))
