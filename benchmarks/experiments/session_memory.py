"""Resident memory and target-only decode speed of an artifact, with ONNX Runtime's weight
repacking on (the default) and off.

    python benchmarks/experiments/session_memory.py ARTIFACT [--repeats 2] [--max-new-tokens 128]
        [--threads 2] [--json OUT]

Each (setting, repeat) runs in a fresh process of its own (resident memory is per process), the
settings alternating: load(ARTIFACT, prepack=...) with every graph the artifact holds (a tree
graph is a second session on the target's weights file), then three target-only generations of
--max-new-tokens from a fixed 100-token prompt. Per setting: resident memory after load and after
decoding (MiB, medians), and decode tok/s (median of every generation). With repacking off ONNX
Runtime maps the weights files, so sessions on one file share its pages.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "runtime"))

SETTINGS = {"repacked": True, "mapped": False}  # name -> prepack


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("artifact", type=Path, help="artifact folder")
    ap.add_argument("--repeats", type=int, default=2, help="processes per setting (default 2)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="tokens per generation (default 128)")
    ap.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads (default 2)")
    ap.add_argument("--json", type=Path, default=None, help="write the settings' figures here")
    ap.add_argument(
        "--child", choices=sorted(SETTINGS), default=None, help="run one setting in this process (what the runs call)"
    )
    return ap


def rss_mib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) // 1024
    return 0


def child(args) -> dict:
    from specexport_runtime.api import load

    gen = load(args.artifact, threads=args.threads, shared_pool=True, prepack=SETTINGS[args.child])
    loaded = rss_mib()
    ids = list(range(1000, 1100))
    rates = []
    for _ in range(3):
        out = gen.generate(ids, max_new_tokens=args.max_new_tokens, speculative=False)
        rates.append(out.stats.tokens_per_second)
    return {"rss_after_load_mib": loaded, "rss_after_decode_mib": rss_mib(), "tok_s": rates}


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.repeats < 1 or args.max_new_tokens < 1:
        parser().error("--repeats and --max-new-tokens must be >= 1")
    if args.child:
        print(json.dumps(child(args)))
        return 0
    runs: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for r in range(args.repeats):
        for name in SETTINGS if r % 2 == 0 else reversed(SETTINGS):
            cmd = [sys.executable, __file__, str(args.artifact), "--child", name, "--threads", str(args.threads)]
            cmd += ["--max-new-tokens", str(args.max_new_tokens)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            runs[name].append(json.loads(out.strip().splitlines()[-1]))
    table = {
        name: {
            "rss_after_load_mib": statistics.median(x["rss_after_load_mib"] for x in rs),
            "rss_after_decode_mib": statistics.median(x["rss_after_decode_mib"] for x in rs),
            "tok_s": statistics.median(t for x in rs for t in x["tok_s"]),
        }
        for name, rs in runs.items()
    }
    print(f"{'weights':<10}{'RSS load MiB':>14}{'RSS decode MiB':>16}{'tok/s':>8}")
    for name, row in table.items():
        print(f"{name:<10}{row['rss_after_load_mib']:>14.0f}{row['rss_after_decode_mib']:>16.0f}{row['tok_s']:>8.1f}")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "settings": table}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
