"""The suffix draft-limit tuner (suffix.LimitTuner): its replay of a probe round, the target's
verify cost line it is priced by (costs.VerifyCost), and its choice against a direct simulation
of fixed limits on synthetic copy-and-edit text."""

from __future__ import annotations

import numpy as np
import pytest

from specexport_runtime.costs import VerifyCost
from specexport_runtime.errors import InvalidArgument
from specexport_runtime.suffix import LimitTuner, SuffixConfig

SCALES = (0.5, 1.0, 2.0)


@pytest.mark.parametrize(
    "limit, match, drafted, accepted, open_end, want",
    [
        # one call when the limit covers the draft: its rows are the draft plus the target's token
        (lambda m: 99, 3, 10, 4, False, (1, 11)),
        (lambda m: 10, 3, 10, 10, True, (1, 11)),
        # limit 4, a chain that ended after 10 tokens, all accepted (11 tokens): 4+1, 4+1, then a plain step
        (lambda m: 4, 3, 10, 10, False, (3, 11)),
        # the same chain cut by the probe's limit (it goes on): the third round drafts 4, of which only
        # the target's token falls in the stretch: 1/5 of a call
        (lambda m: 4, 3, 10, 10, True, (2.2, 11)),
        # limit 4, 6 of 10 accepted (7 tokens): 4 drafted (5 emitted), 4 drafted (1 accepted + the correction)
        (lambda m: 4, 3, 10, 6, False, (2, 10)),
        # nothing accepted: one call drafting what the limit allows
        (lambda m: 4, 3, 10, 0, False, (1, 5)),
        (lambda m: 0, 3, 10, 0, False, (1, 1)),
        # the limit grows with the match: m = 2 -> 2 drafted (pos 3), m = 5 -> 5 (pos 9), m = 11 -> the 1 left (pos 11)
        (lambda m: m, 2, 10, 10, False, (3, 3 + 6 + 2)),
    ],
)
def test_replay_counts_calls_and_rows(limit, match, drafted, accepted, open_end, want):
    assert LimitTuner.replay(limit, match, drafted, accepted, open_end) == pytest.approx(want)


def test_line_recovers_the_cost_of_a_call_and_of_a_row():
    cost = VerifyCost()
    assert cost.line() is None  # nothing timed
    cost.record(5, 0.0115)
    assert cost.line() is None and cost.seconds(9) == 0.0115  # one size timed: no slope yet, flat
    for rows in (2, 9, 17, 3, 33):
        cost.record(rows, 0.004 + 0.0015 * rows)
    a, b = cost.line()
    assert a == pytest.approx(0.004) and b == pytest.approx(0.0015)
    assert cost.seconds(40) == pytest.approx(0.004 + 0.0015 * 40)
    assert cost.seconds(1) == pytest.approx(0.007)  # the line (0.0055) but never below the cheapest size timed


def segments(seed: int, n: int = 400) -> list[int]:
    """Copied tokens before each edit: many short runs right after edits, some long copies."""
    rng = np.random.default_rng(seed)
    return [int(x) for x in np.where(rng.random(n) < 0.4, rng.integers(0, 4, n), rng.integers(5, 80, n))]


def simulate(config: SuffixConfig, runs: list[int], a: float, b: float) -> float:
    """Tokens per second of a fixed limit on the synthetic text, played out directly: inside a
    run the match is 2 + the tokens emitted since the last edit; a draft of j tokens costs
    a + b (j + 1) and keeps what the run still copies, then the target adds one token."""
    tokens = seconds = 0.0
    for copied in runs:
        pos = 0
        while pos <= copied:  # the run's copied tokens, then the edit (the target's own token)
            j = config.limit(min(2 + pos, config.max_depth))
            got = min(j, copied - pos) + 1
            tokens, seconds, pos = tokens + got, seconds + a + b * (j + 1), pos + got
    return tokens / seconds


def drive(
    tuner: LimitTuner, cost: VerifyCost, configs: dict[float, SuffixConfig], runs: list[int], a: float, b: float
) -> list[float]:
    """The proposer's and the loop's side of the protocol on the same text: choose, draft, time
    the verify call into the cost, record."""
    chosen = []
    for copied in runs:
        pos = 0
        while pos <= copied:
            scale = tuner.choose(SCALES, cost.line())
            match = min(2 + pos, configs[scale].max_depth)
            j = configs[scale].limit(match)
            accepted = min(j, copied - pos)
            cost.record(j + 1, a + b * (j + 1))
            tuner.record(scale, j, accepted, match, configs)
            chosen.append(scale)
            pos += accepted + 1
    return chosen


@pytest.mark.parametrize("seed", [0, 1])
def test_choice_follows_the_cost_of_a_row(seed):
    """Cheap rows (fp32 on a CPU: ~5% of a call) and dear rows (int4: ~30%): the tuner settles on
    the scale that a direct simulation of each fixed limit finds fastest, and the two differ."""
    configs = {x: SuffixConfig().scaled(x) for x in SCALES}
    runs = segments(seed)
    picks = {}
    for a, b in ((1.0, 0.05), (1.0, 0.3)):
        truth = {x: simulate(configs[x], runs, a, b) for x in SCALES}
        tuner, cost = LimitTuner(), VerifyCost()
        chosen = drive(tuner, cost, configs, runs, a, b)
        best = max(truth, key=truth.get)
        assert tuner.best(SCALES, cost.line()) == best, (a, b, truth, tuner.describe(cost.line()))
        late = chosen[len(chosen) // 2 :]
        assert late.count(best) >= 0.8 * len(late)  # it drafts with it, probes aside
        picks[b] = best
    assert picks[0.05] > picks[0.3]  # longer drafts where rows are cheap


@pytest.mark.parametrize(
    "row_cost, probe_every", [(0.01, 4 * LimitTuner.PROBE_EVERY), (0.00001, LimitTuner.PROBE_EVERY)]
)
def test_probes_warm_up_then_one_in_probe_every(row_cost, probe_every):
    """Every draft is rejected, so shorter drafts are cheaper: after the warm-up (all at the
    largest scale) the smallest scale drafts, except the probes, which come every PROBE_EVERY-th
    round while the largest scale is within 5% of the best, four times rarer when it is slower."""
    t, cost = LimitTuner(), VerifyCost()
    configs = {x: SuffixConfig().scaled(x) for x in SCALES}
    picks = []
    for _ in range(LimitTuner.WARMUP + 8 * LimitTuner.PROBE_EVERY):
        x = t.choose(SCALES, cost.line())
        picks.append(x)
        j = configs[x].limit(2)
        cost.record(j + 1, 0.001 + row_cost * (j + 1))
        t.record(x, j, 0, 2, configs)
    assert picks[: LimitTuner.WARMUP] == [2.0] * LimitTuner.WARMUP
    rest = picks[LimitTuner.WARMUP :]
    probes = [i + LimitTuner.WARMUP + 1 for i, x in enumerate(rest) if x == 2.0]
    assert probes and all(n % probe_every == 0 for n in probes) and len(probes) == len(rest) // probe_every
    assert set(rest) == {0.5, 2.0}
    assert t.choose((1.0,), cost.line()) == 1.0  # one scale: nothing to choose


def test_scaled_config_and_bad_scales():
    c = SuffixConfig(factor=1.5, max_spec=16, offset=1.0)
    d = c.scaled(2.0)
    assert (d.factor, d.max_spec, d.offset, d.limit_scales) == (3.0, 32, 2.0, (1.0,))
    assert c.scaled(0.5).max_spec == 8 and SuffixConfig(max_spec=200).scaled(2.0).max_spec == 256
    assert SuffixConfig.fixed_limit() is None  # nothing given: the generator keeps its tuned default
    f = SuffixConfig.fixed_limit(max_spec=3)
    assert (f.factor, f.max_spec, f.limit_scales) == (1.0, 3, (1.0,))
    for bad in ((), (1.0, 1.0), (0.0,), (1.0, 9.0), [1.0, 2.0], (True,)):
        with pytest.raises(InvalidArgument, match="limit_scales"):
            SuffixConfig(limit_scales=bad)


def test_the_loop_feeds_the_tuner_and_stays_exact(gens):
    """With the default config the generator's tuner sees every verified suffix round (probes
    replayed), priced by the verify cost the loop times into the generator (one sample per target
    call), and greedy output is the target's whatever scale it picks."""
    gen = gens("ngram")
    gen.forget_history()
    gen.learned("suffix").tuner = LimitTuner()
    gen.verify_cost.by_rows.clear()
    gen.verify_cost.counts.clear()
    prompt = "a b c d e f g a b c d e f g a b c"
    base = gen.generate(prompt, max_new_tokens=150, speculative=False)
    timed = sum(gen.verify_cost.counts.values())
    assert timed == base.stats.plain_steps  # target-only: every plain step timed (rows 1)
    out = gen.generate(prompt, max_new_tokens=150, proposer="suffix", gamma=8)
    assert out.token_ids == base.token_ids
    t = gen.learned("suffix").tuner
    assert sum(gen.verify_cost.counts.values()) - timed == out.stats.rounds + out.stats.plain_steps
    assert t.probes >= 1 and set(t.calls) == set(SCALES) and gen.verify_cost.line() is not None
    assert set(t.describe(gen.verify_cost.line())["tokens_per_second"]) == {"0.5", "1.0", "2.0"}
    gen.forget_history()
