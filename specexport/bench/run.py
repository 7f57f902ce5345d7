"""`specexport bench`: speculation off versus on, over prompt sets, with honest statistics.

run_bench() loads an artifact once and measures on the harness (specexport.bench.harness): every
configuration warms up on a prompt outside the measured set, then for every prompt and repeat
runs the target alone (speculation off) and with speculation on (each requested gamma; None =
adaptive) with the suffix store of earlier answers emptied first, the order rotated by one each
round so slow drift of the machine (thermal, other load) does not favour one side. It returns a
BenchReport; see docs/benchmarking.md for what every figure means. In short:

tokens/s         decode tokens per decode second: (new tokens - 1) / (total - prefill), the
                 prefill and the first token being identical off and on. Aggregates are
                 token-weighted (sum of tokens / sum of seconds).
speedup          on tokens/s / off tokens/s; 95 % CI by a seeded percentile bootstrap over
                 prompts (each resample sums tokens and seconds of the drawn prompts).
per-token        tokens emitted in the same round share one timestamp in stats.token_times;
latency          each emission event's gap since the previous event is split evenly over the
                 tokens it emitted (so the latencies of a run sum to its decode time and
                 their mean is 1 / tokens-per-second). The first token (prefill) is excluded
                 and reported as time to first token.
acceptance       accepted / drafted; alpha = accepted / (accepted + rejections), the
                 per-token acceptance probability of the i.i.d. model (its maximum
                 likelihood estimate from truncated rounds); per position i: accepted at i /
                 drafted at i (unconditional) and P(accept i | accepted 0..i-1, i drafted)
                 (conditional).
theoretical      E / (g·c + v(g+1)) with E = (1 - alpha^(g+1)) / (1 - alpha), c = draft step /
speedup          target decode step and v(S) = target call over S tokens / decode step, both
                 from the ONNX Runtime call timings of this run (OrtModel.stats, prefill calls
                 removed); efficiency = measured / theoretical.
draft overhead   time: draft seconds / total seconds of the on runs. Memory: a static
                 estimate, draft graph files + draft KV buffers over the same for both models.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import replace

from specexport_runtime import registry
from specexport_runtime.config import GeneratorConfig
from specexport_runtime.constants import HYBRID_RETRIEVALS, MAX_GAMMA, MIN_GAMMA
from specexport_runtime.errors import InvalidArgument
from specexport_runtime.suffix import SuffixConfig, SuffixStore

from . import constrained as bench_constrained
from . import harness
from .harness import Case, Method, load_prompt_set, make_cases, warmup_case
from .harness_workers import SPECEXPORT_MEMORY
from .plots import write_plots
from .prompts import Prompt
from .report import BenchError, BenchReport, RunRecord, gamma_label
from .summary import QUANT_CAVEAT, build_report, target_exactness

# public names of the bench API kept here (the report, its errors and plots live in bench_report
# and bench_plots; the report's assembly in bench_summary; the statistics in bench_stats)
__all__ = [
    "QUANT_CAVEAT",
    "BenchError",
    "BenchReport",
    "Progress",
    "RunRecord",
    "bench_methods",
    "build_report",
    "run_bench",
    "run_one",
    "target_exactness",
    "write_plots",
]

Progress = Callable[[int, int, str], None]  # (runs done, runs in total, label of the run just done)
WARMUP_TOKENS = 8


def _calls_snapshot(model) -> dict[int, tuple[int, float]]:
    return {} if model is None else {s: (int(v[0]), float(v[1])) for s, v in model.stats.by_len.items()}


def _calls_delta(
    model, before: dict[int, tuple[int, float]], prefill_len: int | None, prefill_seconds: float | None
) -> dict[int, list]:
    """Calls and seconds per call length S made since `before`, minus the run's prefill call
    (S = prefill_len). prefill_seconds (when known) is what that call took at most; else the
    entry's mean is removed."""
    if model is None:
        return {}
    out: dict[int, list] = {}
    for s, (calls, seconds) in _calls_snapshot(model).items():
        c0, s0 = before.get(s, (0, 0.0))
        if calls - c0 > 0:
            out[s] = [calls - c0, seconds - s0]
    if prefill_len is not None and prefill_len in out:
        calls, seconds = out[prefill_len]
        if calls <= 1:
            del out[prefill_len]
        else:
            drop = min(prefill_seconds, seconds) if prefill_seconds is not None else seconds / calls
            out[prefill_len] = [calls - 1, max(0.0, seconds - drop)]
    return out


# --------------------------------------------------------------------------- one run


def run_one(gen, case: Case, config: GeneratorConfig, *, forget: bool = True) -> RunRecord:
    """One generation from the case's token ids (chat prompts through the artifact's chat
    template) with `config` (speculation off, or on with its proposer and gamma; the case's domain
    is added when on), with the per-round log and the ONNX Runtime call timings of this run.
    forget: empty the suffix store of earlier answers first (a harness method's reset does it
    instead)."""
    if config.speculating:
        config = config.replace(domain=case.domain)
    t_before, d_before = _calls_snapshot(gen.target), _calls_snapshot(gen.draft)
    if forget:  # runs are independent: no earlier answer (a repeat!) to copy
        gen.forget_history()
    result = gen.generate(list(case.ids), config)
    st = result.stats
    used_draft_model = config.speculating and registry.get(config.proposer).uses_draft
    return RunRecord(
        prompt_id=case.id,
        domain=case.domain,
        mode="on" if config.speculating else "off",
        gamma=config.gamma if config.speculating else None,
        repeat=case.repeat,
        seed=config.seed,
        finish_reason=result.finish_reason,
        token_ids=list(result.token_ids),
        prompt_ids=list(case.ids),
        stats=st,
        target_calls=_calls_delta(gen.target, t_before, st.prompt_tokens, st.prefill_seconds),
        # the draft's first call of a run (its prefill, S > 1) stays in; only S = 1 is used
        draft_calls=_calls_delta(gen.draft, d_before, None, None) if used_draft_model else {},
    )


# --------------------------------------------------------------------------- main entry


def _check_arguments(
    prompts, gammas: list, repeats: int, max_new_tokens: int | None, hybrid_retrieval: str | None
) -> None:
    if not prompts:
        raise BenchError("no prompts to benchmark")
    for g in gammas:
        if g is not None and (isinstance(g, bool) or not isinstance(g, int) or not MIN_GAMMA <= g <= MAX_GAMMA):
            raise BenchError(f"gamma must be an integer in {MIN_GAMMA}..{MAX_GAMMA} or None (adaptive), got {g!r}")
    if len(set(gammas)) != len(gammas):
        raise BenchError(f"gammas repeat a value: {gammas}")
    if repeats < 1:
        raise BenchError(f"repeats must be >= 1, got {repeats}")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise BenchError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if hybrid_retrieval is not None and hybrid_retrieval not in HYBRID_RETRIEVALS:
        raise BenchError(f"hybrid_retrieval must be {' or '.join(HYBRID_RETRIEVALS)}, got {hybrid_retrieval!r}")


def bench_methods(
    gen,
    base: GeneratorConfig,
    gammas: Sequence[int | None],
    cases: Sequence[Case],
    seed: int,
    grammars: dict | None = None,
) -> list[Method]:
    """One harness Method per configuration: 'off', then on with each gamma (named by its
    label). run(case) is run_one with the case's limit, its grammar (grammars: case id ->
    structured.Grammar, --constrained) and, when sampling, the seed seed + 1000 i + repeat (i:
    the case's index; the warm-up gets `seed`); reset empties the suffix store of earlier answers."""
    grammars = grammars or {}
    index = {c.id: i for i, c in enumerate(cases)}

    def method(speculative: bool, gamma: int | None) -> Method:
        def run(case: Case) -> dict:
            i = index.get(case.id)
            if i is None:  # the warm-up
                run_seed = seed
            else:
                run_seed = None if base.temperature == 0 else seed + 1000 * i + case.repeat
            config = base.replace(
                speculative=speculative,
                gamma=gamma,
                max_new_tokens=case.max_new_tokens,
                seed=run_seed,
                grammar=grammars.get(case.id),
            )
            record = run_one(gen, case, config, forget=False)
            return {"tokens": record.token_ids, "record": record}

        name = gamma_label(gamma) if speculative else "off"
        return Method(name, run, reset=gen.forget_history, memory=SPECEXPORT_MEMORY, info={"mode": name})

    return [method(False, None)] + [method(True, g) for g in gammas]


def _measure(
    methods: list[Method], cases: list[Case], warm: Case, repeats: int, progress: Progress | None
) -> list[RunRecord]:
    """harness.run_interleaved: warm-up on `warm`, the store emptied before every generation,
    methods rotated round by round; the records in the order they ran."""
    runs: list[RunRecord] = []
    total = len(cases) * repeats * len(methods)

    def record(sample) -> None:
        runs.append(sample.result["record"])
        if progress is not None:
            progress(len(runs), total, f"{sample.case} {sample.method}")

    harness.run_interleaved(methods, cases, warm, repeats=repeats, progress=record)
    return runs


def _measure_sequential(
    gen, methods: list[Method], cases: list[Case], warm: Case, repeats: int, progress: Progress | None
) -> list[RunRecord]:
    """Each domain's cases in order as one session per repeat and method, with the store of
    earlier answers kept from case to case (one store per method and session, so a run never sees
    another method's answer to the same prompt). Not run_interleaved, which empties the store
    before every generation; warm-up and the rotated order are the same as there."""
    for m in methods:
        m.reset()
        m.run(warm)
    history = gen.learned("suffix")  # the suffix proposer's store of earlier answers (also hybrid's)
    index = {c.id: i for i, c in enumerate(cases)}
    runs: list[RunRecord] = []
    total = len(cases) * repeats * len(methods)
    for r in range(repeats):
        for domain in dict.fromkeys(c.domain for c in cases):
            stores = {m.name: SuffixStore(history.store.max_tokens) for m in methods}
            for case in (c for c in cases if c.domain == domain):
                for m in harness.rotated(methods, index[case.id] * repeats + r):
                    history.store = stores[m.name]
                    runs.append(m.run(replace(case, repeat=r))["record"])
                    if progress is not None:
                        progress(len(runs), total, f"{case.id} {m.name}")
    gen.forget_history()
    return runs


def run_bench(
    artifact,
    prompts: Sequence[Prompt] | str,
    proposer: str | None = None,
    gammas: Sequence[int | None] = (None,),
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    repeats: int = 3,
    max_new_tokens: int | None = None,
    threads: int | None = None,
    shared_pool: bool = False,
    progress: Progress | None = None,
    hybrid_retrieval: str | None = None,
    sequential: bool = False,
    suffix: SuffixConfig | None = None,
    constrained: bool = False,
) -> BenchReport:
    """Benchmark speculation off versus on (module docstring). `artifact` is a folder or an
    already loaded SpecGenerator; `prompts` Prompt objects or a prompt-set spec
    (harness.load_prompt_set).

    The run is harness.run_interleaved over bench_methods: every configuration first generates
    from harness.warmup_case (a prompt outside the measured set), the suffix store of earlier
    answers is emptied before every generation, and each round (one prompt, one repeat) runs the
    configurations in an order rotated by one from the round before.

    sequential: bench's own loop instead. Each domain's prompts run in order as one session per
    repeat and configuration, and the suffix proposer's store of earlier answers is deliberately
    kept from prompt to prompt (one store per configuration, so a run never sees another
    configuration's answer to the same prompt), which shows learning across requests; by_domain
    then reports the first and last third's speedup. hybrid_retrieval, suffix: the hybrid and
    suffix proposers' settings (GeneratorConfig); None keeps the generator's. constrained: both
    modes decode under each prompt's constraint (bench_constrained.py)."""
    from specexport_runtime.api import load

    if isinstance(prompts, (str, os.PathLike)):
        prompts = load_prompt_set(prompts)
    prompts, gammas = list(prompts), list(gammas) or [None]
    _check_arguments(prompts, gammas, repeats, max_new_tokens, hybrid_retrieval)
    gen = artifact  # a loaded SpecGenerator, or a folder:
    if isinstance(artifact, (str, os.PathLike)):
        gen = load(artifact, threads=threads, shared_pool=shared_pool)
    proposer = gen.resolve_proposer(proposer)  # before any work: unknown, or a draft proposer without a draft
    if not registry.get(proposer).speculative:
        raise InvalidArgument(f"proposer must be one of {', '.join(registry.speculative_names())}, got {proposer!r}")
    settings = {k: v for k, v in (("hybrid_retrieval", hybrid_retrieval), ("suffix", suffix)) if v is not None}
    settings = {"cache_prompt": False, **settings}  # cold prefills: repeats never reuse each other's prompt rows
    base = gen.configure(proposer=proposer, temperature=temperature, top_p=top_p, top_k=top_k, **settings)

    cases = make_cases(gen.codec, prompts, per_prompt_limit=True)
    if max_new_tokens is not None:
        cases = [replace(c, max_new_tokens=max_new_tokens) for c in cases]
    warm = warmup_case(gen.codec, WARMUP_TOKENS)  # first-call allocations, ORT arena growth
    grammars = bench_constrained.grammars(gen.codec, cases) if constrained else {}
    methods = bench_methods(gen, base, gammas, cases, seed, grammars)
    if sequential:
        runs = _measure_sequential(gen, methods, cases, warm, repeats, progress)
    else:
        runs = _measure(methods, cases, warm, repeats, progress)
    report = build_report(
        gen,
        runs,
        prompts,
        base,
        gammas=gammas,
        seed=seed,
        repeats=repeats,
        max_new_tokens=max_new_tokens,
        threads=threads,
        sequential=sequential,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
    )
    if constrained:
        report.constrained = bench_constrained.summarize(gen.codec, runs, cases)
    return report
