"""One recipe built with and without batch slots, each under `specexport serve` defaults: disk, memory, speed.

    python benchmarks/default_slots.py BATCH1_ARTIFACT SLOTS_ARTIFACT [--prompts chat,code] [--limit 8]
        [--max-new-tokens 128] [--passes 3] [--clients 4] [--threads 2] [--json OUT]

BATCH1_ARTIFACT and SLOTS_ARTIFACT come from one recipe, the second built with `--max-batch K`.
Each is served as a user serves it: `specexport serve ARTIFACT --threads T`, every other option
at its default, so the slots artifact runs its batch graph with K slots (one sequence alone in it
at one client) and the other its batch-1 graph. A server keeps the suffix store of earlier
answers, so no server answers a measured prompt twice: every pass starts fresh servers for each
of its two phases.

one client  both servers up at once; each answers a warm-up prompt outside the set, then the
            prompts are sent one at a time, greedy, non-streaming (/v1/completions on the chat
            template's token ids, `cache_prompt` off), to one server and then the other, the
            order rotated prompt by prompt (harness.run_interleaved). Decode tok/s is the
            server's own (`speculative.decode_tokens_per_second`); wall tok/s the client's.
C clients   each server alone in turn (order rotated by pass): a warm-up, then C threads share
            the prompts (client k sends prompts k, k + C, ...); aggregate tok/s = completion
            tokens / wall seconds of the whole set.
memory      each server process's resident set once /health answers (VmRSS) and its peak
            (VmHWM) at the end of each phase, read from /proc/PID/status (Linux).
disk        bytes of every file under each artifact.

Per prompt the median over passes, then the median over prompts; the slots / batch-1 decode
ratio is the median over prompts of per-prompt ratios, with a 95% bootstrap interval. Every
greedy output is compared with the batch-1 server's one-client output of the same prompt.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "runtime"))
sys.path.insert(0, str(REPO / "benchmarks"))

from batch_servers import drive  # noqa: E402
from llamacpp_servers import HttpServer, free_port  # noqa: E402

from specexport.bench import harness  # noqa: E402

MIB = 1 << 20
MEMORY = "the suffix store of earlier answers, kept by each server process (fresh servers every pass and phase)"
NAMES = ("batch1", "slots")


def disk_bytes(root: Path) -> int:
    """Bytes of every regular file under root."""
    return sum(p.stat().st_size for p in Path(root).rglob("*") if p.is_file())


def proc_memory(pid: int) -> dict[str, int]:
    """{"rss": VmRSS, "peak": VmHWM} of a live process in bytes, from /proc/PID/status."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields["rss" if key == "VmRSS" else "peak"] = int(value.split()[0]) * 1024  # "123 kB"
    return fields


class Served(HttpServer):
    """`specexport serve ARTIFACT --threads T`, all else at its defaults."""

    kind = "specexport serve"

    def __init__(self, name: str, artifact: Path, threads: int, log: Path):
        port = free_port()
        cmd = [sys.executable, "-m", "specexport_runtime.cli", "serve", str(artifact), "--port", str(port)]
        super().__init__(name, [*cmd, "--threads", str(threads)], port, log)
        self.loaded: dict[str, int] = {}

    def ready(self) -> Served:
        self.wait_ready()
        self.loaded = proc_memory(self.proc.pid)
        return self

    def complete(self, ids: list[int], n: int) -> dict:
        body = {"prompt": ids, "max_tokens": n, "temperature": 0, "return_token_ids": True, "cache_prompt": False}
        res, _ = self.post("/v1/completions", body)
        spec = res["speculative"]
        return {
            "tokens": res["choices"][0]["token_ids"],
            "decode_tps": spec["decode_tokens_per_second"],
            "proposer": spec["proposer"],
            "gamma_policy": spec["gamma_policy"],
        }


def one_client(servers: dict[str, Served], cases, warm, n: int) -> harness.Run:
    methods = [
        harness.Method(name, lambda c, s=s: s.complete(list(c.ids), n), None, MEMORY) for name, s in servers.items()
    ]
    return harness.run_interleaved(methods, cases, warm, 1, settle=harness.SETTLE_SECONDS)


def parser():
    ap = harness.script_parser(__doc__)
    ap.add_argument("batch1", type=Path, help="the recipe's artifact built without batch slots (max_batch 1)")
    ap.add_argument("slots", type=Path, help="the same recipe built with --max-batch K (K >= --clients)")
    ap.add_argument("--passes", type=int, default=3, help="passes, each with fresh servers (default 3)")
    ap.add_argument("--clients", type=int, default=4, help="concurrent clients of the second phase (default 4)")
    harness.add_run_options(ap, prompts="chat,code", limit=8, max_new_tokens=128, repeats=None, threads=2)
    return ap


def main(argv=None) -> int:
    args = harness.parse_args(parser(), argv)
    from specexport_runtime.api import open_artifact
    from specexport_runtime.manifest import read_manifest

    has = {name: read_manifest(path).target.max_batch for name, path in zip(NAMES, (args.batch1, args.slots))}
    if has["batch1"] != 1 or has["slots"] < max(2, args.clients) or args.passes < 1:
        raise harness.HarnessError(
            f"need a batch-1 artifact, a slots artifact with max_batch >= --clients and --passes >= 1; got max_batch"
            f" {has['batch1']} and {has['slots']}, --clients {args.clients}, --passes {args.passes}"
        )
    meta = harness.run_metadata(None if argv is None else [__file__, *argv], **vars(args))
    _, codec, _ = open_artifact(args.batch1)
    cases = harness.make_cases(codec, harness.load_prompt_set(args.prompts, args.limit))
    warm = harness.warmup_case(codec)
    paths = dict(zip(NAMES, (args.batch1, args.slots)))
    logs = Path(args.json).parent if args.json else Path(".")
    memory: dict[str, dict[str, list[int]]] = {k: {"loaded": [], "peak_one": [], "peak_many": []} for k in NAMES}
    runs, aggregate, many_outputs = [], {k: [] for k in NAMES}, {k: [] for k in NAMES}

    def start(name: str, phase: str) -> Served:
        return Served(name, paths[name], args.threads, logs / f"default_slots-{name}-{phase}.log")

    for p in range(args.passes):
        servers: dict[str, Served] = {}
        try:
            for name in NAMES:
                servers[name] = start(name, "one")
            for s in servers.values():
                s.ready()
            runs.append(one_client(servers, cases, warm, args.max_new_tokens))
            for name, s in servers.items():
                memory[name]["loaded"].append(s.loaded["rss"])
                memory[name]["peak_one"].append(proc_memory(s.proc.pid)["peak"])
        finally:
            for s in servers.values():
                s.close()
        for name in harness.rotated(NAMES, p):
            s = start(name, "many").ready()
            try:
                drive(lambda ids, n, s=s: s.complete(ids, n)["tokens"], [warm], args.max_new_tokens, 1)
                run = drive(lambda ids, n, s=s: s.complete(ids, n)["tokens"], cases, args.max_new_tokens, args.clients)
                memory[name]["peak_many"].append(proc_memory(s.proc.pid)["peak"])
            finally:
                s.close()
            aggregate[name].append(run["tokens"] / run["seconds"])
            many_outputs[name].append(run["outputs"])
            print(f"pass {p + 1} {name}: {args.clients} clients {aggregate[name][-1]:.1f} tok/s", file=sys.stderr)
    merged = harness.Run(runs[0].methods, runs[0].cases, args.passes)
    for r, run in enumerate(runs):
        merged.samples += [replace(s, repeat=r) for s in run.samples]
    summary = summarize(merged, paths, memory, aggregate, many_outputs, args.clients)
    print(report(meta, merged, summary, args, has["slots"]))
    if args.json:
        harness.write_json(args.json, {"meta": meta, "summary": summary, "run": merged.to_dict()})
    return 0


def summarize(run: harness.Run, paths, memory, aggregate, many_outputs, clients: int) -> dict:
    """The figures of both artifacts (bytes and tok/s) and how the slots one compares."""
    reference = {c.id: run.samples_of("batch1", c.id)[0].result["tokens"] for c in run.cases}
    out: dict = {"artifacts": {}}
    for name in NAMES:
        same, total = run.same_tokens(name, "batch1")
        many_same = sum(o[k] == reference[k] for o in many_outputs[name] for k in reference)
        out["artifacts"][name] = {
            "path": str(paths[name]),
            "disk_bytes": disk_bytes(paths[name]),
            "rss_loaded_bytes": statistics.median(memory[name]["loaded"]),
            "peak_rss_one_client_bytes": max(memory[name]["peak_one"]),
            f"peak_rss_{clients}_clients_bytes": max(memory[name]["peak_many"]),
            "decode_tps_one_client": run.median(name, "decode_tps"),
            "wall_tps_one_client": run.median(name, harness.wall_tok_s),
            f"aggregate_tps_{clients}_clients": statistics.median(aggregate[name]),
            f"aggregate_tps_{clients}_clients_per_pass": aggregate[name],
            "one_client_identical": f"{same}/{total}",
            f"{clients}_clients_identical": f"{many_same}/{len(reference) * len(many_outputs[name])}",
            "proposer": run.samples_of(name)[0].result["proposer"],
            "gamma_policy": run.samples_of(name)[0].result["gamma_policy"],
        }
    for metric, key in (("decode_tps", "decode_ratio"), (harness.wall_tok_s, "wall_ratio")):
        ratio = run.ratio("slots", "batch1", metric)
        out[key], out[f"{key}_ci95"] = ratio["median"], ratio["ci95"]
    per_pass = [s / b for s, b in zip(aggregate["slots"], aggregate["batch1"])]
    out[f"aggregate_ratio_{clients}_clients"] = statistics.median(per_pass)
    return out


def report(meta: dict, run: harness.Run, summary: dict, args, slots: int) -> str:
    c = args.clients
    lines = [
        harness.preamble(
            meta,
            run,
            f"{len(run.cases)} prompts ({args.prompts}), {args.max_new_tokens} tokens, greedy, {args.passes} pass(es),"
            f" {args.threads} threads; slots artifact: max_batch {slots}",
        ),
        f"| artifact | disk MiB | RSS loaded MiB | peak RSS 1 client | peak RSS {c} clients | decode tok/s 1 client"
        f" | wall tok/s 1 client | {c} clients tok/s | identical (1 / {c}) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, a in summary["artifacts"].items():
        lines.append(
            f"| {name} | {a['disk_bytes'] / MIB:.1f} | {a['rss_loaded_bytes'] / MIB:.0f}"
            f" | {a['peak_rss_one_client_bytes'] / MIB:.0f} | {a[f'peak_rss_{c}_clients_bytes'] / MIB:.0f}"
            f" | {a['decode_tps_one_client']:.1f} | {a['wall_tps_one_client']:.1f}"
            f" | {a[f'aggregate_tps_{c}_clients']:.1f} | {a['one_client_identical']} / {a[f'{c}_clients_identical']} |"
        )
    for key in ("decode_ratio", "wall_ratio"):
        lo, hi = summary[f"{key}_ci95"]
        lines.append(f"slots / batch1 {key.split('_')[0]} tok/s, one client: {summary[key]:.3f} [{lo:.3f}, {hi:.3f}]")
    lines.append(f"slots / batch1 aggregate tok/s, {c} clients: {summary[f'aggregate_ratio_{c}_clients']:.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(harness.cli(main))
