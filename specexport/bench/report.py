"""The data of a `specexport bench` run and how it is written: one RunRecord per generation,
the aggregated BenchReport (ModeStats, Acceptance, ConfigResult) and its text, Markdown and
JSON forms. The statistics are computed in bench_stats, the runs made in bench."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from specexport_runtime import registry
from specexport_runtime.errors import SpecExportError
from specexport_runtime.generator import GenerationStats


class BenchError(SpecExportError, ValueError):
    """Invalid benchmark arguments (no prompts, bad gamma, ...)."""


def gamma_label(gamma: int | None) -> str:
    return "adaptive" if gamma is None else str(gamma)


def _stat(name: str) -> property:
    """A read-only view of the run's stats.<name> (GenerationStats documents each)."""
    return property(lambda self: getattr(self.stats, name), doc=f"stats.{name}")


@dataclass
class RunRecord:
    """One generation: speculation off, or on with one gamma (None = adaptive). `stats` is the
    generation's own GenerationStats; target_calls / draft_calls: S -> [calls, seconds] of the
    ONNX Runtime calls it made (prefill excluded for the target)."""

    prompt_id: str
    domain: str
    mode: str  # "off" | "on"
    gamma: int | None
    repeat: int
    seed: int | None
    finish_reason: str
    token_ids: list[int]
    prompt_ids: list[int] = field(repr=False)
    stats: GenerationStats = field(repr=False)
    target_calls: dict[int, list]
    draft_calls: dict[int, list]

    prompt_tokens = _stat("prompt_tokens")
    new_tokens = _stat("new_tokens")
    total_seconds = _stat("total_seconds")
    prefill_seconds = _stat("prefill_seconds")
    draft_seconds = _stat("draft_seconds")
    target_seconds = _stat("target_seconds")
    rounds = _stat("rounds")
    plain_steps = _stat("plain_steps")
    drafted = _stat("drafted")
    accepted = _stat("accepted")
    corrections = _stat("corrections")
    bonus = _stat("bonus")
    lookup_rounds = _stat("lookup_rounds")  # rounds drafted without a model call (lookup or suffix retrieval)
    drafted_at = _stat("drafted_at")
    accepted_at = _stat("accepted_at")
    round_sizes = _stat("round_sizes")  # (drafted k, accepted n) per speculative round
    token_times = _stat("token_times")
    by_source = _stat("by_source")  # source -> [rounds, drafted, accepted]
    tokens_per_second = _stat("tokens_per_second")  # decode tokens / decode seconds

    @property
    def label(self) -> str:
        return "off" if self.mode == "off" else gamma_label(self.gamma)

    @property
    def decode_tokens(self) -> int:
        return max(0, self.new_tokens - 1)

    @property
    def decode_seconds(self) -> float:
        return max(0.0, self.total_seconds - self.prefill_seconds)

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
            "prompt_id": self.prompt_id,
            "domain": self.domain,
            "mode": self.mode,
            "gamma": self.gamma,
            "repeat": self.repeat,
            "seed": self.seed,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "finish_reason": self.finish_reason,
            "total_seconds": self.total_seconds,
            "prefill_seconds": self.prefill_seconds,
            "draft_seconds": self.draft_seconds,
            "target_seconds": self.target_seconds,
            "tokens_per_second": self.tokens_per_second,
            "rounds": self.rounds,
            "plain_steps": self.plain_steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "corrections": self.corrections,
            "bonus": self.bonus,
            "lookup_rounds": self.lookup_rounds,
            "by_source": self.by_source,
        }


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
    lookup_rounds: int = (
        0  # rounds drafted without a model call: prompt lookup or suffix retrieval (the rest: draft model)
    )
    # per proposal source (draft, eagle, lookup, suffix-request, suffix-store): rounds, drafted,
    # accepted, acceptance rate and tokens per round (accepted + the target's own token)
    by_source: dict[str, dict] = field(default_factory=dict)


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
    exactness: dict | None = None  # the target's exactness class and rows measurement (bench.target_exactness)
    runs: list[RunRecord] = field(default_factory=list, repr=False)
    constrained: dict | None = None  # --constrained: per configuration, valid answers and forced tokens

    def config(self, gamma: int | None) -> ConfigResult:
        for c in self.configs:
            if c.gamma == gamma:
                return c
        raise KeyError(gamma)

    def to_dict(self, include_runs: bool = True) -> dict:
        data = {
            "meta": self.meta,
            "lengths": self.lengths,
            "off": asdict(self.off),
            "configs": [asdict(c) for c in self.configs],
            "memory": self.memory,
            "costs": self.costs,
            "quality_off": self.quality_off,
            "caveats": list(self.caveats),
            "exactness": self.exactness,
            "constrained": self.constrained,
        }
        if include_runs:
            data["runs"] = [r.summary() for r in self.runs]
        return _jsonable(data)

    # ----------------------------------------------------------------------- text

    def summary_lines(self) -> list[str]:
        m, L = self.meta, self.lengths
        t = m["target"]
        lines = [f"specexport bench: {m['name']}  ({m['artifact']})"]
        lines.append(
            f"  target      {t['source']}  {t['precision']}, {t['bytes'] / 1e6:.1f} MB, max_context {m['max_context']}"
        )
        spec = registry.PROPOSERS.get(m["proposer"])
        if m["proposer"] == "draft" and m.get("draft"):
            d = m["draft"]
            prop = f"draft model {d['precision']}, {d['bytes'] / 1e6:.1f} MB ({d['source']})"
        else:
            label = m.get("proposer_label") or (spec.label if spec is not None else None)
            prop = m["proposer"] + (f" ({label})" if label else "")
            if m["proposer"] == "ngram":
                prop += f", n-gram sizes {m.get('ngram_sizes')}"
            if m["proposer"] == "hybrid":
                prop += f"; retrieval: {'suffix then ' if m.get('hybrid_retrieval') == 'suffix' else ''}lookup"
            hybrid_suffix = m["proposer"] == "hybrid" and m.get("hybrid_retrieval") == "suffix"
            uses_suffix = m["proposer"] == "suffix" or hybrid_suffix
            if uses_suffix and m.get("suffix"):  # reports from before the field have none
                sx = m["suffix"]
                prop += f"; suffix drafts up to min({sx['max_spec']}, {sx['factor']:g} x match)"
                if len(sx.get("limit_scales", [1.0])) > 1:
                    speed = sx.get("tuner", {}).get("tokens_per_second", {})
                    prop += f" scaled x{' / x'.join(f'{x:g}' for x in sx['limit_scales'])}, the fastest measured" + (
                        f" ({', '.join(f'x{float(k):g} {v:g}' for k, v in speed.items())} tok/s)" if speed else ""
                    )
        lines.append(f"  proposer    {prop}")
        lines.append(f"  gamma       {', '.join(gamma_label(g) for g in m['gammas'])}")
        s = m["sampling"]
        samp = (
            "greedy"
            if s["temperature"] == 0
            else (f"temperature {s['temperature']}, top_p {s['top_p']}, top_k {s['top_k']}, seed {s['seed']}")
        )
        lines.append(f"  sampling    {samp}")
        doms = ", ".join(f"{d} {n}" for d, n in m["domains"].items())
        lines.append(
            f"  prompts     {m['prompts']} ({doms}); repeats {m['repeats']}; threads {m['threads'] or 'default'}"
        )
        cpu = m.get("machine", {}).get("cpu")  # reports from before the field have none
        if cpu:
            lines.append(f"  machine     {cpu}, {m['machine'].get('cpu_count')} cores")
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
                + (f", {a.lookup_rounds} by retrieval" if a.lookup_rounds else "")
                + f"); by position {pos or 'n/a'}"
            )
            if len(a.by_source) > 1:
                src = ", ".join(
                    f"{s} {v['rounds']} rounds acc {_f(v['acceptance_rate'])} {v['tokens_per_round']:.2f} tok/round"
                    for s, v in a.by_source.items()
                )
                lines.append(" " * 14 + f"by source: {src}")
            if c.by_domain:
                dom = ", ".join(
                    f"{d} {v['speedup']:.2f}x acc {_f(v['acceptance_rate'])} eff {_f(v['efficiency'], '.0%')}"
                    + (
                        f" (first third {v['first_third_speedup']:.2f}x, last third {v['last_third_speedup']:.2f}x)"
                        if "first_third_speedup" in v
                        else ""
                    )
                    for d, v in c.by_domain.items()
                )
                lines.append(" " * 14 + f"by domain: {dom}")
            lines.append(" " * 14 + f"draft overhead: {c.draft_time_share:.0%} of on time")
            if c.equivalence is not None:
                e = c.equivalence
                div = ""
                if e["divergences"]:
                    first = e["divergences"][0]
                    div = f"; first divergence {first['prompt_id']} at token {first['position']}"
                lines.append(
                    " " * 14 + f"equivalence (greedy): {e['identical_prompts']}/{e['prompts']} prompts identical "
                    f"({e['share']:.0%}){div}; {exactness_text(self.exactness)}"
                )
            if c.quality is not None:
                lines.append(" " * 14 + "quality: " + _quality_line(c.quality))
        if self.constrained:
            from .constrained import lines as constrained_lines

            lines += constrained_lines(self.constrained)
        mem = self.memory
        if mem.get("draft_bytes"):
            lines.append(
                f"  memory      draft {mem['draft_bytes'] / 1e6:.1f} MB of {mem['total_bytes'] / 1e6:.1f} MB "
                f"({mem['draft_share']:.0%}; static: graph files + KV buffers at max_context)"
            )
        else:
            lines.append("  memory      no draft model (retrieval drafts: no extra model memory)")
        if self.quality_off is not None:
            lines.append("  quality off " + _quality_line(self.quality_off))
        for cav in self.caveats:
            lines.append(f"  caveat      {cav}")
        return lines

    def to_markdown(self) -> str:
        m = self.meta
        out = [f"# specexport bench: {m['name']}", "", "```", *self.summary_lines(), "```", ""]
        out += [
            "| config | tok/s | speedup (95% CI) | theoretical | efficiency | acceptance | alpha | tokens/call |"
            " e2e p50/p90/p99 s | per-token p50/p90/p99 ms | draft time |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        o = self.off
        out.append(
            f"| off | {o.tokens_per_second:.1f} | 1.00 | | | | | 1.00 | {_pcts(o.e2e_seconds, 1)} | "
            f"{_pcts(o.token_latency_seconds, 1e3)} | |"
        )
        for c in self.configs:
            ci = f" ({c.speedup_ci95[0]:.2f}-{c.speedup_ci95[1]:.2f})" if c.speedup_ci95 else ""
            th = c.theoretical.get("speedup")
            out.append(
                f"| on[{c.label}] | {c.on.tokens_per_second:.1f} | {c.speedup:.2f}{ci} | {th:.2f} | "
                f"{(c.efficiency or 0):.0%} | {_f(c.acceptance.acceptance_rate)} | {_f(c.acceptance.alpha)} | "
                f"{c.acceptance.tokens_per_target_call:.2f} | {_pcts(c.on.e2e_seconds, 1)} | "
                f"{_pcts(c.on.token_latency_seconds, 1e3)} | {c.draft_time_share:.0%} |"
                if th is not None
                else f"| on[{c.label}] | {c.on.tokens_per_second:.1f} | {c.speedup:.2f}{ci} | n/a | n/a | "
                f"{_f(c.acceptance.acceptance_rate)} | {_f(c.acceptance.alpha)} | "
                f"{c.acceptance.tokens_per_target_call:.2f} | "
                f"{_pcts(c.on.e2e_seconds, 1)} | {_pcts(c.on.token_latency_seconds, 1e3)} | {c.draft_time_share:.0%} |"
            )
        for c in self.configs:
            if not c.by_domain:
                continue
            out += [
                "",
                f"## by domain, on[{c.label}]",
                "",
                "| domain | prompts | speedup (95% CI) | acceptance | tokens/call | efficiency | identical |",
                "|---|---|---|---|---|---|---|",
            ]
            for d, v in c.by_domain.items():
                ci = f" ({v['speedup_ci95'][0]:.2f}-{v['speedup_ci95'][1]:.2f})" if v.get("speedup_ci95") else ""
                out.append(
                    f"| {d} | {v['prompts']} | {v['speedup']:.2f}{ci} | {_f(v['acceptance_rate'])} | "
                    f"{v['tokens_per_target_call']:.2f} | {_f(v['efficiency'], '.0%')} | "
                    f"{_f(v['identical_share'], '.0%')} |"
                )
        return "\n".join(out) + "\n"


def exactness_text(exactness: dict | None) -> str:
    """'target exactness bitwise (...)' / 'numerical (...)' / 'not measured' (manifest target.exactness)."""
    cls = (exactness or {}).get("class")
    rows = (exactness or {}).get("rows") or {}
    if cls is None:
        return "target exactness not measured"
    if cls == "bitwise":
        how = rows.get("padding") or f"min_rows {exactness.get('min_rows')}"
        return f"target exactness bitwise (rows do not depend on call size; {how})"
    if rows.get("max_abs_diff") is None:
        return f"target exactness {cls}"
    agree = rows.get("argmax_agreement")
    agree_text = "n/a" if agree is None else "100%" if agree >= 1 else f"{math.floor(agree * 1000) / 10:.1f}%"
    return (
        f"target exactness {cls} (rows differ between call sizes by up to {rows['max_abs_diff']:.2g}, "
        f"argmax agreement {agree_text})"
    )


def _f(x: float | None, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def _pcts(p: dict, scale: float) -> str:
    if p.get("p50") is None:
        return "n/a"
    return f"{p['p50'] * scale:.2f}/{p['p90'] * scale:.2f}/{p['p99'] * scale:.2f}"


def _mode_line(m: ModeStats) -> str:
    return (
        f"{m.tokens_per_second:.1f} tok/s; e2e p50/p90/p99 {_pcts(m.e2e_seconds, 1)} s; "
        f"per-token p50/p90/p99 {_pcts(m.token_latency_seconds, 1e3)} ms"
    )


def _quality_line(q: dict) -> str:
    def fmt(key: str, spec: str) -> str:
        v = q[key]
        if v["mean"] is None:
            return f"{key} n/a"
        ci = f" [{v['ci95'][0]:{spec}}, {v['ci95'][1]:{spec}}]" if v.get("ci95") else ""
        return f"{key} {v['mean']:{spec}}{ci}"

    return ", ".join([fmt("loglik_per_token", ".3f"), fmt("output_tokens", ".1f"), fmt("distinct_2", ".3f")]) + (
        f"; {q['verdict']}" if q.get("verdict") else ""
    )


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
