"""`specexport bench`: speculation off versus on, over prompt sets, with honest statistics.

run_bench() loads an artifact once, warms it up, then for every prompt and repeat runs the
target alone (speculation off) and with speculation on (each requested gamma; None =
adaptive), alternating the order (off-on, then on-off) so slow drift of the machine (thermal,
other load) does not favour one side. It returns a BenchReport; see docs/benchmarking.md for
what every figure means. In short:

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

import math
import os
import platform
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from specexport_runtime.errors import InvalidArgument, SpecExportError
from specexport_runtime.manifest import DRAFT_MODEL_PROPOSERS, SPECULATIVE_PROPOSERS

from .prompts import Prompt, load_prompts

Progress = Callable[[int, int, str], None]  # (runs done, runs in total, label of the run just done)
EXACT_PRECISIONS = ("fp32", "fp16")
BOOTSTRAP_SAMPLES = 2000
WARMUP_TOKENS = 8
QUANT_CAVEAT = (
    "target precision {precision!r} is quantized: its kernels (dynamic activation quantization, "
    "different matmul paths for 1-token decode and multi-token verify) can round a call of S tokens "
    "differently from S calls of 1 token, so greedy outputs may diverge at near-ties without any bug "
    "in the speculative loop (docs/benchmarking.md, 'Output equivalence')"
)


class BenchError(SpecExportError, ValueError):
    """Invalid benchmark arguments (no prompts, bad gamma, ...)."""


def _gamma_label(gamma: int | None) -> str:
    return "adaptive" if gamma is None else str(gamma)


def _calls_snapshot(model) -> dict[int, tuple[int, float]]:
    return {} if model is None else {s: (int(v[0]), float(v[1])) for s, v in model.stats.by_len.items()}


def _calls_delta(model, before: dict[int, tuple[int, float]], prefill_len: int | None,
                 prefill_seconds: float | None) -> dict[int, list]:
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


@dataclass
class RunRecord:
    """One generation: speculation off, or on with one gamma (None = adaptive)."""

    prompt_id: str
    domain: str
    mode: str  # "off" | "on"
    gamma: int | None
    repeat: int
    seed: int | None
    prompt_tokens: int
    new_tokens: int
    finish_reason: str
    total_seconds: float
    prefill_seconds: float
    draft_seconds: float
    target_seconds: float
    rounds: int
    plain_steps: int
    drafted: int
    accepted: int
    corrections: int
    bonus: int
    drafted_at: list[int]
    accepted_at: list[int]
    round_sizes: list[tuple[int, int]]  # (drafted k, accepted n) per speculative round
    token_ids: list[int]
    token_times: list[float]
    target_calls: dict[int, list]  # S -> [calls, seconds] in this run, prefill excluded
    draft_calls: dict[int, list]
    prompt_ids: list[int] = field(default_factory=list, repr=False)
    lookup_rounds: int = 0  # hybrid proposer: rounds served by prompt lookup

    @property
    def label(self) -> str:
        return "off" if self.mode == "off" else _gamma_label(self.gamma)

    @property
    def decode_tokens(self) -> int:
        return max(0, self.new_tokens - 1)

    @property
    def decode_seconds(self) -> float:
        return max(0.0, self.total_seconds - self.prefill_seconds)

    @property
    def tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 and self.decode_tokens else 0.0

    def token_latencies(self) -> list[float]:
        """Per-token latency, tokens of one emission event sharing its gap evenly (module doc)."""
        times, out = self.token_times, []
        if len(times) < 2:
            return out
        prev, i = times[0], 1
        while i < len(times):
            j = i
            while j < len(times) and times[j] == times[i]:
                j += 1
            gap = times[i] - prev
            out.extend([gap / (j - i)] * (j - i))
            prev, i = times[i], j
        return out

    def summary(self) -> dict:
        """The JSON row of this run (no token lists)."""
        return {
            "prompt_id": self.prompt_id, "domain": self.domain, "mode": self.mode, "gamma": self.gamma,
            "repeat": self.repeat, "seed": self.seed, "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens, "finish_reason": self.finish_reason,
            "total_seconds": self.total_seconds, "prefill_seconds": self.prefill_seconds,
            "draft_seconds": self.draft_seconds, "target_seconds": self.target_seconds,
            "tokens_per_second": self.tokens_per_second, "rounds": self.rounds,
            "plain_steps": self.plain_steps, "drafted": self.drafted, "accepted": self.accepted,
            "corrections": self.corrections, "bonus": self.bonus, "lookup_rounds": self.lookup_rounds,
        }


def prompt_ids(gen, prompt: Prompt) -> list[int]:
    return gen.codec.encode_chat(prompt.chat()) if prompt.is_chat else gen.codec.encode(prompt.text)


def run_one(gen, prompt: Prompt, *, speculative: bool, gamma: int | None, proposer: str | None,
            max_new_tokens: int, temperature: float, top_p: float, top_k: int, seed: int | None,
            repeat: int = 0, ids: list[int] | None = None) -> RunRecord:
    """One generation through the public API (gen.chat for chat prompts, gen.generate for
    text), with the per-round log and the ONNX Runtime call timings of this run."""
    kwargs = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                  speculative=speculative)
    if speculative:
        kwargs.update(gamma=gamma, proposer=proposer, domain=prompt.domain)
    t_before, d_before = _calls_snapshot(gen.target), _calls_snapshot(gen.draft)
    result = gen.chat(prompt.chat(), **kwargs) if prompt.is_chat else gen.generate(prompt.text, **kwargs)
    st = result.stats
    used_draft_model = speculative and (proposer or gen.default_proposer) in DRAFT_MODEL_PROPOSERS
    return RunRecord(
        prompt_id=prompt.id, domain=prompt.domain, mode="on" if speculative else "off",
        gamma=gamma if speculative else None, repeat=repeat, seed=seed, prompt_tokens=st.prompt_tokens,
        new_tokens=st.new_tokens, finish_reason=result.finish_reason, total_seconds=st.total_seconds,
        prefill_seconds=st.prefill_seconds, draft_seconds=st.draft_seconds, target_seconds=st.target_seconds,
        rounds=st.rounds, plain_steps=st.plain_steps, drafted=st.drafted, accepted=st.accepted,
        corrections=st.corrections, bonus=st.bonus, drafted_at=list(st.drafted_at), accepted_at=list(st.accepted_at),
        round_sizes=list(st.round_sizes), token_ids=list(result.token_ids), token_times=list(st.token_times),
        target_calls=_calls_delta(gen.target, t_before, st.prompt_tokens, st.prefill_seconds),
        # the draft's first call of a run (its prefill, S > 1) stays in; only S = 1 is used
        draft_calls=_calls_delta(gen.draft, d_before, None, None) if used_draft_model else {},
        prompt_ids=list(ids) if ids is not None else [],
        lookup_rounds=st.lookup_rounds,
    )


# --------------------------------------------------------------------------- statistics


def percentiles(values: Iterable[float]) -> dict[str, float | None]:
    vals = np.asarray(list(values), dtype=np.float64)
    if vals.size == 0:
        return {"p50": None, "p90": None, "p99": None}
    p50, p90, p99 = np.percentile(vals, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99)}


def bootstrap_ci(values: Sequence[float], seed: int, samples: int = BOOTSTRAP_SAMPLES) -> tuple[float, float] | None:
    """95 % percentile-bootstrap interval of the mean (seeded)."""
    vals = np.asarray(values, dtype=np.float64)
    if vals.size == 0:
        return None
    if vals.size == 1:
        return float(vals[0]), float(vals[0])
    rng = np.random.default_rng(seed)
    means = vals[rng.integers(0, vals.size, size=(samples, vals.size))].mean(axis=1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return float(lo), float(hi)


def ratio_ci(num_tok, num_sec, den_tok, den_sec, seed: int, samples: int = BOOTSTRAP_SAMPLES) -> tuple[float, float] | None:
    """95 % bootstrap interval over prompts of (sum num_tok / sum num_sec) / (sum den_tok / sum den_sec)."""
    arrays = [np.asarray(a, dtype=np.float64) for a in (num_tok, num_sec, den_tok, den_sec)]
    n = arrays[0].size
    if n == 0:
        return None
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(samples, n)) if n > 1 else np.zeros((1, 1), dtype=np.int64)
    nt, ns, dt, ds = (a[idx].sum(axis=1) for a in arrays)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = (nt / ns) / (dt / ds)
    ratio = ratio[np.isfinite(ratio)]
    if ratio.size == 0:
        return None
    lo, hi = np.percentile(ratio, [2.5, 97.5])
    return float(lo), float(hi)


def _tps(runs: Sequence[RunRecord]) -> float:
    sec = sum(r.decode_seconds for r in runs)
    return sum(r.decode_tokens for r in runs) / sec if sec > 0 else 0.0


def _mean(values) -> float | None:
    values = list(values)
    return float(np.mean(values)) if values else None


def distinct_2(ids: Sequence[int]) -> float:
    pairs = list(zip(ids, ids[1:]))
    return len(set(pairs)) / len(pairs) if pairs else 0.0


def score_loglik(gen, prompt_ids: Sequence[int], output: Sequence[int]) -> float | None:
    """Mean target log-likelihood per generated token (temperature 1, untruncated, over all
    embedding rows like the sampler): one target pass over prompt + output, in chunks of at
    most the model's logits rows."""
    output = list(output)
    if not output or not prompt_ids:
        return None
    model = gen.target
    model.reset()
    if len(prompt_ids) > 1:
        model.forward(list(prompt_ids[:-1]))
    seq = [int(prompt_ids[-1])] + output[:-1]  # row j predicts output[j]
    total = 0.0
    for start in range(0, len(seq), model.max_rows):
        chunk = seq[start : start + model.max_rows]
        rows = np.asarray(model.forward(chunk, last_rows=len(chunk)), dtype=np.float64)
        top = rows.max(axis=1, keepdims=True)
        lse = top[:, 0] + np.log(np.exp(rows - top).sum(axis=1))
        picked = rows[np.arange(len(chunk)), output[start : start + len(chunk)]]
        total += float((picked - lse).sum())
    model.reset()
    return total / len(output)


# --------------------------------------------------------------------------- report


@dataclass
class ModeStats:
    label: str
    runs: int
    tokens_per_second: float
    new_tokens_mean: float
    e2e_seconds: dict
    token_latency_seconds: dict
    ttft_seconds_p50: float | None


@dataclass
class Acceptance:
    rounds: int
    plain_steps: int
    drafted: int
    accepted: int
    corrections: int
    bonus: int
    acceptance_rate: float | None  # accepted / drafted (None: nothing drafted)
    alpha: float | None  # accepted / (accepted + rejections)
    mean_accepted_per_round: float | None  # accepted / rounds
    tokens_per_target_call: float  # (accepted + rounds + plain steps) / (rounds + plain steps)
    per_position: list[float]  # accepted at i / drafted at i
    per_position_conditional: list[float | None]  # P(accept i | accepted 0..i-1, i drafted)
    accepted_histogram: list[int]  # rounds that accepted n tokens, n = 0, 1, ...
    lookup_rounds: int = 0  # hybrid proposer: rounds served by prompt lookup (the rest: draft model)


@dataclass
class ConfigResult:
    """Speculation on with one gamma (label 'adaptive' for None), compared to the off runs."""

    gamma: int | None
    label: str
    on: ModeStats
    acceptance: Acceptance
    speedup: float
    speedup_ci95: tuple[float, float] | None
    theoretical: dict
    efficiency: float | None
    draft_time_share: float
    by_domain: dict[str, dict]
    by_prompt: dict[str, dict]
    equivalence: dict | None = None  # greedy
    quality: dict | None = None  # sampling


@dataclass
class BenchReport:
    meta: dict
    lengths: dict
    off: ModeStats
    configs: list[ConfigResult]
    memory: dict
    costs: dict
    quality_off: dict | None = None
    caveats: list[str] = field(default_factory=list)
    runs: list[RunRecord] = field(default_factory=list, repr=False)

    def config(self, gamma: int | None) -> ConfigResult:
        for c in self.configs:
            if c.gamma == gamma:
                return c
        raise KeyError(gamma)

    def to_dict(self, include_runs: bool = True) -> dict:
        data = {
            "meta": self.meta, "lengths": self.lengths, "off": asdict(self.off),
            "configs": [asdict(c) for c in self.configs], "memory": self.memory, "costs": self.costs,
            "quality_off": self.quality_off, "caveats": list(self.caveats),
        }
        if include_runs:
            data["runs"] = [r.summary() for r in self.runs]
        return _jsonable(data)

    # ----------------------------------------------------------------------- text

    def summary_lines(self) -> list[str]:
        m, L = self.meta, self.lengths
        t = m["target"]
        lines = [f"specexport bench: {m['name']}  ({m['artifact']})"]
        lines.append(f"  target      {t['source']}  {t['precision']}, {t['bytes'] / 1e6:.1f} MB, max_context {m['max_context']}")
        if m["proposer"] == "draft" and m.get("draft"):
            d = m["draft"]
            prop = f"draft model {d['precision']}, {d['bytes'] / 1e6:.1f} MB ({d['source']})"
        else:
            prop = f"{m['proposer']} (prompt lookup, n-gram sizes {m.get('ngram_sizes')})" if m["proposer"] == "ngram" else m["proposer"]
        lines.append(f"  proposer    {prop}")
        lines.append(f"  gamma       {', '.join(_gamma_label(g) for g in m['gammas'])}")
        s = m["sampling"]
        samp = "greedy" if s["temperature"] == 0 else (
            f"temperature {s['temperature']}, top_p {s['top_p']}, top_k {s['top_k']}, seed {s['seed']}")
        lines.append(f"  sampling    {samp}")
        doms = ", ".join(f"{d} {n}" for d, n in m["domains"].items())
        lines.append(f"  prompts     {m['prompts']} ({doms}); repeats {m['repeats']}; threads {m['threads'] or 'default'}")
        lines.append(
            f"  lengths     input {L['input_tokens']['mean']:.0f} tokens mean (min {L['input_tokens']['min']}, "
            f"max {L['input_tokens']['max']}); output {L['output_tokens_off']['mean']:.1f} off / "
            + " / ".join(f"{L['output_tokens_on'][c.label]['mean']:.1f} on[{c.label}]" for c in self.configs)
        )
        lines.append(f"  off         {_mode_line(self.off)}")
        for c in self.configs:
            a = c.acceptance
            ci = f" [95% CI {c.speedup_ci95[0]:.2f}-{c.speedup_ci95[1]:.2f}]" if c.speedup_ci95 else ""
            th = c.theoretical.get("speedup")
            theo = f"; theoretical {th:.2f}x, efficiency {c.efficiency:.0%}" if th and c.efficiency is not None else ""
            lines.append(f"  {'on[' + c.label + ']':<11} {_mode_line(c.on)}")
            lines.append(" " * 14 + f"speedup {c.speedup:.2f}x{ci}{theo}")
            pos = " ".join(f"{p:.2f}" for p in a.per_position[:8])
            lines.append(
                " " * 14 + f"acceptance {_f(a.acceptance_rate)} (alpha {_f(a.alpha)}), {_f(a.mean_accepted_per_round)} "
                f"accepted/round, {a.tokens_per_target_call:.2f} tokens/target call ({a.rounds} rounds, "
                f"{a.plain_steps} plain steps"
                + (f", {a.lookup_rounds} by lookup" if a.lookup_rounds else "")
                + f"); by position {pos or 'n/a'}"
            )
            if c.by_domain:
                dom = ", ".join(f"{d} {v['speedup']:.2f}x acc {_f(v['acceptance_rate'])} eff {_f(v['efficiency'], '.0%')}"
                                for d, v in c.by_domain.items())
                lines.append(" " * 14 + f"by domain: {dom}")
            lines.append(" " * 14 + f"draft overhead: {c.draft_time_share:.0%} of on time")
            if c.equivalence is not None:
                e = c.equivalence
                div = ""
                if e["divergences"]:
                    first = e["divergences"][0]
                    div = f"; first divergence {first['prompt_id']} at token {first['position']}"
                lines.append(" " * 14 + f"equivalence (greedy): {e['identical_prompts']}/{e['prompts']} prompts identical "
                             f"({e['share']:.0%}){div}")
            if c.quality is not None:
                lines.append(" " * 14 + "quality: " + _quality_line(c.quality))
        mem = self.memory
        if mem.get("draft_bytes"):
            lines.append(f"  memory      draft {mem['draft_bytes'] / 1e6:.1f} MB of {mem['total_bytes'] / 1e6:.1f} MB "
                         f"({mem['draft_share']:.0%}; static: graph files + KV buffers at max_context)")
        else:
            lines.append("  memory      no draft model (n-gram lookup: no extra model memory)")
        if self.quality_off is not None:
            lines.append("  quality off " + _quality_line(self.quality_off))
        for cav in self.caveats:
            lines.append(f"  caveat      {cav}")
        return lines

    def to_markdown(self) -> str:
        m = self.meta
        out = [f"# specexport bench: {m['name']}", "", "```", *self.summary_lines(), "```", ""]
        out += ["| config | tok/s | speedup (95% CI) | theoretical | efficiency | acceptance | alpha | tokens/call |"
                " e2e p50/p90/p99 s | per-token p50/p90/p99 ms | draft time |",
                "|---|---|---|---|---|---|---|---|---|---|---|"]
        o = self.off
        out.append(f"| off | {o.tokens_per_second:.1f} | 1.00 | | | | | 1.00 | {_pcts(o.e2e_seconds, 1)} | "
                   f"{_pcts(o.token_latency_seconds, 1e3)} | |")
        for c in self.configs:
            ci = f" ({c.speedup_ci95[0]:.2f}-{c.speedup_ci95[1]:.2f})" if c.speedup_ci95 else ""
            th = c.theoretical.get("speedup")
            out.append(
                f"| on[{c.label}] | {c.on.tokens_per_second:.1f} | {c.speedup:.2f}{ci} | {th:.2f} | "
                f"{(c.efficiency or 0):.0%} | {_f(c.acceptance.acceptance_rate)} | {_f(c.acceptance.alpha)} | "
                f"{c.acceptance.tokens_per_target_call:.2f} | {_pcts(c.on.e2e_seconds, 1)} | "
                f"{_pcts(c.on.token_latency_seconds, 1e3)} | {c.draft_time_share:.0%} |"
                if th is not None else
                f"| on[{c.label}] | {c.on.tokens_per_second:.1f} | {c.speedup:.2f}{ci} | n/a | n/a | "
                f"{_f(c.acceptance.acceptance_rate)} | {_f(c.acceptance.alpha)} | {c.acceptance.tokens_per_target_call:.2f} | "
                f"{_pcts(c.on.e2e_seconds, 1)} | {_pcts(c.on.token_latency_seconds, 1e3)} | {c.draft_time_share:.0%} |"
            )
        for c in self.configs:
            if not c.by_domain:
                continue
            out += ["", f"## by domain, on[{c.label}]", "",
                    "| domain | prompts | speedup (95% CI) | acceptance | tokens/call | efficiency | identical |",
                    "|---|---|---|---|---|---|---|"]
            for d, v in c.by_domain.items():
                ci = f" ({v['speedup_ci95'][0]:.2f}-{v['speedup_ci95'][1]:.2f})" if v.get("speedup_ci95") else ""
                out.append(f"| {d} | {v['prompts']} | {v['speedup']:.2f}{ci} | {_f(v['acceptance_rate'])} | "
                           f"{v['tokens_per_target_call']:.2f} | {_f(v['efficiency'], '.0%')} | "
                           f"{_f(v['identical_share'], '.0%')} |")
        return "\n".join(out) + "\n"


def _f(x: float | None, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def _pcts(p: dict, scale: float) -> str:
    if p.get("p50") is None:
        return "n/a"
    return f"{p['p50'] * scale:.2f}/{p['p90'] * scale:.2f}/{p['p99'] * scale:.2f}"


def _mode_line(m: ModeStats) -> str:
    return (f"{m.tokens_per_second:.1f} tok/s; e2e p50/p90/p99 {_pcts(m.e2e_seconds, 1)} s; "
            f"per-token p50/p90/p99 {_pcts(m.token_latency_seconds, 1e3)} ms")


def _quality_line(q: dict) -> str:
    def fmt(key: str, spec: str) -> str:
        v = q[key]
        if v["mean"] is None:
            return f"{key} n/a"
        ci = f" [{v['ci95'][0]:{spec}}, {v['ci95'][1]:{spec}}]" if v.get("ci95") else ""
        return f"{key} {v['mean']:{spec}}{ci}"

    return ", ".join([fmt("loglik_per_token", ".3f"), fmt("output_tokens", ".1f"), fmt("distinct_2", ".3f")]) + (
        f"; {q['verdict']}" if q.get("verdict") else "")


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, (np.floating, float)):
        return None if not math.isfinite(float(obj)) else float(obj)
    if isinstance(obj, np.integer):
        return int(obj)
    return obj


# --------------------------------------------------------------------------- aggregation


def mode_stats(label: str, runs: Sequence[RunRecord]) -> ModeStats:
    lat = [x for r in runs for x in r.token_latencies()]
    ttft = [r.token_times[0] for r in runs if r.token_times]
    return ModeStats(
        label=label, runs=len(runs), tokens_per_second=_tps(runs),
        new_tokens_mean=float(np.mean([r.new_tokens for r in runs])) if runs else 0.0,
        e2e_seconds=percentiles(r.total_seconds for r in runs), token_latency_seconds=percentiles(lat),
        ttft_seconds_p50=percentiles(ttft)["p50"],
    )


def acceptance(runs: Sequence[RunRecord]) -> Acceptance:
    rounds = sum(r.rounds for r in runs)
    plain = sum(r.plain_steps for r in runs)
    drafted = sum(r.drafted for r in runs)
    accepted = sum(r.accepted for r in runs)
    corrections = sum(r.corrections for r in runs)
    width = max((len(r.drafted_at) for r in runs), default=0)
    d_at, a_at = [0] * width, [0] * width
    for r in runs:
        for i, (d, a) in enumerate(zip(r.drafted_at, r.accepted_at)):
            d_at[i] += d
            a_at[i] += a
    sizes = [rs for r in runs for rs in r.round_sizes]
    cond = conditional_acceptance(sizes, width)
    hist = [0] * (max((n for _, n in sizes), default=-1) + 1)
    for _, n in sizes:
        hist[n] += 1
    calls = rounds + plain
    return Acceptance(
        rounds=rounds, plain_steps=plain, drafted=drafted, accepted=accepted, corrections=corrections,
        bonus=sum(r.bonus for r in runs), acceptance_rate=accepted / drafted if drafted else None,
        alpha=accepted / (accepted + corrections) if drafted else None,
        mean_accepted_per_round=accepted / rounds if rounds else None,
        tokens_per_target_call=(accepted + calls) / calls if calls else 0.0,
        per_position=[a / d if d else 0.0 for a, d in zip(a_at, d_at)], per_position_conditional=cond,
        accepted_histogram=hist, lookup_rounds=sum(r.lookup_rounds for r in runs),
    )


def conditional_acceptance(sizes: Sequence[tuple[int, int]], width: int) -> list[float | None]:
    """P(accept position i | positions 0..i-1 accepted and position i drafted), i < width."""
    out: list[float | None] = []
    for i in range(width):
        reached = sum(1 for k, n in sizes if k > i and n >= i)
        passed = sum(1 for k, n in sizes if n > i)
        out.append(passed / reached if reached else None)
    return out


def _pool(calls: Iterable[dict[int, list]]) -> dict[int, tuple[int, float]]:
    pooled: dict[int, list] = {}
    for c in calls:
        for s, (n, sec) in c.items():
            entry = pooled.setdefault(int(s), [0, 0.0])
            entry[0] += n
            entry[1] += sec
    return {s: (n, sec) for s, (n, sec) in pooled.items() if n > 0}


def measured_costs(off: Sequence[RunRecord], on: Sequence[RunRecord], proposer: str) -> dict:
    """Mean seconds per call: target decode (S = 1, off runs), target at each S (on runs) and
    the proposer's step (draft model S = 1 calls, or lookup seconds per drafted token)."""
    t_off, t_on = _pool(r.target_calls for r in off), _pool(r.target_calls for r in on)
    decode = t_off.get(1) or t_on.get(1)
    out: dict[str, Any] = {"decode_s": decode[1] / decode[0] if decode else None}
    out["target_s"] = {s: sec / n for s, (n, sec) in sorted(t_on.items()) if 1 < s <= 33}  # verify: S = k + 1
    if proposer == "draft":
        d = _pool(r.draft_calls for r in on).get(1)
        out["draft_step_s"] = d[1] / d[0] if d else None
    else:
        drafted = sum(r.drafted for r in on)
        out["draft_step_s"] = sum(r.draft_seconds for r in on) / drafted if drafted else None
    return out


def verify_cost(costs: dict, s: int) -> float | None:
    """Seconds of a target call over s tokens: measured when timed, else the controller's
    least-squares line through the timed sizes (specexport_runtime.adaptive)."""
    from specexport_runtime.adaptive import GammaController

    table = {int(k): float(v) for k, v in (costs.get("target_s") or costs.get("verify_s") or {}).items()}
    if s in table:
        return table[s]
    if s == 1 and costs.get("decode_s"):
        return float(costs["decode_s"])
    if not table and not costs.get("decode_s"):
        return None
    ctl = GammaController(cost_decode=costs.get("decode_s"), verify_costs=table)
    v = ctl.cost_verify(s)
    return None if math.isnan(v) else v


def theoretical_speedup(alpha: float, gamma: int, costs: dict) -> dict:
    """E / (g·c + v(g+1)), E = (1 - alpha^(g+1)) / (1 - alpha) (summed, exact at alpha = 1)."""
    decode, step = costs.get("decode_s"), costs.get("draft_step_s")
    verify = verify_cost(costs, gamma + 1)
    e = float(sum(alpha**i for i in range(gamma + 1)))
    if not decode or step is None or verify is None:
        return {"gamma": gamma, "alpha": alpha, "expected_tokens": e, "c": None, "v": None, "speedup": None}
    c, v = step / decode, verify / decode
    return {"gamma": gamma, "alpha": alpha, "expected_tokens": e, "c": c, "v": v, "speedup": e / (gamma * c + v)}


def equivalence(off: Sequence[RunRecord], on: Sequence[RunRecord]) -> dict:
    ref = {(r.prompt_id, r.repeat): r.token_ids for r in off}
    per_prompt: dict[str, bool] = {}
    divergences = []
    for r in on:
        base = ref.get((r.prompt_id, r.repeat))
        if base is None:
            continue
        same = base == r.token_ids
        per_prompt[r.prompt_id] = per_prompt.get(r.prompt_id, True) and same
        if not same:
            pos = next((i for i, (a, b) in enumerate(zip(base, r.token_ids)) if a != b), min(len(base), len(r.token_ids)))
            divergences.append({"prompt_id": r.prompt_id, "repeat": r.repeat, "position": pos,
                                "off_tokens": len(base), "on_tokens": len(r.token_ids)})
    n = len(per_prompt)
    identical = sum(per_prompt.values())
    return {"prompts": n, "identical_prompts": identical, "share": identical / n if n else 0.0,
            "divergences": divergences}


def quality(gen, runs: Sequence[RunRecord], seed: int) -> dict:
    ll = [x for x in (score_loglik(gen, r.prompt_ids, r.token_ids) for r in runs) if x is not None]
    lengths = [float(r.new_tokens) for r in runs]
    d2 = [distinct_2(r.token_ids) for r in runs]
    out = {}
    for key, vals in (("loglik_per_token", ll), ("output_tokens", lengths), ("distinct_2", d2)):
        out[key] = {"mean": _mean(vals), "ci95": bootstrap_ci(vals, seed), "n": len(vals), "values": vals}
    return out


def quality_verdict(q_on: dict, q_off: dict, seed: int) -> dict:
    """Bootstrap 95 % CI of (on mean - off mean) for each metric; exact sampling predicts 0."""
    rng = np.random.default_rng(seed)
    diffs, ok = {}, True
    for key in ("loglik_per_token", "output_tokens", "distinct_2"):
        a, b = np.asarray(q_on[key]["values"]), np.asarray(q_off[key]["values"])
        if a.size == 0 or b.size == 0:
            continue
        da = a[rng.integers(0, a.size, (BOOTSTRAP_SAMPLES, a.size))].mean(1)
        db = b[rng.integers(0, b.size, (BOOTSTRAP_SAMPLES, b.size))].mean(1)
        lo, hi = np.percentile(da - db, [2.5, 97.5])
        diffs[key] = {"diff": float(a.mean() - b.mean()), "ci95": (float(lo), float(hi))}
        ok = ok and lo <= 0.0 <= hi
    return {"differences": diffs,
            "verdict": "on and off agree (every 95% CI of the difference contains 0)" if ok
            else "a 95% CI of the on-off difference excludes 0 (expected about 1 time in 20 per metric by chance)"}


# --------------------------------------------------------------------------- main entry


def _graph_bytes(root: Path, manifest, entry) -> int:
    graph = Path(entry.graph)
    return sum((root / rel).stat().st_size for rel in manifest.files
               if Path(rel).parent == graph.parent and Path(rel).name.startswith(graph.name))


def memory_estimate(gen, proposer: str) -> dict:
    root, man = gen.root, gen.manifest
    target_bytes = _graph_bytes(root, man, man.target) + gen.target.kv_nbytes()
    draft_bytes = 0
    if proposer in DRAFT_MODEL_PROPOSERS and gen.draft is not None:
        draft_bytes = _graph_bytes(root, man, man.draft) + gen.draft.kv_nbytes()
    total = target_bytes + draft_bytes
    return {"method": "static: graph files + KV buffers at max_context", "target_bytes": target_bytes,
            "draft_bytes": draft_bytes, "total_bytes": total, "draft_share": draft_bytes / total if total else 0.0}


def resolve_prompts(specs: Sequence[str | os.PathLike] | str, limit: int | None = None) -> list[Prompt]:
    """Load prompt sets (domain names, 'all' or JSONL paths); keep the first `limit` per domain."""
    if isinstance(specs, (str, os.PathLike)):
        specs = [specs]
    prompts: list[Prompt] = []
    seen = set()
    for spec in specs:
        for p in load_prompts(spec):
            if p.id not in seen:
                seen.add(p.id)
                prompts.append(p)
    if limit is not None:
        counts: dict[str, int] = {}
        kept = []
        for p in prompts:
            if counts.get(p.domain, 0) < limit:
                counts[p.domain] = counts.get(p.domain, 0) + 1
                kept.append(p)
        prompts = kept
    return prompts


def run_bench(artifact, prompts: Sequence[Prompt] | str, proposer: str | None = None,
              gammas: Sequence[int | None] = (None,), temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
              seed: int = 0, repeats: int = 3, max_new_tokens: int | None = None, threads: int | None = None,
              shared_pool: bool = False,
              progress: Progress | None = None) -> BenchReport:
    """Benchmark speculation off versus on (module docstring). `artifact` is a folder or an
    already loaded SpecGenerator; `prompts` Prompt objects or a prompt-set spec."""
    from specexport_runtime.api import load

    if isinstance(prompts, (str, os.PathLike)):
        prompts = resolve_prompts(prompts)
    prompts = list(prompts)
    if not prompts:
        raise BenchError("no prompts to benchmark")
    gammas = list(gammas) or [None]
    for g in gammas:
        if g is not None and (isinstance(g, bool) or not isinstance(g, int) or not 1 <= g <= 32):
            raise BenchError(f"gamma must be an integer in 1..32 or None (adaptive), got {g!r}")
    if len(set(gammas)) != len(gammas):
        raise BenchError(f"gammas repeat a value: {gammas}")
    if repeats < 1:
        raise BenchError(f"repeats must be >= 1, got {repeats}")
    if max_new_tokens is not None and max_new_tokens < 1:
        raise BenchError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    gen = load(artifact, threads=threads, shared_pool=shared_pool) if isinstance(artifact, (str, os.PathLike)) else artifact
    proposer = gen.resolve_proposer(proposer)  # before any work: unknown, or a draft proposer without a draft
    if proposer not in SPECULATIVE_PROPOSERS:
        raise InvalidArgument(f"proposer must be one of {', '.join(SPECULATIVE_PROPOSERS)}, got {proposer!r}")
    sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k)

    # warm-up: one short run each way (first-call allocations, ORT arena growth)
    warm = prompts[0]
    for spec in (False, True):
        run_one(gen, warm, speculative=spec, gamma=None, proposer=proposer, max_new_tokens=WARMUP_TOKENS,
                seed=seed, **sampling)

    ids_of = {p.id: prompt_ids(gen, p) for p in prompts}
    configs: list[tuple[bool, int | None]] = [(False, None)] + [(True, g) for g in gammas]
    total, done = len(prompts) * repeats * len(configs), 0
    runs: list[RunRecord] = []
    for i, p in enumerate(prompts):
        n_new = max_new_tokens or p.max_new_tokens
        for r in range(repeats):
            order = configs if (i * repeats + r) % 2 == 0 else configs[::-1]
            run_seed = None if temperature == 0 else seed + 1000 * i + r
            for spec, g in order:
                rec = run_one(gen, p, speculative=spec, gamma=g, proposer=proposer, max_new_tokens=n_new,
                              seed=run_seed, repeat=r, ids=ids_of[p.id], **sampling)
                runs.append(rec)
                done += 1
                if progress is not None:
                    progress(done, total, f"{p.id} {rec.label}")
    return build_report(gen, runs, prompts, proposer=proposer, gammas=gammas, seed=seed, repeats=repeats,
                        max_new_tokens=max_new_tokens, threads=threads, **sampling)


def build_report(gen, runs: list[RunRecord], prompts: Sequence[Prompt], *, proposer: str, gammas, seed: int,
                 repeats: int, max_new_tokens, threads, temperature: float, top_p: float, top_k: int) -> BenchReport:
    man = gen.manifest
    off = [r for r in runs if r.mode == "off"]
    domains: dict[str, int] = {}
    for p in prompts:
        domains[p.domain] = domains.get(p.domain, 0) + 1
    target_bytes = _graph_bytes(gen.root, man, man.target)
    meta = {
        "artifact": str(gen.root), "name": man.name, "max_context": man.max_context,
        "target": {"source": man.target.source, "precision": man.target.precision, "bytes": target_bytes,
                   "architecture": man.target.architecture},
        "draft": None if man.draft is None else {"source": man.draft.source, "precision": man.draft.precision,
                                                 "bytes": _graph_bytes(gen.root, man, man.draft)},
        "proposer": proposer, "ngram_sizes": list(man.speculation.ngram_sizes), "gammas": list(gammas),
        "sampling": {"temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed},
        "prompts": len(prompts), "domains": domains, "repeats": repeats, "max_new_tokens": max_new_tokens,
        "threads": threads, "machine": {"platform": platform.platform(), "processor": platform.processor(),
                                        "cpu_count": os.cpu_count()},
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    try:
        import onnxruntime

        meta["onnxruntime"] = onnxruntime.__version__
    except ImportError:  # pragma: no cover
        pass
    input_tokens = [r.prompt_tokens for r in off]

    def length_stats(vals):
        return {"mean": float(np.mean(vals)) if vals else 0.0, "min": min(vals, default=0), "max": max(vals, default=0)}

    lengths = {"input_tokens": length_stats(input_tokens), "output_tokens_off": length_stats([r.new_tokens for r in off]),
               "output_tokens_on": {}}
    caveats = []
    greedy = temperature == 0
    if greedy and man.target.precision not in EXACT_PRECISIONS:
        caveats.append(QUANT_CAVEAT.format(precision=man.target.precision))
    off_by_prompt = {p.id: [r for r in off if r.prompt_id == p.id] for p in prompts}
    quality_off = quality(gen, off, seed) if not greedy else None
    configs = []
    for k, g in enumerate(gammas):
        on = [r for r in runs if r.mode == "on" and r.gamma == g]
        label = _gamma_label(g)
        lengths["output_tokens_on"][label] = length_stats([r.new_tokens for r in on])
        on_by_prompt = {p.id: [r for r in on if r.prompt_id == p.id] for p in prompts}
        acc = acceptance(on)
        on_tps, off_tps = _tps(on), _tps(off)
        speedup = on_tps / off_tps if off_tps > 0 else 0.0

        def sums(ids):
            return ([sum(r.decode_tokens for r in on_by_prompt[i]) for i in ids],
                    [sum(r.decode_seconds for r in on_by_prompt[i]) for i in ids],
                    [sum(r.decode_tokens for r in off_by_prompt[i]) for i in ids],
                    [sum(r.decode_seconds for r in off_by_prompt[i]) for i in ids])

        ci = ratio_ci(*sums([p.id for p in prompts]), seed=seed + k)
        costs = measured_costs(off, on, proposer)
        # g: tokens actually drafted per round (= the fixed gamma for a draft model; n-gram
        # lookup and the adaptive controller draft a varying number)
        g_eff = max(1, round(acc.drafted / acc.rounds)) if acc.rounds else (g or 1)
        theo = theoretical_speedup(acc.alpha, g_eff, costs) if acc.alpha is not None else {
            "gamma": g_eff, "alpha": None, "expected_tokens": None, "c": None, "v": None, "speedup": None}
        theo["gamma_source"] = "mean drafted per round"
        efficiency = speedup / theo["speedup"] if theo.get("speedup") else None
        total_on = sum(r.total_seconds for r in on)
        by_domain = {}
        for d in domains:
            ids = [p.id for p in prompts if p.domain == d]
            d_on = [r for i in ids for r in on_by_prompt[i]]
            d_off = [r for i in ids for r in off_by_prompt[i]]
            d_acc = acceptance(d_on)
            d_off_tps = _tps(d_off)
            d_speedup = _tps(d_on) / d_off_tps if d_off_tps > 0 else 0.0
            d_theo = None
            if d_acc.alpha is not None and d_acc.rounds:  # the domain's acceptance, the run's costs
                d_theo = theoretical_speedup(d_acc.alpha, max(1, round(d_acc.drafted / d_acc.rounds)), costs)["speedup"]
            by_domain[d] = {
                "prompts": len(ids), "off_tps": d_off_tps, "on_tps": _tps(d_on), "speedup": d_speedup,
                "theoretical": d_theo, "efficiency": d_speedup / d_theo if d_theo else None,
                "identical_share": equivalence(d_off, d_on)["share"] if greedy else None,
                "speedup_ci95": ratio_ci(*sums(ids), seed=seed + k), "acceptance_rate": d_acc.acceptance_rate,
                "alpha": d_acc.alpha, "tokens_per_target_call": d_acc.tokens_per_target_call,
                "mean_accepted_per_round": d_acc.mean_accepted_per_round, "per_position": d_acc.per_position,
            }
        by_prompt = {}
        for p in prompts:
            p_on, p_off = on_by_prompt[p.id], off_by_prompt[p.id]
            p_acc = acceptance(p_on)
            by_prompt[p.id] = {
                "domain": p.domain, "off_tps": _tps(p_off), "on_tps": _tps(p_on),
                "speedup": _tps(p_on) / _tps(p_off) if _tps(p_off) > 0 else 0.0,
                "acceptance_rate": p_acc.acceptance_rate, "mean_accepted_per_round": p_acc.mean_accepted_per_round,
                "tokens_per_target_call": p_acc.tokens_per_target_call,
            }
        res = ConfigResult(
            gamma=g, label=label, on=mode_stats(f"on[{label}]", on), acceptance=acc, speedup=speedup, speedup_ci95=ci,
            theoretical={**theo, "costs": costs}, efficiency=efficiency,
            draft_time_share=sum(r.draft_seconds for r in on) / total_on if total_on > 0 else 0.0,
            by_domain=by_domain, by_prompt=by_prompt,
        )
        if greedy:
            res.equivalence = equivalence(off, on)
        else:
            q = quality(gen, on, seed + 1 + k)
            q.update(quality_verdict(q, quality_off, seed + 101 + k))
            res.quality = q
        configs.append(res)
    costs_all = measured_costs(off, [r for r in runs if r.mode == "on"], proposer)
    return BenchReport(meta=meta, lengths=lengths, off=mode_stats("off", off), configs=configs,
                       memory=memory_estimate(gen, proposer), costs=costs_all, quality_off=quality_off,
                       caveats=caveats, runs=runs)


# --------------------------------------------------------------------------- plots


def write_plots(report: BenchReport, folder: str | os.PathLike) -> list[Path]:
    """latency_cdf.png, accepted_length.png, acceptance_by_position.png, speedup_by_domain.png."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError as exc:
        raise BenchError("--plot needs matplotlib: pip install 'specexport[plot]'") from exc
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    runs = report.runs
    groups = [("off", [r for r in runs if r.mode == "off"])] + [
        (f"on[{c.label}]", [r for r in runs if r.mode == "on" and r.gamma == c.gamma]) for c in report.configs]

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, rs in groups:
        lat = np.sort([x * 1e3 for r in rs for x in r.token_latencies()])
        if lat.size:
            ax.step(lat, np.arange(1, lat.size + 1) / lat.size, where="post", label=label)
    ax.set_xlabel("per-token latency (ms; tokens of one round share its gap)")
    ax.set_ylabel("fraction of tokens")
    ax.set_title(f"{report.meta['name']}: per-token latency CDF")
    ax.legend()
    ax.grid(alpha=0.3)
    written.append(_save(fig, folder / "latency_cdf.png", plt))

    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / max(1, len(report.configs))
    for j, c in enumerate(report.configs):
        hist = np.asarray(c.acceptance.accepted_histogram, dtype=float)
        if hist.sum():
            ax.bar(np.arange(hist.size) + j * width, hist / hist.sum(), width=width, label=f"on[{c.label}]")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("draft tokens accepted in a round")
    ax.set_ylabel("fraction of rounds")
    ax.set_title("accepted length per round")
    ax.legend()
    written.append(_save(fig, folder / "accepted_length.png", plt))

    fig, ax = plt.subplots(figsize=(6, 4))
    for c in report.configs:
        pos = c.acceptance.per_position
        if pos:
            ax.plot(np.arange(1, len(pos) + 1), pos, marker="o", label=f"on[{c.label}] accepted/drafted")
        cond = [np.nan if v is None else v for v in c.acceptance.per_position_conditional]
        if cond:
            ax.plot(np.arange(1, len(cond) + 1), cond, marker="x", linestyle="--", label=f"on[{c.label}] conditional")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance")
    ax.set_ylim(0, 1.05)
    ax.set_title("acceptance by draft position")
    ax.legend(fontsize=8)
    written.append(_save(fig, folder / "acceptance_by_position.png", plt))

    fig, ax = plt.subplots(figsize=(6, 4))
    domains = list(report.meta["domains"])
    for j, c in enumerate(report.configs):
        vals = [c.by_domain[d]["speedup"] for d in domains]
        err = [[max(0.0, v - (c.by_domain[d]["speedup_ci95"] or (v, v))[0]) for d, v in zip(domains, vals)],
               [max(0.0, (c.by_domain[d]["speedup_ci95"] or (v, v))[1] - v) for d, v in zip(domains, vals)]]
        ax.bar(np.arange(len(domains)) + j * width, vals, width=width, yerr=err, capsize=3, label=f"on[{c.label}]")
    ax.axhline(1.0, color="k", linewidth=0.8)
    ax.set_xticks(np.arange(len(domains)) + width * (len(report.configs) - 1) / 2, domains)
    ax.set_ylabel("speedup over off (95% CI)")
    ax.set_title("speedup by domain")
    ax.legend()
    written.append(_save(fig, folder / "speedup_by_domain.png", plt))
    return written


def _save(fig, path: Path, plt) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
