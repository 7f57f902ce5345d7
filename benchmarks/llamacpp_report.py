"""The report of compare_llamacpp.py: one table row per method (medians, ratios to llama.cpp's
target-only and best mode of the reference type, acceptance, on==off, valid answers) and the table
text. Not a script; nothing here measures.
"""

from __future__ import annotations

from specexport.bench import harness

GGUF_FOR_PRECISION = {
    "fp32": "F32",
    "fp16": "F16",
    "int8": "Q8_0",
    "dynamic-int8": "Q8_0",
    "int4": "Q4_1",
    "gguf": "Q4_1",
    "gptq": "Q4_1",
    "awq": "Q4_1",
}  # gguf: the builtin file's own type

# what a method keeps across requests and cannot clear (harness.Method.memory)
LLAMA_NGRAM_MEMORY = (
    "n-gram statistics of earlier requests (ngram-mod's pool): kept, llama-server has no request that clears them"
)
SPEC_SERVER_MEMORY = (
    "suffix store of earlier answers and learned costs: kept, `specexport serve` has no request that clears them"
)


def reference_type(precision: str, types: list[str]) -> str:
    """The llama.cpp type a specexport target is compared with: its own precision's type when it
    ran, else the first of --llama-types."""
    return GGUF_FOR_PRECISION.get(precision) if GGUF_FOR_PRECISION.get(precision) in types else types[0]


def e2e_tok_s(sample: harness.Sample) -> float:
    """New tokens / the request's wall seconds from the client's side (llama-bench: its own figure)."""
    if "wall_tok_s" in sample.result:
        return sample.result["wall_tok_s"]
    return sample.result["new_tokens"] / sample.seconds if sample.seconds > 0 else 0.0


def summarise(run: harness.Run, eos: set[int], types: list[str], valid=None) -> list[dict]:
    """One table row per method of the run; a method's info holds engine, group, mode, type,
    precision and exactness; its samples' results tokens, tok_s, new_tokens, drafted, accepted, calls.
    valid(case id, tokens up to the first EOS) -> bool, when given, fills 'valid' ('k/n' answers
    that meet their constraint; llama-bench rows, which decode no prompt, get None)."""
    info = {m.name: m.info for m in run.methods}
    med = {name: run.median(name, "tok_s") for name in info}
    off = {i["group"]: name for name, i in info.items() if i["mode"] == "off"}
    rows = []
    for name, m in info.items():
        rs = [s.result for s in run.samples_of(name)]
        ref = m["type"] if m["engine"] != "specexport" else reference_type(m["precision"], types)
        ref_off = off.get(("llama", ref))
        best = max((x for x, i in info.items() if i["group"] == ("llama", ref)), key=lambda x: med[x], default=None)
        drafted, accepted = sum(r["drafted"] for r in rs), sum(r["accepted"] for r in rs)
        calls = [r["calls"] for r in rs if r["calls"] is not None]
        row = {
            "method": name,
            "engine": m["engine"],
            "mode": m["mode"],
            "target": m["type"],
            "ref": ref,
            "precision": m.get("precision"),
            "exactness": m.get("exactness"),
            "tok_s_median": med[name],
            "wall_tok_s_median": run.median(name, e2e_tok_s),
            "vs_llama_off": run.ratio(name, ref_off, "tok_s")["median"] if ref_off else None,
            "vs_llama_best": run.ratio(name, best, "tok_s")["median"] if best else None,
            "acceptance": accepted / drafted if drafted else None,
            "mean_accepted_length": (accepted + sum(calls)) / sum(calls) if calls and sum(calls) else None,
            "new_tokens_mean": sum(r["new_tokens"] for r in rs) / len(rs),
            "on_eq_off": None,
        }
        if m["mode"] != "off" and m["group"] in off:
            row["on_eq_off"] = "{}/{}".format(*run.same_tokens(name, off[m["group"]], eos))
        row["valid"] = None
        if valid is not None and m["engine"] != "llama-bench":
            samples = run.samples_of(name)
            ok = sum(valid(s.case, harness.until_eos(s.result["tokens"], eos)) for s in samples)
            row["valid"] = f"{ok}/{len(samples)}"
        rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    def num(v, fmt=".2f"):
        return "-" if v is None else format(v, fmt)

    valid = any(r.get("valid") for r in rows)  # a constrained run: one more column
    head = (
        f"{'method':<34}{'target':>8}{'tok/s':>8}{'e2e':>7}{'ref':>6}{'x off':>8}{'x best':>8}{'accept':>8}"
        f"{'acc.len':>8}{'on==off':>9}" + (f"{'valid':>8}" if valid else "") + "  exactness"
    )
    return "\n".join(
        [head]
        + [
            f"{r['method']:<34}{r['target']:>8}{r['tok_s_median']:>8.1f}{r['wall_tok_s_median']:>7.1f}{r['ref']:>6}"
            f"{num(r['vs_llama_off']):>7}x"
            f"{num(r['vs_llama_best']):>7}x{num(r['acceptance']):>8}{num(r['mean_accepted_length']):>8}"
            f"{r['on_eq_off'] or '-':>9}"
            + (f"{r.get('valid') or '-':>8}" if valid else "")
            + f"  {r['exactness'] or '-'}"
            for r in rows
        ]
    )
