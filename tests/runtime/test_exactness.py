"""Greedy exactness of speculative decoding on the tiny artifacts: speculative output ==
target-only output, token for token, for every proposer and gamma (hybrid rounds from both
sources, a draft that stops early, proposer overrides, the context limit, controller options),
with the bookkeeping of every run checked (counting invariants, per-position acceptance).

The sampling law is checked in test_sampling_law.py, the KV cursor rule and rollback under
random accept/reject patterns in test_rollback.py; shared helpers are in exactness_support.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from exactness_support import (
    ADAPTIVE_GAMMA_MAX,
    PROMPT_IDS,
    PROMPTS,
    fixture_gens,  # noqa: F401 (this module's `gens` fixture)
)

from specexport_runtime.errors import InvalidArgument
from specexport_runtime.proposers import NgramLookupProposer
from specexport_runtime.sampling import SamplingParams

KINDS = ("self", "noisy", "ngram", "int8", "noisy-fused", "int8-fused")  # -fused: head_major_inplace graphs
GAMMAS = (1, 2, 4, 8, None)  # None = adaptive
MAX_NEW = 100  # prompts below are < 60 tokens: prompt + 100 + 8 stays under max_context 256


def prompt_ids(gen, prompt) -> list[int]:
    return gen.codec.encode(prompt) if isinstance(prompt, str) else list(prompt)


# ------------------------------------------------------------------ counting invariants


def check_counts(
    gen, result, prompt_len: int, gamma: int | None, proposer: str, calls_before: dict, max_new: int
) -> None:
    """Bookkeeping identities of one generation (stats of GenerationStats + model call counters).

    The prefill emits one token; every speculative round emits accepted + 1 tokens (the +1 is
    a correction or a bonus) and every plain step one token, so before truncation by
    max_new_tokens the number of emitted tokens is 1 + accepted + corrections + bonus + plain_steps.
    """
    s = result.stats
    produced = 1 + s.accepted + s.corrections + s.bonus + s.plain_steps
    assert s.rounds == s.corrections + s.bonus
    assert s.new_tokens == len(result.token_ids)
    assert s.prompt_tokens == prompt_len
    assert 0 <= s.accepted <= s.drafted
    # truncation only ever cuts the last round, which emitted at most gamma + 1 tokens
    excess = produced - s.new_tokens
    bound = gamma if gamma is not None else ADAPTIVE_GAMMA_MAX
    assert 0 <= excess <= bound, (produced, s.new_tokens, bound)
    if result.finish_reason == "length":
        assert s.new_tokens == max_new
    # one target call per round or plain step (plus the prefill); it is fed each token once:
    # the prompt (less its prefix from the prefix pool), then [last, d1..dk] per round and [last] per plain step
    fed = prompt_len - s.cached_tokens + s.rounds + s.drafted + s.plain_steps
    assert gen.target.stats.calls - calls_before["target_calls"] == 1 + s.rounds + s.plain_steps
    assert gen.target.stats.tokens - calls_before["target_tokens"] == fed
    if proposer == "draft":
        # the draft model runs once per drafted token; a backlog (the prompt, or tokens of plain
        # steps: at most one backlog per run of plain steps, plus the start) costs one extra call
        catchups = gen.draft.stats.calls - calls_before["draft_calls"] - s.drafted
        assert 0 <= catchups <= 1 + s.plain_steps
    # per-position acceptance
    assert len(s.drafted_at) == len(s.accepted_at)
    assert sum(s.drafted_at) == s.drafted and sum(s.accepted_at) == s.accepted
    if s.rounds:
        assert s.drafted_at[0] == s.rounds  # a round drafts at least one token
    for i in range(len(s.drafted_at)):
        assert 0 <= s.accepted_at[i] <= s.drafted_at[i]
        if i:
            assert s.drafted_at[i] <= s.drafted_at[i - 1]
            assert s.accepted_at[i] <= s.accepted_at[i - 1]  # accepting i needs accepting i-1
    assert s.per_position_acceptance == pytest.approx([a / d for a, d in zip(s.accepted_at, s.drafted_at)])
    if s.drafted:
        assert s.acceptance_rate == pytest.approx(s.accepted / s.drafted)
    calls = s.rounds + s.plain_steps
    if calls:
        assert s.mean_accepted_length == pytest.approx((s.accepted + calls) / calls)
    if proposer == "draft" and gamma is not None:
        # a draft model always drafts exactly gamma tokens (room never binds here): every
        # position is drafted once per round, and a round is a bonus round iff its last
        # position was accepted
        assert s.drafted_at == [s.rounds] * gamma if s.rounds else s.drafted_at == []
        assert s.drafted == gamma * s.rounds
        if s.rounds:
            assert s.bonus == s.accepted_at[gamma - 1]
            assert s.corrections == s.rounds - s.accepted_at[gamma - 1]
        assert s.plain_steps == 0


def counters(gen) -> dict:
    out = {"target_calls": gen.target.stats.calls, "target_tokens": gen.target.stats.tokens}
    if gen.draft is not None:
        out["draft_calls"] = gen.draft.stats.calls
    return out


# ------------------------------------------------------------------ greedy exactness


@pytest.mark.parametrize("kind", ["noisy", "int8-fused"])
@pytest.mark.parametrize("prompt", PROMPTS, ids=PROMPT_IDS)
def test_hybrid_is_exact_and_uses_both_sources(gens, kind, prompt):
    """proposer='hybrid': lookup rounds where the last 3 tokens repeat, draft rounds elsewhere;
    greedy output equals target-only for fixed and adaptive gamma. The draft model is called
    once per token it drafted plus catch-ups (the prompt, and the tokens of lookup rounds or
    plain steps since it last drafted); lookup rounds never feed the adaptive controller."""
    gen = gens(kind)
    base = gen.generate(prompt, max_new_tokens=MAX_NEW, speculative=False)
    for gamma in (2, 5, None):
        before = counters(gen)
        result = gen.generate(prompt, max_new_tokens=MAX_NEW, proposer="hybrid", gamma=gamma)
        assert result.token_ids == base.token_ids, f"{kind} gamma={gamma}: hybrid output differs"
        # lookup rounds propose up to the lookup maximum (8), whatever gamma: the bound of the adaptive case
        check_counts(gen, result, len(prompt_ids(gen, prompt)), None, "hybrid", before, MAX_NEW)
        st = result.stats
        draft_rounds = st.rounds - st.lookup_rounds
        assert 0 <= st.lookup_rounds <= st.rounds
        # a draft round calls the draft model at least once per drafted token, a lookup round never
        assert gen.draft.stats.calls - before["draft_calls"] >= draft_rounds
        if draft_rounds == 0:
            assert gen.draft.stats.calls == before["draft_calls"]


def test_hybrid_round_sources(gens):
    """Which source serves a round: lookup exactly when the history's last 3 tokens occurred
    before (the n-gram index's own answer), the draft model otherwise."""
    from specexport_runtime.hybrid import HybridProposer

    gen = gens("noisy")
    prop = gen.build_proposer("hybrid", gen.config)
    assert isinstance(prop, HybridProposer) and prop.retrievers[-1].min_match == 3
    params = SamplingParams()
    rng = np.random.default_rng(0)
    history = [40, 41, 42, 43, 44, 40, 41, 42]  # suffix 40 41 42 occurred before, followed by 43 44 40
    prop.start(history)
    gen.target.reset()
    out = prop.propose(history, 3, params, rng)
    # up to the lookup's maximum (8) whatever gamma: all that followed the earlier occurrence
    assert out.free and out.tokens == [43, 44, 40, 41, 42] and out.q is None
    assert prop.propose(history, 0, params, rng).tokens == [43, 44, 40, 41, 42]  # also when the draft is off
    fresh = [7, 150, 33, 299, 12]  # nothing repeats: the draft model drafts
    prop.start(fresh)
    before = gen.draft.stats.calls
    out = prop.propose(fresh, 3, params, rng)
    # one catch-up call over the prompt backlog (fresh[:-1]), then one call per drafted token
    assert not out.free and len(out.tokens) == 3 and gen.draft.stats.calls - before == 1 + 3
    with pytest.raises(InvalidArgument, match="min_match"):
        NgramLookupProposer((3, 2, 1), min_match=4)


def test_rounds_are_counted_per_source(gens):
    """GenerationStats.by_source: each round under the source that drafted it (hybrid: lookup
    and draft both appear on a text that repeats in parts), summing to the run's totals."""
    gen = gens("noisy")
    # n-gram lookup (suffix: test_suffix.py)
    result = gen.generate(PROMPTS[2], max_new_tokens=MAX_NEW, proposer="hybrid", gamma=3, hybrid_retrieval="lookup")
    st = result.stats
    assert set(st.by_source) == {"lookup", "draft"}
    assert st.by_source["lookup"][0] == st.lookup_rounds
    assert [sum(v[i] for v in st.by_source.values()) for i in range(3)] == [st.rounds, st.drafted, st.accepted]
    assert set(gen.generate(PROMPTS[0], max_new_tokens=20, proposer="draft", gamma=3).stats.by_source) == {"draft"}


def test_hybrid_needs_a_draft_model(gens):
    with pytest.raises(InvalidArgument, match="'hybrid' needs an artifact with a draft model"):
        gens("ngram").generate([5, 6, 7], proposer="hybrid", max_new_tokens=4)


def test_unknown_proposer_is_named_with_the_allowed_ones(gens):
    names = "'draft', 'ngram', 'hybrid', 'eagle', 'dflash', 'suffix', 'assistant', 'mtp', 'none'"
    with pytest.raises(InvalidArgument, match=f"'medusa' is not one of {names}"):
        gens("int8").generate([5, 6, 7], proposer="medusa", max_new_tokens=4)
    assert gens("int8").resolve_proposer(None) == gens("int8").default_proposer
    with pytest.raises(InvalidArgument, match="'eagle' needs an artifact with an EAGLE-3 draft head"):
        gens("int8").generate([5, 6, 7], proposer="eagle", max_new_tokens=4)


@pytest.mark.parametrize("prompt", PROMPTS, ids=PROMPT_IDS)
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_speculative_equals_target_only(gens, kind, prompt):
    gen = gens(kind)
    ids = prompt_ids(gen, prompt)
    assert len(ids) + MAX_NEW + ADAPTIVE_GAMMA_MAX < gen.manifest.max_context
    before = counters(gen)
    base = gen.generate(prompt, max_new_tokens=MAX_NEW, speculative=False)
    s = base.stats
    assert (s.rounds, s.drafted, s.plain_steps) == (0, 0, len(base.token_ids) - 1)
    assert gen.target.stats.calls - before["target_calls"] == len(base.token_ids)
    proposer = gen.default_proposer
    assert proposer == ("ngram" if kind == "ngram" else "draft")
    drafted = 0
    for gamma in GAMMAS:
        before = counters(gen)
        result = gen.generate(prompt, max_new_tokens=MAX_NEW, gamma=gamma)
        assert result.token_ids == base.token_ids, f"{kind} gamma={gamma}: speculative output differs"
        assert result.text == base.text
        assert result.finish_reason == base.finish_reason
        check_counts(gen, result, len(ids), gamma, proposer, before, MAX_NEW)
        st = result.stats
        drafted += st.drafted
        if kind == "self":  # draft == target: every drafted token is accepted
            assert st.accepted == st.drafted and st.corrections == 0
            if gamma is not None:
                assert st.drafted > 0 and st.bonus == st.rounds
        if kind == "noisy" and gamma is not None:
            assert st.corrections > 0 and st.accepted > 0, (gamma, st.corrections, st.accepted)
    if prompt in (PROMPTS[2], PROMPTS[3]):
        assert drafted > 0, "the n-gram proposer never proposed on a repetitive prompt"


def test_noisy_mixes_accepts_and_corrections_at_every_position(gens):
    """Over a longer run, the perturbed draft has both outcomes at the first positions."""
    gen = gens("noisy")
    result = gen.generate(PROMPTS[1], max_new_tokens=150, gamma=2)
    s = result.stats
    assert 0 < s.accepted_at[0] < s.drafted_at[0]
    assert s.corrections > 0 and s.bonus > 0


@pytest.mark.parametrize("min_draft_prob", [0.3, 0.7])
def test_min_draft_prob_stays_exact(gens, min_draft_prob):
    """A draft that stops early on low confidence drafts variable lengths, still exactly."""
    gen = gens("noisy")
    prompt = PROMPTS[1]
    ids = prompt_ids(gen, prompt)
    base = gen.generate(prompt, max_new_tokens=MAX_NEW, speculative=False)
    for gamma in (6, None):
        before = counters(gen)
        result = gen.generate(prompt, max_new_tokens=MAX_NEW, gamma=gamma, min_draft_prob=min_draft_prob)
        assert result.token_ids == base.token_ids
        s = result.stats
        check_counts(gen, result, len(ids), gamma, "draft-early-stop", before, MAX_NEW)
        catchups = gen.draft.stats.calls - before["draft_calls"] - s.drafted  # still one call per token
        assert 0 <= catchups <= 1 + s.plain_steps
        if gamma is not None:
            assert s.drafted < gamma * s.rounds, "no round stopped early"
            assert s.drafted_at[0] == s.rounds


def test_ngram_is_exact_under_proposer_override(gens):
    """proposer='ngram' on a draft artifact is exact too (and 'none' is the baseline)."""
    gen = gens("noisy")
    prompt = PROMPTS[3]
    base = gen.generate(prompt, max_new_tokens=80, proposer="none")
    plain = gen.generate(prompt, max_new_tokens=80, speculative=False)
    assert base.token_ids == plain.token_ids
    for gamma in (3, None):
        before = counters(gen)
        result = gen.generate(prompt, max_new_tokens=80, proposer="ngram", gamma=gamma)
        assert result.token_ids == base.token_ids
        check_counts(gen, result, len(prompt), gamma, "ngram", before, 80)
        assert gen.draft.stats.calls == before["draft_calls"]  # the draft model is not used
        assert result.stats.drafted > 0


@pytest.mark.parametrize("gamma", [1, 3, 8])
def test_context_limit_same_length_as_target_only(gens, gamma):
    gen = gens("self")
    prompt = list(range(3, 3 + 240))  # 240 tokens, 16 positions left
    base = gen.generate(prompt, max_new_tokens=100, speculative=False)
    result = gen.generate(prompt, max_new_tokens=100, gamma=gamma)
    assert len(prompt) + len(base.token_ids) <= gen.manifest.max_context
    assert result.finish_reason == base.finish_reason == "length"
    assert result.token_ids == base.token_ids


def test_context_limit_prefix_is_exact(gens):
    """Up to the (separately reported) extra token, speculation is exact at the context limit."""
    gen = gens("noisy")
    prompt = list(range(3, 3 + 230))
    base = gen.generate(prompt, max_new_tokens=100, speculative=False)
    assert len(prompt) + len(base.token_ids) == gen.manifest.max_context
    for gamma in (2, 5, None):
        result = gen.generate(prompt, max_new_tokens=100, gamma=gamma)
        assert result.token_ids[: len(base.token_ids)] == base.token_ids
        assert result.finish_reason == "length"


def test_controller_options_reach_new_controllers_and_keep_greedy_exact(gens):
    """GeneratorConfig.controller options are passed to the controllers created for them (one
    per option set: gamma_tolerance here, at both ends of its range), greedy output stays the
    target's, and a bad value is the controller's typed error before any model call."""
    gen = gens("noisy")
    ref = gen.generate("def add(a, b):", max_new_tokens=30, speculative=False).token_ids
    try:
        for tol in (0.0, 0.5):
            config = gen.config.replace(controller={"gamma_tolerance": tol})
            assert gen.generate("def add(a, b):", config, max_new_tokens=30).token_ids == ref
            assert gen.policy.controllers[("draft", None, config.controller_key)].gamma_tolerance == tol
        with pytest.raises(InvalidArgument, match="gamma_tolerance"):
            gen.generate("def add(a, b):", max_new_tokens=5, controller={"gamma_tolerance": 1.5})
        with pytest.raises(InvalidArgument, match="controller option 'gamma'"):
            gen.generate("def add(a, b):", max_new_tokens=5, controller={"gamma": 2})
    finally:
        gen.policy.controllers.clear()
