"""What the HTTP server costs: the same prompts streamed through `specexport serve` and in-process.

    python benchmarks/serve_overhead.py ARTIFACT [--prompts chat] [--limit 5] [--max-new-tokens 128]
        [--repeats 3] [--threads 2] [--proposer P] [--json OUT]

One process loads the artifact once and starts the real server (uvicorn + the app, on a random
local port, no API key) on that same generator, so both paths use the same ONNX Runtime sessions.
The run follows specexport.bench.harness: each path first streams a warm-up prompt outside the measured
set; then prompt by prompt, each repeat runs (a) in-process streaming (SpecGenerator.events over
the chat template's ids) and (b) a streaming chat completion through the official `openai` client
(greedy, the same proposer and max tokens, token ids requested with return_token_ids), in
alternating order. The server is idle while (a) runs. Both share one suffix store of earlier
answers, emptied before every generation, so neither path drafts from the other's answer.

Both are timed the same way, from the caller's side: time to first token = call to the first
non-empty text piece; decode tok/s = (tokens - 1) / (last piece - first piece). Per prompt the
median over repeats, then the median over prompts; decode ratio = the median over prompts of the
per-prompt server / in-process ratio (95% bootstrap interval), extra first-token ms likewise of
the differences. The targets: decode tok/s through the server at most 5% below in-process, time
to first token within 20 ms of it. Greedy outputs must match token for token.
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

WARMUP_TOKENS = 8


def timed(pieces) -> dict:
    """Times of a stream of (token ids, text piece) pairs, from this call on."""
    start = time.perf_counter()
    first = last = None
    tokens: list[int] = []
    for ids, piece in pieces:
        tokens += ids
        if piece:
            now = time.perf_counter()
            first = first or now
            last = now
    n = len(tokens)
    decode = (n - 1) / (last - first) if first is not None and last > first and n > 1 else 0.0
    return {"ttft_ms": 1000 * ((first or time.perf_counter()) - start), "decode_tps": decode, "tokens": tokens}


def in_process(gen, case: harness.Case, n: int, proposer: str) -> dict:
    run = gen.events(list(case.ids), max_new_tokens=n, proposer=proposer, cache_prompt=False)  # cold prefills
    return timed((new, piece) for new, piece, _ in run)


def through_server(client, model: str, messages: list[dict], n: int, proposer: str) -> dict:
    def pieces():
        stream = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=n,
            temperature=0,
            stream=True,
            extra_body={"proposer": proposer, "return_token_ids": True, "cache_prompt": False},
        )
        for chunk in stream:
            if chunk.choices:
                choice = chunk.choices[0]
                yield (choice.model_extra or {}).get("token_ids") or [], choice.delta.content or ""

    return timed(pieces())


def parser() -> argparse.ArgumentParser:
    ap = harness.script_parser(__doc__)
    ap.add_argument("artifact", help="artifact folder (specexport build)")
    ap.add_argument("--proposer", default=None, help="the proposer of both paths (default: the artifact's)")
    harness.add_run_options(ap, prompts="chat", limit=5, max_new_tokens=128, repeats=3, threads=2)
    return ap


def main(argv=None) -> int:
    args = harness.parse_args(parser(), argv)
    import numpy as np
    import openai

    from specexport.bench.harness_workers import SPECEXPORT_MEMORY, LocalServer
    from specexport_runtime.api import load

    prompts = [p for p in harness.load_prompt_set(args.prompts, limit=args.limit) if p.is_chat]
    if not prompts:
        raise harness.HarnessError(f"--prompts {args.prompts!r} holds no chat prompts")
    meta = harness.run_metadata(None if argv is None else [__file__, *argv], **vars(args))
    gen = load(args.artifact, threads=args.threads, shared_pool=True)
    proposer = gen.resolve_proposer(args.proposer)
    server = LocalServer(gen)
    client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)

    def room(case: harness.Case) -> int:
        return min(case.max_new_tokens or args.max_new_tokens, gen.manifest.max_context - len(case.ids))

    def messages(case: harness.Case) -> list[dict]:
        return case.prompt.chat() if case.prompt is not None else list(harness.WARMUP_MESSAGES)

    methods = [
        harness.Method(
            "in_process", lambda c: in_process(gen, c, room(c), proposer), gen.forget_history, SPECEXPORT_MEMORY
        ),
        harness.Method(
            "server",
            lambda c: through_server(client, server.state.model, messages(c), room(c), proposer),
            gen.forget_history,
            SPECEXPORT_MEMORY,
        ),
    ]

    def progress(s: harness.Sample) -> None:
        print(
            f"  {s.case:<20} {s.method:<10} {s.result['decode_tps']:7.1f} tok/s  {s.result['ttft_ms']:6.1f} ms",
            file=sys.stderr,
        )

    try:
        run = harness.run_interleaved(
            methods,
            harness.make_cases(gen.codec, prompts),
            harness.warmup_case(gen.codec, WARMUP_TOKENS),
            args.repeats,
            progress=progress,
        )
    finally:
        server.close()
    ratio = run.ratio("server", "in_process", "decode_tps")
    ttft = {k: run.per_case(k, "ttft_ms") for k in ("server", "in_process")}
    extra = [ttft["server"][c] - ttft["in_process"][c] for c in ttft["server"]]
    same, total = run.same_tokens("server", "in_process")
    summary = {
        "prompts": total,
        "repeats": args.repeats,
        "proposer": proposer,
        **{f"{k}_decode_tps": run.median(k, "decode_tps") for k in ("in_process", "server")},
        **{f"{k}_ttft_ms": run.median(k, "ttft_ms") for k in ("in_process", "server")},
        "decode_ratio": ratio["median"],
        "decode_ratio_ci95": ratio["ci95"],
        "ttft_extra_ms": statistics.median(extra),
        "ttft_extra_ms_ci95": harness.bootstrap_ci(extra, 0, stat=np.median),
        "outputs_equal": f"{same}/{total}",
    }
    summary["meets_targets"] = summary["decode_ratio"] >= 0.95 and summary["ttft_extra_ms"] <= 20
    print(
        harness.preamble(
            meta,
            run,
            f"{total} chat prompts ({args.prompts}), {args.repeats} repeat(s), proposer "
            f"{proposer}, streamed in-process and through the server, interleaved prompt by prompt",
        )
    )
    for key, value in summary.items():
        if isinstance(value, tuple):
            value = "[{:.3f}, {:.3f}]".format(*value)
        shown = round(value, 3) if isinstance(value, float) else value
        print(f"{key:<22} {shown}")
    if args.json:
        harness.write_json(args.json, {"meta": meta, "summary": summary, "run": run.to_dict()})
    return 0


if __name__ == "__main__":
    raise SystemExit(harness.cli(main))
