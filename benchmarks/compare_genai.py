"""Side by side on one CPU: ONNX Runtime GenAI (the issue's peer) versus specexport artifacts.

    python benchmarks/compare_genai.py ARTIFACT [ARTIFACT ...] --genai-model [LABEL=]DIR [--genai-model ...]
        [--genai-python PY] [--pair PRECISION=LABEL] [--prompts code] [--limit 3] [--max-new-tokens 128]
        [--repeats 3] [--threads 2] [--gamma G] [--json OUT]

GenAI is not a dependency of specexport: install it in its own venv (default
~/.cache/specexport/genai/venv; `pip install onnxruntime-genai` pulls its own onnxruntime) and
make its models (fp32, int8, int4, ...) with its builder from a Hugging Face folder of the same
target (benchmarks/README.md shows the commands). Each artifact runs target-only and with every
speculative proposer it supports. Each measurement runs in a fresh subprocess (GenAI's sessions
and specexport's process-wide thread pool do not share a process), in a rotating order per repeat
so machine drift spreads over every method. Every method gets the same prompt token ids (the
first artifact's chat template), greedy, at most --max-new-tokens new tokens, stopping at EOS.

tok/s is end to end: new tokens / wall seconds from the first call with the prompt to the last
token, prefill included; per prompt the median over repeats, then the median over prompts. Also:
`first` (ms to the first new token: the prefill) and `decode` (tok/s after it), likewise. Each
artifact is compared with the GenAI model of its target's bits (fp32 -> fp32, int8 -> int8,
int4/gguf/gptq/awq -> int4; --pair overrides, the first GenAI model when none matches): speed
ratio, and prompts whose tokens equal that model's and the artifact's own target-only run's.
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
DEFAULT_GENAI_PYTHON = Path.home() / ".cache" / "specexport" / "genai" / "venv" / "bin" / "python"
# GenAI label an artifact's target precision is compared with by default (same weight bits)
LABEL_FOR_PRECISION = {"fp32": "fp32", "fp16": "fp16", "int8": "int8", "dynamic-int8": "int8",
                       "int4": "int4", "gguf": "int4", "gptq": "int4", "awq": "int4"}

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
    new, first = [], None
    while not gen.is_done():
        gen.generate_next_token()
        new.append(int(gen.get_next_tokens()[0]))
        first = first or time.perf_counter() - start  # prefill + the first token
    seconds = time.perf_counter() - start
    cut = [i for i, t in enumerate(new) if t in args["eos"]]
    out.append({"seconds": seconds, "first_seconds": first, "tokens": new[: cut[0]] if cut else new})
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
    toks = list(res.token_ids)
    cut = [i for i, t in enumerate(toks) if t in args["eos"]]
    out.append({"seconds": time.perf_counter() - start, "first_seconds": res.stats.prefill_seconds,
                "tokens": toks[: cut[0]] if cut else toks})
print(json.dumps(out[1:]))
"""


def _run(name: str, python: str, code: str, payload: dict) -> list[dict]:
    proc = subprocess.run([python, "-c", code, json.dumps(payload)], check=False,
                          capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        last = ([ln for ln in proc.stderr.strip().splitlines() if ln.strip()] or ["(no stderr)"])[-1]
        raise SystemExit(f"error: {name} failed (exit {proc.returncode}, {python}): {last.strip()}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def parse_genai_models(specs: list[str]) -> dict[str, Path]:
    """--genai-model values, 'LABEL=DIR' or a bare DIR (label 'genai'), checked; in given order."""
    models: dict[str, Path] = {}
    for spec in specs:
        label, sep, folder = spec.partition("=")
        if not sep or (Path(spec).expanduser() / "genai_config.json").is_file():
            label, folder = "genai", spec
        label, path = label.strip(), Path(folder).expanduser()
        if not label or label in models:
            why = "empty label" if not label else f"label {label!r} used twice (name each: LABEL=DIR)"
            raise SystemExit(f"error: --genai-model {spec!r}: {why}")
        if not (path / "genai_config.json").is_file():
            raise SystemExit(f"error: --genai-model {spec!r}: {path} has no genai_config.json (a GenAI builder output?)")
        models[label] = path
    return models


def parse_pairs(specs: list[str], labels: list[str]) -> dict[str, str]:
    pairs = dict(LABEL_FOR_PRECISION)
    for spec in specs:
        precision, sep, label = (s.strip() for s in spec.partition("="))
        if not sep or not precision or label not in labels:
            raise SystemExit(f"error: --pair {spec!r}: want PRECISION=LABEL with LABEL one of {', '.join(labels)}")
        pairs[precision] = label
    return pairs


def open_artifacts(paths: list[Path], prompts) -> tuple[list[dict], list[list[int]], list[int]]:
    """specexport methods of every artifact (target only, then each proposer it supports), the
    prompt token ids (the same for all artifacts) and the EOS ids."""
    from types import SimpleNamespace

    from specexport_runtime.api import open_artifact
    from specexport_runtime.errors import SpecExportError

    from specexport.bench import prompt_ids

    methods, ids, eos = [], None, set()
    names = [p.name for p in paths]
    for path in paths:
        if not (path / "manifest.json").is_file():
            raise SystemExit(f"error: {path} is not an artifact folder (no manifest.json)")
        try:
            manifest, codec, _ = open_artifact(path, verify=False)
        except (OSError, ValueError, SpecExportError) as exc:
            raise SystemExit(f"error: {path}: {exc}")
        these = [prompt_ids(SimpleNamespace(codec=codec), p) for p in prompts]
        if ids is not None and these != ids:
            raise SystemExit(f"error: {path} tokenizes the prompts differently from {paths[0]}; use one tokenizer")
        ids, eos = these, eos | set(manifest.tokenizer.eos_token_ids)
        short = path.name if names.count(path.name) == 1 else str(path)
        modes = ["off", *manifest.speculative_proposers()]
        target = manifest.target
        methods += [{"name": f"specexport {short} {mode}", "engine": "specexport", "artifact": str(path), "mode": mode,
                     "off": f"specexport {short} off", "precision": target.precision,
                     "exactness": getattr(target, "exactness", None)} for mode in modes]
    return methods, ids, sorted(eos)


def summarize(methods: list[dict], runs: dict[str, list[list[dict]]], pairs: dict[str, str],
              labels: list[str]) -> list[dict]:
    """One row per method: median over prompts of the per-prompt median tok/s over repeats, its
    ratio to the reference GenAI model and token-for-token equality with it and with target-only."""
    def tok_s(name: str) -> float:
        per_prompt = zip(*[[len(r["tokens"]) / r["seconds"] for r in rep] for rep in runs[name]])
        return statistics.median(statistics.median(p) for p in per_prompt)

    def split(name: str) -> tuple[float, float]:
        """(first-token ms, decode tok/s after it): medians over prompts of medians over repeats."""
        first = zip(*[[r["first_seconds"] * 1000 for r in rep] for rep in runs[name]])
        decode = zip(*[[(len(r["tokens"]) - 1) / max(r["seconds"] - r["first_seconds"], 1e-9) for r in rep]
                       for rep in runs[name]])
        return (statistics.median(statistics.median(p) for p in first),
                statistics.median(statistics.median(p) for p in decode))

    def tokens(name: str) -> list[list[int]]:
        return [r["tokens"] for r in runs[name][-1]]

    def same(a: str, b: str) -> str:
        return f"{sum(x == y for x, y in zip(tokens(a), tokens(b)))}/{len(tokens(b))}"

    rows = []
    for m in methods:
        if m["engine"] == "genai":
            ref = m["label"]
        else:
            ref = pairs.get(m["precision"]) if pairs.get(m["precision"]) in labels else labels[0]
        ref_name = f"genai {ref}"
        med = tok_s(m["name"])
        first_ms, decode = split(m["name"])
        rows.append({"method": m["name"], "engine": m["engine"], "precision": m.get("precision"),
                     "first_token_ms": first_ms, "decode_tok_s": decode,
                     "exactness": m.get("exactness"), "artifact": m.get("artifact"), "mode": m.get("mode"),
                     "genai_model": m.get("model"), "ref": ref, "tok_s_median": med,
                     "tok_s_runs": [[len(r["tokens"]) / r["seconds"] for r in rep] for rep in runs[m["name"]]],
                     "vs_ref": med / tok_s(ref_name),
                     "identical_to_ref": None if m["engine"] == "genai" else same(m["name"], ref_name),
                     "identical_to_off": same(m["name"], m["off"]) if m.get("mode") not in (None, "off") else None,
                     "tokens": tokens(m["name"])})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("artifacts", nargs="+", type=Path, metavar="ARTIFACT",
                    help="artifact folder(s) (specexport build); each runs target-only and with every proposer it supports")
    ap.add_argument("--genai-model", action="append", required=True, metavar="[LABEL=]DIR",
                    help="a GenAI model folder (its builder's output, genai_config.json inside), repeatable; "
                         "LABEL names it (e.g. fp32, int8, int4: the labels artifacts are paired with); a bare DIR is 'genai'")
    ap.add_argument("--genai-python", default=str(DEFAULT_GENAI_PYTHON),
                    help=f"a Python that imports onnxruntime_genai (default {DEFAULT_GENAI_PYTHON})")
    ap.add_argument("--pair", action="append", default=[], metavar="PRECISION=LABEL",
                    help="compare artifacts whose manifest target.precision is PRECISION with GenAI model LABEL "
                         "(default: fp32->fp32, int8/dynamic-int8->int8, int4/gguf/gptq/awq->int4, else the first model)")
    ap.add_argument("--prompts", default="code", help="comma-separated domains or JSONL files (default code)")
    ap.add_argument("--limit", type=int, default=3, help="prompts per domain (default 3)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt (default 128)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds over all methods (default 3), each in a rotated order")
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads for every method (default 2)")
    ap.add_argument("--gamma", type=int, default=0, help="fixed draft length for specexport (default: adaptive)")
    ap.add_argument("--json", default=None, help="write settings and rows (tokens, exactness included) as JSON here")
    args = ap.parse_args(argv)
    if not Path(args.genai_python).is_file():
        raise SystemExit(f"error: --genai-python {args.genai_python} does not exist (see benchmarks/README.md)")
    if min(args.limit, args.max_new_tokens, args.repeats, args.threads) < 1:
        raise SystemExit("error: --limit, --max-new-tokens, --repeats and --threads must be at least 1")
    models = parse_genai_models(args.genai_model)
    pairs = parse_pairs(args.pair, list(models))

    sys.path.insert(0, str(REPO))
    from specexport.bench import resolve_prompts

    try:
        prompts = resolve_prompts([s for s in args.prompts.split(",") if s], limit=args.limit)
    except (OSError, ValueError, KeyError) as exc:
        raise SystemExit(f"error: --prompts {args.prompts!r}: {exc}")
    spec_methods, ids, eos = open_artifacts(args.artifacts, prompts)
    tmp = tempfile.TemporaryDirectory(prefix="genai-models-")
    methods = [{"name": f"genai {label}", "engine": "genai", "label": label, "model": str(folder),
                "python": args.genai_python, "code": _GENAI_WORKER,
                "extra": {"model": str(_genai_with_threads(folder, Path(tmp.name) / label, args.threads))}}
               for label, folder in models.items()]
    methods += [{**m, "python": sys.executable, "code": _SPEC_WORKER,
                 "extra": {"artifact": m["artifact"], "mode": m["mode"]}} for m in spec_methods]
    runs: dict[str, list[list[dict]]] = {m["name"]: [] for m in methods}
    for rep in range(args.repeats):
        for m in methods[rep % len(methods):] + methods[: rep % len(methods)]:
            payload = {"prompts": ids, "new": args.max_new_tokens, "threads": args.threads,
                       "gamma": args.gamma, "eos": eos, **m["extra"]}
            runs[m["name"]].append(_run(m["name"], m["python"], m["code"], payload))
            done = runs[m["name"]][-1]
            rate = sum(len(r["tokens"]) for r in done) / sum(r["seconds"] for r in done)
            print(f"  repeat {rep + 1}: {m['name']:<36} {rate:6.1f} tok/s (all prompts)", file=sys.stderr)
    tmp.cleanup()
    rows = summarize(methods, runs, pairs, list(models))
    width = max(len(r["method"]) for r in rows) + 2
    print(f"{len(ids)} prompts ({args.prompts}), {args.max_new_tokens} new tokens, greedy, {args.threads} threads,"
          f" {args.repeats} repeats; end-to-end tok/s (prefill included), median over prompts")
    print(f"{'method':<{width}}{'target':>8}{'ref':>8}{'tok/s':>8}{'x ref':>8}{'first':>9}{'decode':>8}"
          f"{'==ref':>7}{'==off':>7}  exactness")
    for r in rows:
        print(f"{r['method']:<{width}}{r['precision'] or '-':>8}{r['ref']:>8}{r['tok_s_median']:>8.1f}"
              f"{r['vs_ref']:>7.2f}x{r['first_token_ms']:>7.1f}ms{r['decode_tok_s']:>8.1f}"
              f"{r['identical_to_ref'] or '-':>7}{r['identical_to_off'] or '-':>7}  {r['exactness'] or '-'}")
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k != "artifacts"}
        settings |= {"artifacts": [str(a) for a in args.artifacts], "genai_models": {k: str(v) for k, v in models.items()},
                     "pairs": pairs, "prompt_ids": [p.id for p in prompts], "eos": eos}
        Path(args.json).write_text(json.dumps({"settings": settings, "rows": rows}, indent=2), encoding="utf-8")
    return 0


def _genai_with_threads(folder: Path, work: Path, threads: int) -> Path:
    """A view of the GenAI model folder (links to its files) whose genai_config.json sets
    intra_op_num_threads: GenAI's default session options left one of two cores idle here
    (19.8 vs 35.9 tok/s). The user's folder is not modified."""
    work.mkdir(parents=True)
    for item in folder.iterdir():
        if item.name != "genai_config.json":
            (work / item.name).symlink_to(item.resolve())
    config = json.loads((folder / "genai_config.json").read_text(encoding="utf-8"))
    config["model"]["decoder"].setdefault("session_options", {})["intra_op_num_threads"] = threads
    (work / "genai_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return work


if __name__ == "__main__":
    raise SystemExit(main())
