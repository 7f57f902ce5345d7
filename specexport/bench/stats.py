"""Statistics of `specexport bench` runs: percentiles, bootstrap intervals, acceptance,
measured call costs, the theoretical speedup, greedy equivalence and sampling quality
(definitions in the module docstring of bench and in docs/benchmarking.md)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from specexport_runtime import registry
from specexport_runtime.constants import MAX_GAMMA

from .harness import BOOTSTRAP_SAMPLES, bootstrap_ci, percentiles, ratio_ci  # noqa: F401  (bench imports ratio_ci from here)
from .report import Acceptance, ModeStats, RunRecord


def tps(runs: Sequence[RunRecord]) -> float:
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


def mode_stats(label: str, runs: Sequence[RunRecord]) -> ModeStats:
    lat = [x for r in runs for x in r.token_latencies()]
    ttft = [r.token_times[0] for r in runs if r.token_times]
    return ModeStats(
        label=label,
        runs=len(runs),
        tokens_per_second=tps(runs),
        new_tokens_mean=float(np.mean([r.new_tokens for r in runs])) if runs else 0.0,
        e2e_seconds=percentiles(r.total_seconds for r in runs),
        token_latency_seconds=percentiles(lat),
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
        rounds=rounds,
        plain_steps=plain,
        drafted=drafted,
        accepted=accepted,
        corrections=corrections,
        bonus=sum(r.bonus for r in runs),
        acceptance_rate=accepted / drafted if drafted else None,
        alpha=accepted / (accepted + corrections) if drafted else None,
        mean_accepted_per_round=accepted / rounds if rounds else None,
        tokens_per_target_call=(accepted + calls) / calls if calls else 0.0,
        per_position=[a / d if d else 0.0 for a, d in zip(a_at, d_at)],
        per_position_conditional=cond,
        accepted_histogram=hist,
        lookup_rounds=sum(r.lookup_rounds for r in runs),
        by_source=source_totals(runs),
    )


def source_totals(runs: Sequence[RunRecord]) -> dict[str, dict]:
    """Rounds, drafted, accepted, acceptance rate and tokens per round of each proposal source."""
    totals: dict[str, list[int]] = {}
    for r in runs:
        for source, (rounds, drafted, accepted) in r.by_source.items():
            t = totals.setdefault(source, [0, 0, 0])
            t[0], t[1], t[2] = t[0] + rounds, t[1] + drafted, t[2] + accepted
    return {
        s: {
            "rounds": n,
            "drafted": d,
            "accepted": a,
            "acceptance_rate": a / d if d else None,
            "tokens_per_round": (a + n) / n if n else 0.0,
        }
        for s, (n, d, a) in sorted(totals.items())
    }


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
    # verify calls: S = k + 1
    out["target_s"] = {s: sec / n for s, (n, sec) in sorted(t_on.items()) if 1 < s <= MAX_GAMMA + 1}
    if registry.get(proposer).calibrate == registry.MODEL_STEP:  # a draft model's 1-token calls
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
            pos = next(
                (i for i, (a, b) in enumerate(zip(base, r.token_ids)) if a != b), min(len(base), len(r.token_ids))
            )
            divergences.append(
                {
                    "prompt_id": r.prompt_id,
                    "repeat": r.repeat,
                    "position": pos,
                    "off_tokens": len(base),
                    "on_tokens": len(r.token_ids),
                }
            )
    n = len(per_prompt)
    identical = sum(per_prompt.values())
    return {
        "prompts": n,
        "identical_prompts": identical,
        "share": identical / n if n else 0.0,
        "divergences": divergences,
    }


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
    return {
        "differences": diffs,
        "verdict": "on and off agree (every 95% CI of the difference contains 0)"
        if ok
        else "a 95% CI of the on-off difference excludes 0 (expected about 1 time in 20 per metric by chance)",
    }
