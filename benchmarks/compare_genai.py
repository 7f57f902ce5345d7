"""Side by side on one CPU: ONNX Runtime GenAI (the issue's peer) versus a specexport artifact.

    python benchmarks/compare_genai.py ARTIFACT --genai-model DIR --genai-python PY
        [--prompts code] [--limit 3] [--max-new-tokens 128] [--repeats 3] [--threads 2] [--json OUT]

GenAI is not a dependency of specexport: install it in its own venv (`pip install
onnxruntime-genai` pulls its own onnxruntime) and make its model with its builder from a
Hugging Face folder of the same target (benchmarks/README.md shows the commands). Each
measurement runs in a fresh subprocess (GenAI's sessions and specexport's process-wide thread
pool do not share a process), in a rotating order per repeat so machine drift spreads over every
method. Every method gets the same prompt token ids (the artifact's chat template), greedy, at
most --max-new-tokens new tokens, stopping at the artifact's EOS ids.

tok/s is end to end: new tokens / wall seconds from the first call with the prompt to the last
token, prefill included, for every method. Outputs are compared token for token with GenAI's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_GENAI_WORKER = r"""
import json, sys, time
import onnxruntime_genai as og
args = json.loads(sys.argv[1])
model = og.Model(args["model"])
out = []
for ids in [args["prompts"][0]] + args["prompts"]:  # the first is a warm-up
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + args["new"], do_sample=False)
    gen = og.Generator(model, params)
    start = time.perf_counter()
    gen.append_tokens(ids)
    new = []
    while not gen.is_done():
        gen.generate_next_token()
        new.append(int(gen.get_next_tokens()[0]))
    seconds = time.perf_counter() - start
    cut = [i for i, t in enumerate(new) if t in args["eos"]]
    out.append({"seconds": seconds, "tokens": new[: cut[0]] if cut else new})
print(json.dumps(out[1:]))
"""

_SPEC_WORKER = r"""
import json, sys, time
from specexport_runtime.api import load
args = json.loads(sys.argv[1])
gen = load(args["artifact"], threads=args["threads"], shared_pool=True)
kw = dict(max_new_tokens=args["new"])
if args["mode"] == "off":
    kw["speculative"] = False
else:
    kw["proposer"] = args["mode"]
    if args["gamma"]:
        kw["gamma"] = args["gamma"]
out = []
for ids in [args["prompts"][0]] + args["prompts"]:
    start = time.perf_counter()
    res = gen.generate(list(ids), **kw)
    out.append({"seconds": time.perf_counter() - start, "tokens": list(res.token_ids)})
print(json.dumps(out[1:]))
"""


def _run(python: str, code: str, payload: dict) -> list[dict]:
    proc = subprocess.run([python, "-c", code, json.dumps(payload)], capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"worker failed ({python}):\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", help="artifact folder (specexport build)")
    ap.add_argument("--genai-model", required=True, help="GenAI model folder (its builder's output, genai_config.json inside)")
    ap.add_argument("--genai-python", required=True, help="a Python that imports onnxruntime_genai")
    ap.add_argument("--prompts", default="code", help="comma-separated domains or JSONL files (default code)")
    ap.add_argument("--limit", type=int, default=3, help="prompts per domain (default 3)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt (default 128)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds over all methods (default 3); medians are reported")
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads for both (default 2)")
    ap.add_argument("--gamma", type=int, default=0, help="fixed draft length for specexport (default: adaptive)")
    ap.add_argument("--json", default=None, help="write the rows as JSON to this file")
    args = ap.parse_args(argv)

    sys.path.insert(0, str(REPO))
    from specexport.bench import prompt_ids, resolve_prompts
    from specexport_runtime.api import load

    gen = load(args.artifact, threads=1)  # tokenizer, chat template and manifest only; not timed
    prompts = resolve_prompts([s for s in args.prompts.split(",") if s], limit=args.limit)
    ids = [prompt_ids(gen, p) for p in prompts]
    eos = sorted(gen.manifest.tokenizer.eos_token_ids)
    genai_dir = tempfile.TemporaryDirectory(prefix="genai-model-")
    genai_model = _genai_with_threads(Path(args.genai_model), Path(genai_dir.name), args.threads)

    methods = {
        "genai fp32 (target only)": (args.genai_python, _GENAI_WORKER, {"model": str(genai_model)}),
        "specexport off": (sys.executable, _SPEC_WORKER, {"mode": "off"}),
        "specexport draft": (sys.executable, _SPEC_WORKER, {"mode": "draft"}),
        "specexport hybrid": (sys.executable, _SPEC_WORKER, {"mode": "hybrid"}),
    }
    if gen.manifest.draft is None:
        methods.pop("specexport draft")
        methods.pop("specexport hybrid")
        methods["specexport ngram"] = (sys.executable, _SPEC_WORKER, {"mode": "ngram"})
    tps: dict[str, list[float]] = {m: [] for m in methods}
    tokens: dict[str, list[list[int]]] = {}
    names = list(methods)
    for rep in range(args.repeats):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            python, code, extra = methods[name]
            payload = {"prompts": ids, "new": args.max_new_tokens, "artifact": args.artifact,
                       "threads": args.threads, "gamma": args.gamma, "eos": eos, **extra}
            runs = _run(python, code, payload)
            tps[name].append(sum(len(r["tokens"]) for r in runs) / sum(r["seconds"] for r in runs))
            tokens[name] = [r["tokens"] for r in runs]
            print(f"  repeat {rep + 1}: {name:<28} {tps[name][-1]:6.1f} tok/s", file=sys.stderr)
    base = statistics.median(tps["genai fp32 (target only)"])
    ref = tokens["genai fp32 (target only)"]
    rows = []
    for name in names:
        med = statistics.median(tps[name])
        same = sum(a == b for a, b in zip(tokens[name], ref))
        rows.append({"method": name, "tok_s_median": med, "tok_s_runs": tps[name], "vs_genai": med / base,
                     "identical_to_genai": f"{same}/{len(ref)}"})
    print(f"{len(ids)} prompts ({args.prompts}), {args.max_new_tokens} new tokens, greedy, {args.threads} threads,"
          f" median of {args.repeats} rounds, end-to-end tok/s (prefill included)")
    print(f"{'method':<28}{'tok/s':>8}{'vs genai':>10}  identical")
    for r in rows:
        print(f"{r['method']:<28}{r['tok_s_median']:>8.1f}{r['vs_genai']:>9.2f}x  {r['identical_to_genai']}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2), encoding="utf-8")
    return 0


def _genai_with_threads(folder: Path, work: Path, threads: int) -> Path:
    """A view of the GenAI model folder (links to its files) whose genai_config.json sets
    intra_op_num_threads: GenAI's default session options left one of two cores idle here
    (19.8 vs 35.9 tok/s). The user's folder is not modified."""
    for item in folder.iterdir():
        if item.name != "genai_config.json":
            (work / item.name).symlink_to(item.resolve())
    config = json.loads((folder / "genai_config.json").read_text(encoding="utf-8"))
    config["model"]["decoder"].setdefault("session_options", {})["intra_op_num_threads"] = threads
    (work / "genai_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return work


if __name__ == "__main__":
    raise SystemExit(main())
