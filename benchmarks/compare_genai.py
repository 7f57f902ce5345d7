"""Side by side on one CPU, interleaved prompt by prompt: ONNX Runtime GenAI versus specexport artifacts.

    python benchmarks/compare_genai.py ARTIFACT [ARTIFACT ...] --genai-model [LABEL=]DIR [--genai-model ...]
        [--genai-python PY] [--pair PRECISION=LABEL] [--prompts code] [--limit 3] [--max-new-tokens 128]
        [--repeats 3] [--threads 2] [--gamma G] [--json OUT]

GenAI is not a dependency of specexport: install it in its own venv (default
~/.cache/specexport/genai/venv; `pip install onnxruntime-genai` pulls its own onnxruntime) and
make its models (fp32, int8, int4, ...) with its builder from a Hugging Face folder of the same
target (benchmarks/README.md shows the commands). Each artifact runs target-only and with every
speculative proposer it supports. Every engine runs in a worker process of its own that stays up
for the whole run (GenAI's sessions and specexport's process-wide thread pool do not share a
process): one per GenAI model, one per artifact. The run follows specexport.bench.harness: each method
first generates once from a warm-up prompt outside the measured set; then prompt by prompt, each
repeat runs every method back to back in a rotated order, so machine drift spreads over all of
them; specexport's store of earlier answers is emptied before every generation (GenAI keeps
nothing between requests: a fresh generator each). Every method gets the same prompt token ids
(the first artifact's chat template), greedy, at most --max-new-tokens new tokens, up to EOS.

tok/s is end to end: new tokens / seconds of the generation inside its worker, from the call
with the prompt to the last token (prefill included, transport excluded); per prompt the median
over repeats, then the median over prompts. `first` (ms to the first new token: the prefill) and
`decode` (tok/s after it), likewise. Each artifact is compared with the GenAI model of its
target's bits (fp32 -> fp32, int8 -> int8, int4/gguf/gptq/awq -> int4; --pair overrides, the
first GenAI model when none matches): `x ref` is the median over prompts of the per-prompt speed
ratio (both measured in the same rounds) with its 95% bootstrap interval; `==ref` / `==off`
count prompts whose tokens equal that model's and the artifact's own target-only run's.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "runtime"))

from specexport.bench import harness  # noqa: E402  (after the path set-up: runs from a checkout)

DEFAULT_GENAI_PYTHON = Path.home() / ".cache" / "specexport" / "genai" / "venv" / "bin" / "python"
# GenAI label an artifact's target precision is compared with by default (same weight bits)
LABEL_FOR_PRECISION = {
    "fp32": "fp32",
    "fp16": "fp16",
    "int8": "int8",
    "dynamic-int8": "int8",
    "int4": "int4",
    "gguf": "int4",
    "gptq": "int4",
    "awq": "int4",
}

# GenAI's worker (specexport.bench.harness_workers protocol): MODEL_DIR as argv[1]; a request
# {"ids", "new"} -> {"tokens" (EOS included when generated), "seconds", "first_seconds"}
_GENAI_WORKER = r"""
import json, sys, time
import onnxruntime_genai as og
model = og.Model(sys.argv[1])
print("@@ready", flush=True)
for line in sys.stdin:
    req = json.loads(line)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(req["ids"]) + req["new"], do_sample=False)
    gen = og.Generator(model, params)
    start = time.perf_counter()
    gen.append_tokens(req["ids"])
    new, first = [], None
    while not gen.is_done():
        gen.generate_next_token()
        new.append(int(gen.get_next_tokens()[0]))
        first = first or time.perf_counter() - start  # prefill + the first token
    seconds = time.perf_counter() - start
    del gen
    print("@@" + json.dumps({"tokens": new, "seconds": seconds, "first_seconds": first}), flush=True)
"""


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
            raise harness.HarnessError(f"--genai-model {spec!r}: {why}")
        if not (path / "genai_config.json").is_file():
            raise harness.HarnessError(
                f"--genai-model {spec!r}: {path} has no genai_config.json (a GenAI builder output?)"
            )
        models[label] = path
    return models


def parse_pairs(specs: list[str], labels: list[str]) -> dict[str, str]:
    pairs = dict(LABEL_FOR_PRECISION)
    for spec in specs:
        precision, sep, label = (s.strip() for s in spec.partition("="))
        if not sep or not precision or label not in labels:
            raise harness.HarnessError(f"--pair {spec!r}: want PRECISION=LABEL with LABEL one of {', '.join(labels)}")
        pairs[precision] = label
    return pairs


def metrics(eos: list[int]) -> dict:
    """The table's figures of one sample: end-to-end tok/s, first-token ms and decode tok/s."""

    def n(s):
        return len(harness.until_eos(s.result["tokens"], eos))

    return {
        "tok_s": lambda s: n(s) / s.result["seconds"],
        "first_ms": lambda s: s.result["first_seconds"] * 1000,
        "decode_tok_s": lambda s: (n(s) - 1) / max(s.result["seconds"] - s.result["first_seconds"], 1e-9),
    }


def summarize(run: harness.Run, pairs: dict[str, str], labels: list[str], eos: list[int]) -> list[dict]:
    """One row per method: medians over prompts of per-prompt medians over repeats, the paired
    ratio to the reference GenAI model and token-for-token equality with it and with target-only."""
    fig = metrics(eos)
    rows = []
    for m in run.methods:
        info = m.info
        if info["engine"] == "genai":
            ref = info["label"]
        else:
            ref = pairs.get(info["precision"]) if pairs.get(info["precision"]) in labels else labels[0]
        ratio = run.ratio(m.name, f"genai {ref}", fig["tok_s"])
        same_ref = run.same_tokens(m.name, f"genai {ref}", eos) if info["engine"] != "genai" else None
        same_off = run.same_tokens(m.name, info["off"], eos) if info.get("mode") not in (None, "off") else None
        rows.append(
            {
                "method": m.name,
                **{k: v for k, v in info.items() if k != "off"},
                "ref": ref,
                **{k: run.median(m.name, f) for k, f in fig.items()},
                "vs_ref": ratio["median"],
                "vs_ref_ci95": ratio["ci95"],
                "identical_to_ref": None if same_ref is None else "{}/{}".format(*same_ref),
                "identical_to_off": None if same_off is None else "{}/{}".format(*same_off),
            }
        )
    return rows


def format_table(rows: list[dict]) -> str:
    width = max(len(r["method"]) for r in rows) + 2
    lines = [
        f"{'method':<{width}}{'target':>8}{'ref':>7}{'tok/s':>8}{'x ref':>7}  {'[95% CI]':<13}{'first':>9}"
        f"{'decode':>8}{'==ref':>7}{'==off':>7}  exactness"
    ]
    for r in rows:
        ci = harness.ci_cell(r["vs_ref_ci95"])
        lines.append(
            f"{r['method']:<{width}}{r.get('precision') or '-':>8}{r['ref']:>7}{r['tok_s']:>8.1f}"
            f"{r['vs_ref']:>6.2f}x  {ci:<13}{r['first_ms']:>7.1f}ms{r['decode_tok_s']:>8.1f}"
            f"{r['identical_to_ref'] or '-':>7}{r['identical_to_off'] or '-':>7}  {r.get('exactness') or '-'}"
        )
    return "\n".join(lines)


def parser():
    ap = harness.script_parser(__doc__)
    ap.add_argument(
        "artifacts",
        nargs="+",
        type=Path,
        metavar="ARTIFACT",
        help="artifact folder(s) (specexport build); each runs target-only and with every proposer it supports",
    )
    ap.add_argument(
        "--genai-model",
        action="append",
        required=True,
        metavar="[LABEL=]DIR",
        help="a GenAI model folder (its builder's output, genai_config.json inside), repeatable; "
        "LABEL names it (e.g. fp32, int8, int4: the labels artifacts are paired with); "
        "a bare DIR is 'genai'",
    )
    ap.add_argument(
        "--genai-python",
        default=str(DEFAULT_GENAI_PYTHON),
        help=f"a Python that imports onnxruntime_genai (default {DEFAULT_GENAI_PYTHON})",
    )
    ap.add_argument(
        "--pair",
        action="append",
        default=[],
        metavar="PRECISION=LABEL",
        help="compare artifacts whose manifest target.precision is PRECISION with GenAI model LABEL "
        "(default: fp32->fp32, int8/dynamic-int8->int8, int4/gguf/gptq/awq->int4, "
        "else the first model)",
    )
    ap.add_argument("--gamma", type=int, default=0, help="fixed draft length for specexport (default 0: adaptive)")
    harness.add_run_options(ap, prompts="code", limit=3, max_new_tokens=128, repeats=3, threads=2)
    return ap


def main(argv=None) -> int:
    args = harness.parse_args(parser(), argv)
    if not Path(args.genai_python).is_file():
        raise harness.HarnessError(f"--genai-python {args.genai_python} does not exist (see benchmarks/README.md)")
    models = parse_genai_models(args.genai_model)
    pairs = parse_pairs(args.pair, list(models))
    prompts = harness.load_prompt_set(args.prompts, limit=args.limit)
    from specexport.bench.harness_workers import SpecexportWorker, WorkerProcess, artifact_methods

    spec, cases, warm, eos = artifact_methods(args.artifacts, prompts)
    meta = harness.run_metadata(None if argv is None else [__file__, *argv], **vars(args))

    workers: list = []
    with tempfile.TemporaryDirectory(prefix="compare-genai-") as tmp:
        try:
            methods = []
            for label, folder in models.items():
                view = _genai_with_threads(folder, Path(tmp) / label, args.threads)
                workers.append(
                    WorkerProcess(
                        f"genai {label}",
                        [args.genai_python, "-c", _GENAI_WORKER, str(view)],
                        Path(tmp) / f"genai-{label}.log",
                    )
                )

                def generate(case, w=workers[-1]):
                    return w.request({"ids": list(case.ids), "new": args.max_new_tokens})

                methods.append(
                    harness.Method(
                        f"genai {label}",
                        generate,
                        info={"engine": "genai", "label": label, "precision": label, "model": str(folder), "off": None},
                    )
                )
            by_artifact: dict = {}
            for m in spec:
                if m["artifact"] not in by_artifact:
                    by_artifact[m["artifact"]] = SpecexportWorker(
                        m["artifact"], args.threads, Path(tmp) / f"spec-{len(workers)}.log"
                    )
                    workers.append(by_artifact[m["artifact"]])
                methods.append(
                    by_artifact[m["artifact"]].method(
                        m["name"],
                        m["mode"],
                        args.max_new_tokens,
                        args.gamma or None,
                        artifact=str(m["artifact"]),
                        precision=m["precision"],
                        exactness=m["exactness"],
                        off=m["off"],
                    )
                )
            tok_s = metrics(eos)["tok_s"]

            def progress(s):
                print(f"  {s.case:<20} repeat {s.repeat + 1}  {s.method:<36} {tok_s(s):6.1f} tok/s", file=sys.stderr)

            run = harness.run_interleaved(methods, cases, warm, args.repeats, harness.SETTLE_SECONDS, progress)
        finally:
            for w in reversed(workers):
                w.close()
    rows = summarize(run, pairs, list(models), eos)
    print(
        harness.preamble(
            meta,
            run,
            f"{len(cases)} prompts ({args.prompts}), {args.max_new_tokens} new tokens, "
            f"greedy, {args.threads} threads, {args.repeats} repeats, interleaved prompt by prompt; "
            "end-to-end tok/s (prefill included), median over prompts",
        )
    )
    print(format_table(rows))
    if args.json:
        harness.write_json(args.json, {"meta": meta, "pairs": pairs, "eos": eos, "rows": rows, "run": run.to_dict()})
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
    raise SystemExit(harness.cli(main))
