"""Where a build's memory goes: the process's resident memory at each progress line, and its peak.

    python benchmarks/build_memory.py /tmp/rand-1b/fp32-int8.yaml -o /tmp/a1 [--no-validate]

Runs `specexport build` in this process with a thread sampling the resident set every 0.2 s, and
prints each progress line with the time, the RSS then and the peak so far (GB), so the peak can
be placed in a stage. The peak that /usr/bin/time -v reports around `specexport build` is the
figure to quote; this one may miss a spike shorter than the sampling interval.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "runtime"))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe", help="a recipe YAML path or a bundled recipe name")
    ap.add_argument("-o", "--output", type=Path, required=True, help="artifact folder (replaced if it exists)")
    ap.add_argument("--no-validate", action="store_true", help="skip validation, as specexport build --no-validate")
    ap.add_argument("--interval", type=float, default=0.2, help="seconds between RSS samples")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.interval <= 0:
        raise SystemExit(f"error: --interval {args.interval} must be > 0")
    import psutil

    from specexport.build.artifact import build_artifact
    from specexport.recipe.load import load_recipe, resolve_recipe

    proc, peak, start = psutil.Process(), [0], time.perf_counter()

    def sample() -> None:
        while True:
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(args.interval)

    threading.Thread(target=sample, daemon=True).start()

    def progress(message: str) -> None:
        rss = proc.memory_info().rss
        peak[0] = max(peak[0], rss)
        print(f"{time.perf_counter() - start:8.1f} s  rss {rss / 1e9:6.2f} GB  peak {peak[0] / 1e9:6.2f} GB  {message}")

    recipe = load_recipe(resolve_recipe(args.recipe))
    build_artifact(recipe, args.output, force=True, validate=not args.no_validate, progress=progress)
    progress("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
