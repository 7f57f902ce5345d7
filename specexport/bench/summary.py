"""The BenchReport of a bench run's records: speculation off against each configuration's on runs
(speedups with bootstrap intervals, acceptance, theoretical speedup and efficiency, per domain and
per prompt, output equivalence or quality, memory, caveats). bench.py's docstring defines every
figure; the statistics themselves are in bench_stats.py.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specexport_runtime import registry
from specexport_runtime.config import GeneratorConfig

from . import harness
from .prompts import Prompt
from .report import BenchReport, ConfigResult, RunRecord, gamma_label
from .stats import (
    acceptance,
    equivalence,
    measured_costs,
    mode_stats,
    quality,
    quality_verdict,
    ratio_ci,
    theoretical_speedup,
    tps,
)

# target precisions whose kernels round by call size (a greedy bench on one of these gets
# QUANT_CAVEAT unless the build measured its rows bitwise, manifest target.exactness)
QUANTIZED_PRECISIONS = ("int8", "int4", "dynamic-int8", "gguf", "gptq", "awq")
QUANT_CAVEAT = (
    "target precision {precision!r} is quantized and its exactness is {exactness}: rows of a quantized "
    "target's calls can differ between call sizes (a verify call of S tokens against S calls of 1 token), "
    "so greedy outputs may diverge at near-ties without any bug in the speculative loop "
    "(docs/benchmarking.md, 'Output equivalence'); build it with `target.exactness: bitwise` in the "
    "recipe (every call padded to >= 2 rows, measured at build) for bit-identical rows"
)


def _graph_bytes(root: Path, manifest, entry) -> int:
    graph = Path(entry.graph)
    return sum(
        (root / rel).stat().st_size
        for rel in manifest.files
        if Path(rel).parent == graph.parent and Path(rel).name.startswith(graph.name)
    )


def memory_estimate(gen, proposer: str) -> dict:
    root, man = gen.root, gen.manifest
    target_bytes = _graph_bytes(root, man, man.target) + gen.target.kv_nbytes()
    draft_bytes = 0
    if registry.get(proposer).uses_draft and gen.draft is not None:
        draft_bytes = _graph_bytes(root, man, man.draft) + gen.draft.kv_nbytes()
    total = target_bytes + draft_bytes
    return {
        "method": "static: graph files + KV buffers at max_context",
        "target_bytes": target_bytes,
        "draft_bytes": draft_bytes,
        "total_bytes": total,
        "draft_share": draft_bytes / total if total else 0.0,
    }


def target_exactness(entry) -> dict:
    """The target's exactness class as the manifest records it (None: not measured) and the
    build's row-invariance measurement (validation.rows; None when absent)."""
    rows = entry.validation.get("rows") if isinstance(entry.validation, dict) else None
    return {
        "class": entry.exactness,
        "min_rows": entry.min_rows,
        "cache_pad": entry.cache_pad,
        "rows": dict(rows) if rows else None,
    }


@dataclass(frozen=True)
class _Basis:
    """What every configuration's figures are computed against: the off runs, the prompts, ..."""

    gen: Any
    prompts: Sequence[Prompt]
    off: list[RunRecord]
    proposer: str
    greedy: bool
    seed: int
    sequential: bool
    quality_off: dict | None


@dataclass(frozen=True)
class _Paired:
    """One configuration's on runs and the off runs, each by prompt id."""

    on: dict[str, list[RunRecord]]
    off: dict[str, list[RunRecord]]

    @classmethod
    def of(cls, on: list[RunRecord], off: list[RunRecord], prompts: Sequence[Prompt]) -> _Paired:
        return cls(*({p.id: [r for r in runs if r.prompt_id == p.id] for p in prompts} for runs in (on, off)))

    def runs(self, ids: Sequence[str]) -> tuple[list[RunRecord], list[RunRecord]]:
        return [r for i in ids for r in self.on[i]], [r for i in ids for r in self.off[i]]

    def speedup_ci(self, ids: Sequence[str], seed: int) -> tuple[float, float] | None:
        """ratio_ci over these prompts of their summed decode tokens and seconds, on over off."""
        sums = [
            [sum(getattr(r, key) for r in side[i]) for i in ids]
            for side in (self.on, self.off)
            for key in ("decode_tokens", "decode_seconds")
        ]
        return ratio_ci(*sums, seed=seed)


def _speedup(on: Sequence[RunRecord], off: Sequence[RunRecord]) -> float:
    off_tps = tps(off)
    return tps(on) / off_tps if off_tps > 0 else 0.0


def _drafted_per_round(acc, default: int) -> int:
    """Tokens actually drafted per round (the fixed gamma for a draft model; n-gram lookup and
    the adaptive controller draft a varying number)."""
    return max(1, round(acc.drafted / acc.rounds)) if acc.rounds else default


def _length_stats(values: list) -> dict:
    return {
        "mean": float(np.mean(values)) if values else 0.0,
        "min": min(values, default=0),
        "max": max(values, default=0),
    }


def _meta(gen, prompts: Sequence[Prompt], config: GeneratorConfig, gammas, settings: dict) -> dict:
    """The report's meta: the artifact, the proposer's settings, the run's settings, the machine."""
    man, suffix = gen.manifest, config.suffix
    run = harness.run_metadata()
    meta = {
        "artifact": str(gen.root),
        "name": man.name,
        "max_context": man.max_context,
        "target": {
            "source": man.target.source,
            "precision": man.target.precision,
            "bytes": _graph_bytes(gen.root, man, man.target),
            "architecture": man.target.architecture,
        },
        "draft": None
        if man.draft is None
        else {
            "source": man.draft.source,
            "precision": man.draft.precision,
            "bytes": _graph_bytes(gen.root, man, man.draft),
        },
        "proposer": config.proposer,
        "proposer_label": registry.get(config.proposer).label,
        "ngram_sizes": list(config.ngram_sizes),
        "gammas": list(gammas),
        "hybrid_retrieval": config.hybrid_retrieval,
        "sequential": settings["sequential"],
        "suffix": {
            "factor": suffix.factor,
            "max_spec": suffix.max_spec,
            "limit_scales": list(suffix.limit_scales),
            "tuner": gen.learned("suffix").tuner.describe(gen.verify_cost.line()),
        },
        "sampling": {key: settings[key] for key in ("temperature", "top_p", "top_k", "seed")},
        "prompts": len(prompts),
        "domains": dict(Counter(p.domain for p in prompts)),
        **{key: settings[key] for key in ("repeats", "max_new_tokens", "threads")},
        "machine": run["machine"],
        "date": run["date"],
    }
    try:
        import onnxruntime

        meta["onnxruntime"] = onnxruntime.__version__
    except ImportError:  # pragma: no cover
        pass
    return meta


def _caveats(target, greedy: bool, exactness: dict) -> list[str]:
    if greedy and exactness["class"] != "bitwise" and target.precision in QUANTIZED_PRECISIONS:
        return [QUANT_CAVEAT.format(precision=target.precision, exactness=exactness["class"] or "not measured")]
    return []


def _theoretical(acc, gamma: int | None, costs: dict) -> dict:
    """theoretical_speedup at the acceptance's alpha and tokens drafted per round, with the costs."""
    g = _drafted_per_round(acc, gamma or 1)
    theo = (
        theoretical_speedup(acc.alpha, g, costs)
        if acc.alpha is not None
        else {"gamma": g, "alpha": None, "expected_tokens": None, "c": None, "v": None, "speedup": None}
    )
    return {**theo, "gamma_source": "mean drafted per round", "costs": costs}


def _domain_entry(basis: _Basis, paired: _Paired, ids: list[str], costs: dict, seed: int) -> dict:
    """One domain's figures: the domain's own acceptance with the run's costs."""
    on, off = paired.runs(ids)
    acc = acceptance(on)
    speedup = _speedup(on, off)
    theo = None
    if acc.alpha is not None and acc.rounds:
        theo = theoretical_speedup(acc.alpha, _drafted_per_round(acc, 1), costs)["speedup"]
    entry = {
        "prompts": len(ids),
        "off_tps": tps(off),
        "on_tps": tps(on),
        "speedup": speedup,
        "theoretical": theo,
        "efficiency": speedup / theo if theo else None,
        "identical_share": equivalence(off, on)["share"] if basis.greedy else None,
        "speedup_ci95": paired.speedup_ci(ids, seed),
        "acceptance_rate": acc.acceptance_rate,
        "alpha": acc.alpha,
        "tokens_per_target_call": acc.tokens_per_target_call,
        "mean_accepted_per_round": acc.mean_accepted_per_round,
        "per_position": acc.per_position,
    }
    if basis.sequential:  # learning across requests: the first and the last third of the sequence
        third = max(1, len(ids) // 3)
        for name, part in (("first_third", ids[:third]), ("last_third", ids[-third:])):
            entry[f"{name}_speedup"] = _speedup(*paired.runs(part))
    return entry


def _prompt_entry(prompt: Prompt, paired: _Paired) -> dict:
    on, off = paired.runs([prompt.id])
    acc = acceptance(on)
    return {
        "domain": prompt.domain,
        "off_tps": tps(off),
        "on_tps": tps(on),
        "speedup": _speedup(on, off),
        "acceptance_rate": acc.acceptance_rate,
        "mean_accepted_per_round": acc.mean_accepted_per_round,
        "tokens_per_target_call": acc.tokens_per_target_call,
    }


def _config_result(basis: _Basis, k: int, gamma: int | None, on: list[RunRecord]) -> ConfigResult:
    """Speculation on with `gamma` (the k-th configuration) against the off runs."""
    label, prompts, seed = gamma_label(gamma), basis.prompts, basis.seed + k
    paired = _Paired.of(on, basis.off, prompts)
    acc, speedup = acceptance(on), _speedup(on, basis.off)
    costs = measured_costs(basis.off, on, basis.proposer)
    theo = _theoretical(acc, gamma, costs)
    total_on = sum(r.total_seconds for r in on)
    domains = dict.fromkeys(p.domain for p in prompts)
    res = ConfigResult(
        gamma=gamma,
        label=label,
        on=mode_stats(f"on[{label}]", on),
        acceptance=acc,
        speedup=speedup,
        speedup_ci95=paired.speedup_ci([p.id for p in prompts], seed),
        theoretical=theo,
        efficiency=speedup / theo["speedup"] if theo.get("speedup") else None,
        draft_time_share=sum(r.draft_seconds for r in on) / total_on if total_on > 0 else 0.0,
        by_domain={
            d: _domain_entry(basis, paired, [p.id for p in prompts if p.domain == d], costs, seed) for d in domains
        },
        by_prompt={p.id: _prompt_entry(p, paired) for p in prompts},
    )
    if basis.greedy:
        res.equivalence = equivalence(basis.off, on)
    else:
        res.quality = quality(basis.gen, on, seed + 1)
        res.quality.update(quality_verdict(res.quality, basis.quality_off, seed + 101))
    return res


def build_report(
    gen,
    runs: list[RunRecord],
    prompts: Sequence[Prompt],
    config: GeneratorConfig,
    *,
    gammas,
    seed: int,
    repeats: int,
    max_new_tokens,
    threads,
    temperature: float,
    top_p: float,
    top_k: int,
    sequential: bool = False,
) -> BenchReport:
    """The BenchReport of a run's records (bench.py's docstring): off against each gamma's on runs."""
    settings = {
        "seed": seed,
        "repeats": repeats,
        "max_new_tokens": max_new_tokens,
        "threads": threads,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "sequential": sequential,
    }
    meta = _meta(gen, prompts, config, gammas, settings)
    off = [r for r in runs if r.mode == "off"]
    on = {g: [r for r in runs if r.mode == "on" and r.gamma == g] for g in gammas}
    greedy = temperature == 0
    basis = _Basis(
        gen, prompts, off, config.proposer, greedy, seed, sequential, quality(gen, off, seed) if not greedy else None
    )
    configs = [_config_result(basis, k, g, on[g]) for k, g in enumerate(gammas)]
    lengths = {
        "input_tokens": _length_stats([r.prompt_tokens for r in off]),
        "output_tokens_off": _length_stats([r.new_tokens for r in off]),
        "output_tokens_on": {gamma_label(g): _length_stats([r.new_tokens for r in on[g]]) for g in gammas},
    }
    exactness = target_exactness(gen.manifest.target)
    return BenchReport(
        meta=meta,
        lengths=lengths,
        off=mode_stats("off", off),
        configs=configs,
        memory=memory_estimate(gen, config.proposer),
        costs=measured_costs(off, [r for r in runs if r.mode == "on"], config.proposer),
        quality_off=basis.quality_off,
        caveats=_caveats(gen.manifest.target, greedy, exactness),
        exactness=exactness,
        runs=runs,
    )
