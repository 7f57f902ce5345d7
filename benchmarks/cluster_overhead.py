"""What the Ray Serve cluster costs per request, and what a second replica adds.

    python benchmarks/cluster_overhead.py ARTIFACT [--threads 1] [--repeats 5] [--requests 16]
        [--concurrency 4] [--max-tokens 256] [--json OUT]

Servers of the same artifact side by side, each on its own local port (so all see the same
background: Ray's own processes run throughout):
  single    `specexport-runtime serve` in a subprocess (uvicorn + the app, --threads)
  cluster1  `specexport-runtime serve --replicas 1 --ray-address auto` in a subprocess, joined to a
            local Ray cluster this script starts: the command's own HTTP front + 1 replica
            (--threads each), as an operator runs it;
  cluster2  the same command with --replicas 2 (the command is restarted to rescale);
  single2   two single servers side by side, the clients' requests alternating between them: what
            the host's cores allow two processes without Ray (the ceiling of cluster2).
Overhead: first the hops alone, `repeats` x 20 alternating pairs of GET /v1/models (answered by
the replica's app, no model work: front -> replica and back); then a short greedy completion (8
tokens) to single and to cluster1 in alternating pairs, `repeats` x 8 pairs after 3 warm-ups
each, not streamed (whole-request latency) and streamed (time to the first text); each the
median over pairs of cluster1's time minus single's. The completions' differences scatter by tens
of ms either way (the speculative rounds of two servers differ), so the hops' figure is the tight one. Throughput:
`requests` greedy streamed completions of `max-tokens` tokens from `concurrency` client threads;
generated tokens / wall seconds, the median over `repeats`. Each repeat runs the four in a
rotated order, and every server or rescale gets one run outside the set first (its first long
requests are slower). Ray is started with 4 logical CPUs so that placement never waits, and with
the settings `serve --replicas` starts its Ray with (deployment.RAY_ENVIRONMENT, unless set:
e.g. RAY_worker_niceness=15 measures Ray's default worker priority); the host's real cores are
what the replicas share (the ceiling: docs/serving.md). benchmarks/experiments/ingress_hops.py
compares this front with Ray's own HTTP proxy.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "runtime"))

from specexport.bench import harness  # noqa: E402

MODEL = "bench"  # --model-name of every server here
# the servers' environment: this checkout's packages first
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "runtime"), os.environ.get("PYTHONPATH", "")]),
}
PROMPTS = ["The quick brown fox", "def add(a, b):", "Write a function that adds two numbers.", "for i in range(10):"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def completion(port: int, prompt: str, n: int, stream: bool) -> tuple[float, float, int, float]:
    """(seconds to the whole answer, seconds to the first streamed byte of text, tokens, seconds the
    server itself spent: queue + first token + the other tokens at its decode rate, from the
    response's `speculative` figures; 0 for a stream) of one request."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": stream}
    body["return_token_ids"] = True
    start = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    first, tokens, inside = None, 0, 0.0
    if not stream:
        data = json.loads(resp.read())
        assert resp.status == 200, data
        tokens = len(data["choices"][0]["token_ids"])
        figures = data["speculative"]
        rest = (tokens - 1) / figures["decode_tokens_per_second"] if tokens > 1 else 0.0
        inside = figures.get("queue_seconds", 0.0) + figures["time_to_first_token_seconds"] + rest
    else:
        assert resp.status == 200, resp.read()
        while line := resp.readline():
            if line.startswith(b"data: {"):
                event = json.loads(line[6:])
                for choice in event.get("choices", []):
                    if choice.get("text") and first is None:
                        first = time.perf_counter()
                    tokens += len(choice.get("token_ids") or [])
    conn.close()
    end = time.perf_counter()
    return end - start, (first or end) - start, tokens, inside


def get(port: int, path: str) -> float:
    """Seconds to the whole answer of GET `path`."""
    start = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", path)
    resp = conn.getresponse()
    resp.read()
    assert resp.status == 200, resp.status
    conn.close()
    return time.perf_counter() - start


def overhead(single: int, cluster: int, repeats: int) -> dict:
    """Short requests to both servers in alternating pairs (A/B, then B/A); per pair the cluster's
    time minus the single server's, the median over pairs; `inside_ms`: the same of the time the
    server itself spent on the non-streamed request (what is not the hops); `outside_ms`: per pair,
    the extra latency less that (what the cluster adds around the server's work)."""
    for port in (single, cluster):
        for _ in range(3):
            completion(port, PROMPTS[0], 8, False)
    pairs: dict[str, list[float]] = {"hops_ms": [], "latency_ms": [], "inside_ms": [], "outside_ms": [], "ttft_ms": []}
    for i in range(repeats * 20):
        order = (single, cluster) if i % 2 == 0 else (cluster, single)
        got = {port: get(port, "/v1/models") for port in order}
        pairs["hops_ms"].append(1000 * (got[cluster] - got[single]))
    for i in range(repeats * 8):
        prompt, order = PROMPTS[i % 4], (single, cluster) if i % 2 == 0 else (cluster, single)
        for names, stream, indices in ((("latency_ms", "inside_ms"), False, (0, 3)), (("ttft_ms",), True, (1,))):
            got = {port: completion(port, prompt, 8, stream) for port in order}
            for name, index in zip(names, indices):
                pairs[name].append(1000 * (got[cluster][index] - got[single][index]))
            if not stream:  # the pair's extra latency less the servers' own difference: what the cluster adds
                pairs["outside_ms"].append(pairs["latency_ms"][-1] - pairs["inside_ms"][-1])
    return {name: statistics.median(values) for name, values in pairs.items()}


def throughput(ports: list[int], requests: int, concurrency: int, n: int) -> float:
    """Generated tokens per wall second of `requests` streamed completions from `concurrency`
    clients, request i to ports[i % len(ports)]."""
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        done = list(pool.map(lambda i: completion(ports[i % len(ports)], PROMPTS[i % 4], n, True), range(requests)))
    return sum(t for _, _, t, _ in done) / (time.perf_counter() - start)


def wait_ready(port: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"no server answered /health on port {port} within {timeout} s")


def parser() -> argparse.ArgumentParser:
    parser = harness.script_parser(__doc__)
    parser.add_argument("artifact", help="artifact folder")
    parser.add_argument("--threads", type=int, default=1, help="ONNX Runtime threads per server / replica (default 1)")
    parser.add_argument("--repeats", type=int, default=5, help="repeats of each measurement (default 5)")
    parser.add_argument("--requests", type=int, default=16, help="requests per throughput run (default 16)")
    parser.add_argument("--concurrency", type=int, default=4, help="client threads of a throughput run (default 4)")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens per throughput request (default 256)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures as JSON here")
    return parser


def serve_command(artifact: str, port: int, args, *extra: str) -> subprocess.Popen:
    """`specexport-runtime serve ARTIFACT` on `port` with this run's threads and queue, plus `extra`."""
    cmd = [sys.executable, "-m", "specexport_runtime.cli", "serve", artifact, "--port", str(port)]
    cmd += ["--threads", str(args.threads), "--max-queue", str(args.requests), "--model-name", MODEL]
    return subprocess.Popen([*cmd, "--log-level", "warning", *extra], env=ENV)


def cluster_command(artifact: str, port: int, replicas: int, args) -> subprocess.Popen:
    """`serve --replicas N` joined to this script's Ray cluster, serving on `port`."""
    return serve_command(
        artifact, port, args, "--replicas", str(replicas), "--ray-address", "auto", "--replica-cpus", "1"
    )


def stop(process: subprocess.Popen) -> None:
    """SIGINT (the command drains and leaves the cluster), then wait."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(120)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(30)


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    meta = harness.run_metadata(None if argv is None else [__file__, *argv], **vars(args))
    results: dict = {"meta": meta}
    load = (args.requests, args.concurrency, args.max_tokens)
    import ray
    from ray import serve

    from specexport_runtime.cluster.deployment import ray_environment

    single_port, second_port, cluster_port = free_port(), free_port(), free_port()
    singles = [serve_command(args.artifact, port, args) for port in (single_port, second_port)]
    meta["ray_environment"] = ray_environment()  # as `serve --replicas` starts its own Ray
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    runs: dict[str, list[float]] = {"single": [], "cluster1": [], "cluster2": [], "single2": []}
    ports = {"single": [single_port], "single2": [single_port, second_port], "cluster1": [cluster_port]}
    ports["cluster2"] = ports["cluster1"]
    command: subprocess.Popen | None = None
    deployed = None

    def scale(replicas: int) -> None:
        nonlocal command
        if command is not None:
            stop(command)
        command = cluster_command(args.artifact, cluster_port, replicas, args)
        wait_ready(cluster_port, 300)
        throughput([cluster_port], *load)  # outside the set

    try:
        for port in (single_port, second_port):
            wait_ready(port)
        throughput([single_port, second_port], *load)  # outside the set
        scale(1)
        deployed = "cluster1"
        results["overhead"] = overhead(single_port, cluster_port, args.repeats)
        for repeat in range(args.repeats):
            names = list(runs)
            for name in names[repeat % 4 :] + names[: repeat % 4]:
                if name.startswith("cluster") and name != deployed:
                    scale(int(name[-1]))
                    deployed = name
                runs[name].append(throughput(ports[name], *load))
    finally:
        if command is not None:
            stop(command)
        for process in singles:
            process.terminate()
            process.wait(60)
        serve.shutdown()
        ray.shutdown()
    for name, values in runs.items():
        results[name] = {"tokens_per_second": statistics.median(values), "runs": values}
    # per repeat (neighbours in time: the host's drift cancels), then the median
    results["two_over_one"] = statistics.median(b / a for a, b in zip(runs["cluster1"], runs["cluster2"]))
    results["single_two_over_one"] = statistics.median(b / a for a, b in zip(runs["single"], runs["single2"]))

    extra = results["overhead"]
    print(harness.header(meta))
    for name in ("single", "cluster1", "cluster2", "single2"):
        print(f"{name:9} {results[name]['tokens_per_second']:8.1f} tok/s")
    print(
        f"cluster overhead per request (median of paired differences): {extra['hops_ms']:+.1f} ms hops alone,"
        f" {extra['latency_ms']:+.1f} ms latency"
        f" (of which inside the server {extra['inside_ms']:+.1f} ms; around it {extra['outside_ms']:+.1f} ms),"
        f" {extra['ttft_ms']:+.1f} ms first token; 2 replicas / 1: {results['two_over_one']:.2f}x,"
        f" 2 single servers / 1: {results['single_two_over_one']:.2f}x (medians of per-repeat ratios)"
    )
    if args.json:
        harness.write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(harness.cli(main))
