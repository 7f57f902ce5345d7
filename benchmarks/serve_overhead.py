"""What the HTTP server costs: the same prompts streamed through `specexport serve` and in-process.

    python benchmarks/serve_overhead.py ARTIFACT [--prompts chat] [--limit 5] [--max-new-tokens 128]
        [--repeats 3] [--threads 2] [--proposer P] [--json OUT]

One process loads the artifact once and starts the real server (uvicorn + the app, on a random
local port, no API key) on that same generator, so both paths use the same ONNX Runtime sessions.
For every prompt and repeat it runs, in alternating order, (a) in-process streaming with
SpecGenerator.chat(stream=True) and (b) a streaming chat completion through the official `openai`
client (greedy, the same proposer, the same max tokens). The server is idle while (a) runs.

Both are timed the same way, from the caller's side: time to first token = call to the first
non-empty text piece; decode tok/s = (tokens - 1) / (last piece - first piece), with the server's
token count from its usage chunk and the in-process one from its Generation's stats. Per prompt the median
over repeats, then the median over prompts. The issue's targets: decode tok/s through the server
at most 5% below in-process, time to first token within 20 ms of it. Greedy outputs must match;
a prompt whose texts differ is reported.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import threading
import time

from specexport_runtime.api import load
from specexport_runtime.server.config import ServerConfig
from specexport_runtime.server.run import make_server

from specexport.prompts import load_prompts


def timed(pieces, count) -> dict:
    """Times of a stream of text pieces; `count()` gives the generated tokens once it is consumed."""
    start = time.perf_counter()
    first = last = None
    text = []
    for piece in pieces:
        if piece:
            now = time.perf_counter()
            first = first or now
            last = now
            text.append(piece)
    n = count()
    decode = (n - 1) / (last - first) if first is not None and last > first and n > 1 else 0.0
    return {"ttft_ms": 1000 * ((first or time.perf_counter()) - start), "decode_tps": decode, "tokens": n,
            "text": "".join(text)}


def in_process(gen, messages, n, proposer) -> dict:
    run = gen.events(gen.codec.encode_chat(messages), max_new_tokens=n, proposer=proposer)
    return timed(run.pieces(), lambda: run.stats.new_tokens)


def through_server(client, model, messages, n, proposer) -> dict:
    usage = {}

    def pieces():
        stream = client.chat.completions.create(model=model, messages=messages, max_tokens=n, temperature=0,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body={"proposer": proposer})
        for chunk in stream:
            if chunk.usage is not None:
                usage["n"] = chunk.usage.completion_tokens
            if chunk.choices:
                yield chunk.choices[0].delta.content or ""

    return timed(pieces(), lambda: usage["n"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact")
    parser.add_argument("--prompts", default="chat", help="a calibration domain or a prompt file (default chat)")
    parser.add_argument("--limit", type=int, default=5, help="prompts used (default 5)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--proposer", default=None, help="default: the artifact's")
    parser.add_argument("--json", default=None, help="write the per-prompt rows and the summary here")
    args = parser.parse_args()

    import openai

    gen = load(args.artifact, threads=args.threads, shared_pool=True)
    proposer = gen.resolve_proposer(args.proposer)
    prompts = [p for p in load_prompts(args.prompts) if p.messages][: args.limit]
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = make_server(gen, ServerConfig(port=sock.getsockname()[1]), log_level="warning", access_log=False)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}/v1", api_key="none", max_retries=0)
    model = server.state.model
    rows = []
    try:
        warm = [{"role": "user", "content": "warm up"}]
        in_process(gen, warm, 8, proposer)
        through_server(client, model, warm, 8, proposer)
        for i, prompt in enumerate(prompts):
            messages = [{"role": role, "content": content} for role, content in prompt.messages]
            room = gen.manifest.max_context - len(gen.codec.encode_chat(messages))
            n = min(args.max_new_tokens, room)
            runs = {"in_process": [], "server": []}
            for r in range(args.repeats):
                order = ("in_process", "server") if (i + r) % 2 == 0 else ("server", "in_process")
                for path in order:
                    runs[path].append(in_process(gen, messages, n, proposer) if path == "in_process"
                                      else through_server(client, model, messages, n, proposer))
            row = {"id": prompt.id, "tokens": runs["in_process"][0]["tokens"],
                   "same_text": all(x["text"] == runs["in_process"][0]["text"] for v in runs.values() for x in v)}
            for path, values in runs.items():
                row[f"{path}_decode_tps"] = statistics.median(x["decode_tps"] for x in values)
                row[f"{path}_ttft_ms"] = statistics.median(x["ttft_ms"] for x in values)
            rows.append(row)
            print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    finally:
        server.should_exit = True
        thread.join(30)
    summary = {
        "prompts": len(rows), "repeats": args.repeats, "proposer": proposer,
        "in_process_decode_tps": statistics.median(r["in_process_decode_tps"] for r in rows),
        "server_decode_tps": statistics.median(r["server_decode_tps"] for r in rows),
        "in_process_ttft_ms": statistics.median(r["in_process_ttft_ms"] for r in rows),
        "server_ttft_ms": statistics.median(r["server_ttft_ms"] for r in rows),
        "outputs_equal": all(r["same_text"] for r in rows),
    }
    summary["decode_ratio"] = summary["server_decode_tps"] / summary["in_process_decode_tps"]
    summary["ttft_extra_ms"] = summary["server_ttft_ms"] - summary["in_process_ttft_ms"]
    summary["meets_targets"] = summary["decode_ratio"] >= 0.95 and summary["ttft_extra_ms"] <= 20
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in summary.items()}))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"rows": rows, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
