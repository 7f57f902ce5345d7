"""Exactness of speculative decoding on the tiny artifacts.

Greedy: speculative output == target-only output, token for token, for every proposer and
gamma. Sampling: the distribution of the emitted tokens is the target's, checked against the
exact distribution computed from the target's logits with the runtime's own `probabilities`.
Also the bookkeeping (counting invariants, per-position acceptance), the KV cursor rule and
rollback under random accept/reject patterns driven by a custom proposer.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from specexport_runtime.adaptive import GammaController
from specexport_runtime.config import GeneratorConfig
from specexport_runtime.engine import OrtModel, SessionConfig
from specexport_runtime.errors import InvalidArgument
from specexport_runtime.generator import GenerationStats, SpeculativeLoop
from specexport_runtime.proposers import DraftModelProposer, NgramLookupProposer, Proposal, Proposer
from specexport_runtime.sampling import SamplingParams, probabilities

KINDS = ("self", "noisy", "ngram", "int8", "noisy-fused", "int8-fused")  # -fused: head_major_inplace graphs
GAMMAS = (1, 2, 4, 8, None)  # None = adaptive
ADAPTIVE_GAMMA_MAX = 8  # the tiny recipes' max_gamma (checked against the manifest in `gens`)
MAX_NEW = 100  # prompts below are < 60 tokens: prompt + 100 + 8 stays under max_context 256
PROMPTS = [
    "def add(a, b):",
    "The quick brown fox jumps over the lazy dog.",
    "for i in range(10):\n    print(i * i)\nfor i in range(10):\n    print(i * i)\n",  # repetitive text
    [40, 41, 42, 43, 44] * 4,  # raw, repetitive token ids (the n-gram proposer matches at once)
    [7, 150, 33, 299, 12, 260, 5],  # raw token ids, incl. merged tokens and the last vocabulary id
]
PROMPT_IDS = ["code", "prose", "repeat-text", "repeat-ids", "raw-ids"]
GREEDY = SamplingParams()  # run_loop's default: greedy


@pytest.fixture(scope="module")
def gens(gens):
    """conftest's generators, checked for the gamma bound these tests rely on."""

    def get(kind: str):
        gen = gens(kind)
        m = gen.manifest
        # adaptive gamma never exceeds max(generation.max_gamma, speculation.gamma)
        assert max(int(m.generation.get("max_gamma", 8)), m.speculation.gamma) == ADAPTIVE_GAMMA_MAX
        return gen

    return get


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
    # the prompt, then [last, d1..dk] per round and [last] per plain step
    assert gen.target.stats.calls - calls_before["target_calls"] == 1 + s.rounds + s.plain_steps
    assert gen.target.stats.tokens - calls_before["target_tokens"] == prompt_len + s.rounds + s.drafted + s.plain_steps
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
    assert out.lookup and out.tokens == [43, 44, 40, 41, 42] and out.q is None
    assert prop.propose(history, 0, params, rng).tokens == [43, 44, 40, 41, 42]  # also when the draft is off
    fresh = [7, 150, 33, 299, 12]  # nothing repeats: the draft model drafts
    prop.start(fresh)
    before = gen.draft.stats.calls
    out = prop.propose(fresh, 3, params, rng)
    # one catch-up call over the prompt backlog (fresh[:-1]), then one call per drafted token
    assert not out.lookup and len(out.tokens) == 3 and gen.draft.stats.calls - before == 1 + 3
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
    with pytest.raises(
        InvalidArgument, match="'medusa' is not one of 'draft', 'ngram', 'hybrid', 'eagle', 'suffix', 'none'"
    ):
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


# ------------------------------------------------------------------ rollback / KV cursor


class RandomProposer(Proposer):
    """Proposes random-length drafts: a random number of correct tokens (the target's greedy
    continuation, known from a target-only reference) followed by random wrong tokens, so
    every accept/reject pattern occurs; checks the cache cursor rule on every call."""

    name = "random"

    def __init__(self, reference: list[int], target: OrtModel, vocab: int, seed: int):
        self.reference, self.target, self.vocab = reference, target, vocab
        self.rng = np.random.default_rng(seed)
        self.expected: list[tuple[int, int]] = []  # (k, n_accepted expected) per non-empty proposal
        self.cursor_errors: list[tuple[int, int]] = []
        self.commits = 0

    def start(self, prompt):
        self.prompt_len = len(prompt)

    def propose(self, committed, gamma, params, rng) -> Proposal:
        if self.target.length != len(committed) - 1:
            self.cursor_errors.append((self.target.length, len(committed)))
        pos = len(committed) - self.prompt_len  # index of the next token in the reference
        k = int(self.rng.integers(0, gamma + 1))  # 0 = nothing drafted (plain step)
        good = int(self.rng.integers(0, k + 1))
        tokens = self.reference[pos : pos + good]
        if good < k:
            wrong = int(self.rng.integers(0, self.vocab - 1))
            if wrong >= self.reference[pos + good]:
                wrong += 1  # uniform over the tokens that are not the target's choice
            tokens = tokens + [wrong] + self.rng.integers(0, self.vocab, size=k - good - 1).tolist()
        if k:
            self.expected.append((k, good))
        return Proposal([int(t) for t in tokens], None)

    def commit(self, committed, n_new):
        self.commits += 1
        if self.target.length != len(committed) - 1:
            self.cursor_errors.append((self.target.length, len(committed)))


def record_rounds(stats: GenerationStats) -> list[tuple[int, int]]:
    """Wrap stats.record_round to log (k, n) of every round (k: drafted tokens, forced ones
    included; no grammar here, so none are forced)."""
    log: list[tuple[int, int]] = []
    original = stats.record_round

    def record(k, n, forced=0):
        assert forced == 0
        log.append((k, n))
        original(k, n, forced)

    stats.record_round = record
    return log


def run_loop(
    gen,
    proposer,
    prompt: list[int],
    n_tokens: int,
    gamma: int | None,
    controller=None,
    params: SamplingParams = GREEDY,
    seed: int = 0,
):
    """Drive SpeculativeLoop directly (no truncation): returns (generated, stats, per-round (k, n)
    log, cursor after every round)."""
    config = GeneratorConfig(
        max_new_tokens=n_tokens,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        seed=params.seed,
        gamma=gamma,
    )
    stats = GenerationStats()
    log = record_rounds(stats)
    loop = SpeculativeLoop(gen.target, proposer, controller, config, np.random.default_rng(seed), stats)
    out: list[int] = []
    cursors: list[tuple[int, int]] = []
    for new in loop.rounds(prompt, gen.manifest.max_context):
        out += new
        cursors.append((gen.target.length, len(prompt) + len(out)))
        if len(out) >= n_tokens:
            break
    return out, stats, log, cursors


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("kind", ["ngram", "int8", "int8-fused"])
def test_random_accept_reject_rollback_is_exact(gens, kind, seed):
    gen = gens(kind)
    prompt = gen.codec.encode(PROMPTS[1]) if seed % 2 else list(PROMPTS[4])
    n = 120
    reference = gen.generate(prompt, max_new_tokens=n + 40, speculative=False).token_ids
    proposer = RandomProposer(reference, gen.target, gen.manifest.target.vocab_size, seed)
    out, stats, log, cursors = run_loop(gen, proposer, prompt, n, gamma=6)
    assert out[:n] == reference[:n], "a rejected draft token's K/V row leaked into later rounds"
    # the verifier accepted exactly the correct prefix of every proposal
    assert log == proposer.expected
    ks = {k for k, _ in log}
    ns = {n_acc for _, n_acc in log}
    assert len(ks) >= 4 and len(ns) >= 4, "the random proposer did not cover enough patterns"
    assert stats.corrections > 0 and stats.bonus > 0 and stats.plain_steps > 0
    assert proposer.cursor_errors == []
    assert all(cursor == committed - 1 for cursor, committed in cursors)
    assert len(out) == 1 + stats.accepted + stats.corrections + stats.bonus + stats.plain_steps


def fresh_rows(path, spec, max_context, ids: list[int]) -> list[np.ndarray]:
    model = OrtModel(path, spec, max_context, SessionConfig())
    model.forward(ids)
    return [r.copy() for r in model.kv_rows(0, len(ids))]


@pytest.mark.parametrize("kind", ["noisy", "noisy-fused"])
@pytest.mark.parametrize("gamma", [3, None])
def test_kv_cursor_after_every_round_and_no_stale_rows(gens, tiny_artifacts, gamma, kind):
    """After every round the target cursor is len(committed) - 1 and the draft's is at most
    that; at the end the valid cache rows equal those of a fresh prefill of the committed
    tokens (rows of rejected tokens were overwritten before being read, or never read)."""
    gen = gens(kind)
    root, m = tiny_artifacts[kind], gen.manifest
    prompt = gen.codec.encode(PROMPTS[0])
    draft = DraftModelProposer(gen.draft, m.target.embedding_rows)
    draft_cursors: list[tuple[int, int]] = []
    commit = draft.commit

    def checked_commit(committed, n_new):
        commit(committed, n_new)
        draft_cursors.append((gen.draft.length, len(committed)))

    draft.commit = checked_commit
    ctl = GammaController(gamma_max=8, gamma=4) if gamma is None else None
    out, stats, log, cursors = run_loop(gen, draft, prompt, 90, gamma=gamma, controller=ctl)
    assert stats.corrections > 0
    assert all(cursor == committed - 1 for cursor, committed in cursors)
    assert all(cursor <= committed - 1 for cursor, committed in draft_cursors)
    committed = prompt + out
    for model, entry in ((gen.target, m.target), (gen.draft, m.draft)):
        n = model.length
        expected = fresh_rows(root / entry.graph, entry.graph_spec(), m.max_context, committed[:n])
        for rows, ref in zip(model.kv_rows(0, n), expected):
            np.testing.assert_allclose(rows, ref, atol=1e-4, rtol=1e-4)


def test_loop_counts_exact_without_truncation(gens):
    """Driving the loop directly (no max_new_tokens cut): emitted == 1 + accepted + rounds + plain."""
    gen = gens("noisy")
    prompt = gen.codec.encode(PROMPTS[2])
    for gamma, ctl in ((4, None), (None, GammaController(gamma_max=8, gamma=4))):
        proposer = DraftModelProposer(gen.draft, gen.manifest.target.embedding_rows)
        out, stats, log, _ = run_loop(gen, proposer, prompt, 60, gamma=gamma, controller=ctl)
        assert len(out) == 1 + stats.accepted + stats.corrections + stats.bonus + stats.plain_steps
        assert len(log) == stats.rounds
        assert sum(k for k, _ in log) == stats.drafted and sum(n for _, n in log) == stats.accepted
        assert stats.bonus == sum(n == k for k, n in log)
        for i in range(len(stats.drafted_at)):
            assert stats.drafted_at[i] == sum(k > i for k, _ in log)
            assert stats.accepted_at[i] == sum(n > i for _, n in log)
    proposer = NgramLookupProposer((3, 2, 1))
    out, stats, log, _ = run_loop(gen, proposer, list(PROMPTS[3]), 60, gamma=5)
    assert len(out) == 1 + stats.accepted + stats.rounds + stats.plain_steps
    assert stats.rounds > 0


# ------------------------------------------------------------------ sampling exactness


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square(df): the regularized upper incomplete gamma Q(df/2, x/2)
    (series for x < a + 1, Lentz continued fraction otherwise; no scipy in this venv)."""
    a, x = df / 2.0, x / 2.0
    if x <= 0:
        return 1.0
    log_front = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        ap = a
        for _ in range(10000):
            ap += 1
            term *= x / ap
            total += term
            if abs(term) < abs(total) * 1e-15:
                break
        return max(0.0, 1.0 - total * math.exp(log_front))
    tiny = 1e-300
    b = x + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 10000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = d if abs(d) > tiny else tiny
        c = b + an / c
        c = c if abs(c) > tiny else tiny
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-15:
            break
    return math.exp(log_front) * h


def test_chi2_sf_reference_values():
    # textbook critical values: P(chi2_df >= x) = 0.05 / 0.01 / 1e-4
    assert chi2_sf(3.841459, 1) == pytest.approx(0.05, rel=1e-5)
    assert chi2_sf(18.307038, 10) == pytest.approx(0.05, rel=1e-5)
    assert chi2_sf(6.634897, 1) == pytest.approx(0.01, rel=1e-5)
    # even df have a closed form: exp(-x/2) sum_{k < df/2} (x/2)^k / k!  (both branches of chi2_sf)
    for df in (2, 4, 10, 30):
        for x in (0.5, 3.0, 17.0, 44.0, 90.0):
            closed = math.exp(-x / 2) * sum((x / 2) ** k / math.factorial(k) for k in range(df // 2))
            assert chi2_sf(x, df) == pytest.approx(closed, rel=1e-9, abs=1e-300)


ALPHA = 1e-4  # per chi-square test; the file runs < 10 of them: < 1e-3 false failures in all
DELTA = 1e-6  # per two-sample TV bound (rigorous, no asymptotics)


def exact_pair_distribution(model: OrtModel, ids: list[int], params: SamplingParams, eos: int) -> np.ndarray:
    """P(t1, t2) = p(t1 | ids) p(t2 | ids, t1) over [V, V] from a model's logits. Generation
    ends at EOS, so a first token EOS is the cell (eos, eos) (see `sample_pairs`)."""
    model.reset()
    p1 = probabilities(model.forward(ids)[:1], params)[0]  # [V]
    V = p1.shape[0]
    joint = np.zeros((V, V))
    for t1 in np.flatnonzero(p1 > 0):
        if t1 == eos:
            joint[t1, t1] = p1[t1]
            continue
        model.truncate(len(ids))
        joint[t1] = p1[t1] * probabilities(model.forward([int(t1)])[:1], params)[0]
    model.reset()
    return joint


def make_bins(p: np.ndarray, n: int, min_expected: float = 5.0) -> np.ndarray:
    """Bin index per cell of p: one bin per cell with expected count >= min_expected, the rest
    pooled in one last bin (merged into the smallest kept bin if it is too small itself)."""
    flat = p.reshape(-1)
    big = flat * n >= min_expected
    bins = np.full(flat.shape, -1, dtype=np.int64)
    bins[big] = np.arange(int(big.sum()))
    rest = int(big.sum())
    bins[~big] = rest
    if flat[~big].sum() * n < min_expected:
        bins[~big] = int(np.argmin(np.where(big, flat, np.inf)[big.nonzero()[0]]))
    return bins.reshape(p.shape)


def make_pair_bins(joint: np.ndarray, n: int, min_expected: float = 5.0) -> np.ndarray:
    """Bins of the pair law that keep the conditional structure: per first token t1 (of
    expected count >= 2 min_expected) one bin per (t1, t2) with expected count >= min_expected
    plus one bin for the rest of the row when that rest reaches min_expected (else it joins the
    row's smallest kept cell); every other cell goes to one global bin."""
    V = joint.shape[0]
    bins = np.full(joint.shape, -1, dtype=np.int64)
    nxt = 0
    for t1 in range(V):
        row = joint[t1]
        if row.sum() * n < 2 * min_expected:
            continue
        big = row * n >= min_expected
        if not big.any():
            bins[t1] = nxt
            nxt += 1
            continue
        kept = np.flatnonzero(big)
        bins[t1, kept] = nxt + np.arange(kept.size)
        if row[~big].sum() * n >= min_expected:
            bins[t1, ~big] = nxt + kept.size
            nxt += kept.size + 1
        else:
            bins[t1, ~big] = nxt + int(np.argmin(row[kept]))
            nxt += kept.size
    rest = bins < 0
    if joint[rest].sum() * n >= min_expected:
        bins[rest] = nxt
    else:  # fold into the smallest bin
        sizes = np.bincount(bins[~rest], weights=joint[~rest], minlength=nxt)
        bins[rest] = int(np.argmin(sizes))
    return bins


def binned(p: np.ndarray, bins: np.ndarray) -> np.ndarray:
    return np.bincount(bins.reshape(-1), weights=p.reshape(-1), minlength=int(bins.max()) + 1)


def counts_of(samples: list[tuple[int, int]], bins: np.ndarray, marginal: bool = False) -> np.ndarray:
    out = np.zeros(int(bins.max()) + 1)
    for t1, t2 in samples:
        out[bins[t1] if marginal else bins[t1, t2]] += 1
    return out


def chi2_stat(counts: np.ndarray, expected_p: np.ndarray) -> tuple[float, int]:
    n = counts.sum()
    e = n * expected_p
    return float(((counts - e) ** 2 / e).sum()), len(expected_p) - 1


def tv_bound(p_bins: np.ndarray, n: int, delta: float) -> float:
    """With prob >= 1 - delta, TV(empirical_1, empirical_2) <= this for two independent samples of
    size n from p: E[TV(P^, P)] <= 1/2 sum sqrt(p(1-p)/n) (Jensen) and, TV changing by <= 1/n per
    sample, McDiarmid gives P(TV > E + t) <= exp(-2 n t^2); union bound over the two samples."""
    mean = 0.5 * np.sqrt(p_bins * (1 - p_bins) / n).sum()
    t = math.sqrt(math.log(2 / delta) / (2 * n))
    return 2 * (mean + t)


def sample_pairs(gen, ids, seeds, speculative: bool, **kw) -> list[tuple[int, int]]:
    """First two generated tokens per seed; EOS (dropped from token_ids) is put back."""
    (eos,) = gen.eos
    out = []
    for seed in seeds:
        r = gen.generate(ids, max_new_tokens=2, seed=seed, speculative=speculative, **kw)
        tokens = list(r.token_ids)
        if r.finish_reason == "eos":
            tokens += [eos] * (2 - len(tokens))
        else:
            assert r.finish_reason == "length"
        assert len(tokens) == 2
        out.append(tuple(tokens))
    return out


@pytest.mark.parametrize("kind", ["noisy", "noisy-fused"])
def test_sampling_first_two_tokens_follow_target(gens, kind):
    """End to end on 'noisy' and 'noisy-fused' (gamma 3, temperature 1, top_k 0): token 1 comes from the prefill,
    token 2 from the first speculative round (accepted draft or correction, or bonus).

    Checks (N = 2000 samples each; speculative on seeds 0..N-1, target-only on N..2N-1):
      * chi-square goodness of fit of both samples against the exact distribution (first token
        p(t1) and pair p(t1) p(t2|t1) from the target's logits via the runtime's
        `probabilities`), cells with expected count >= 5 kept, the rest pooled; fails when the
        p-value < ALPHA = 1e-4 (asymptotic chi-square; 6 such tests here, so the chance that a
        correct runtime fails is < 1e-3 for a random choice of seeds);
      * two-sample total variation spec vs target-only on the same bins, against the rigorous
        bound `tv_bound` with DELTA = 1e-6;
      * power: the pair distribution the test would see if every draft were accepted
        (p(t1) q(t2|t1)) is far outside the acceptance region (expected statistic > 5x the
        critical value), so the check can fail.
    """
    gen = gens(kind)
    ids = gen.codec.encode("The quick brown fox")
    params = SamplingParams(temperature=1.0)
    N = 2000
    spec = sample_pairs(gen, ids, range(N), True, temperature=1.0, top_k=0, gamma=3)
    base = sample_pairs(gen, ids, range(N, 2 * N), False, temperature=1.0, top_k=0)
    joint = exact_pair_distribution(gen.target, ids, params, min(gen.eos))
    assert joint.sum() == pytest.approx(1.0)
    first = joint.sum(axis=1)
    pair_bins = make_pair_bins(joint, N)
    first_bins = make_bins(first, N)
    assert pair_bins.max() >= 10 and first_bins.max() >= 10  # enough cells for a meaningful test
    for name, samples in (("speculative", spec), ("target-only", base)):
        for label, bins, p, marg in (("first token", first_bins, first, True), ("pair", pair_bins, joint, False)):
            stat, df = chi2_stat(counts_of(samples, bins, marg), binned(p, bins))
            assert chi2_sf(stat, df) > ALPHA, f"{name} {label}: chi2 {stat:.1f} on {df} df"
    # two-sample TV on the pair bins
    pb = binned(joint, pair_bins)
    tv = 0.5 * np.abs(counts_of(spec, pair_bins) - counts_of(base, pair_bins)).sum() / N
    assert tv <= tv_bound(pb, N, DELTA), tv
    # the second token alone (marginal over t1), speculative only: the token of the round
    second = joint.sum(axis=0)
    sb = make_bins(second, N)
    c = np.zeros(int(sb.max()) + 1)
    for _, t2 in spec:
        c[sb[t2]] += 1
    stat, df = chi2_stat(c, binned(second, sb))
    assert chi2_sf(stat, df) > ALPHA, f"second token: chi2 {stat:.1f} on {df} df"
    # Scheffe-set checks: a rigorous test aimed at the two classic bugs. With q the draft's
    # conditional law of t2, the pair law would be
    #   "every draft accepted"       p(t1) q(t2|t1)
    #   "correction drawn from p"    p(t1) [min(p, q) + (1 - sum min(p, q)) p](t2|t1)
    # For each alternative a, A = {cells where the exact law exceeds a}; the sample frequency of
    # A is within Hoeffding's sqrt(ln(2/DELTA) / 2N) of its exact probability with prob
    # >= 1 - DELTA, and the alternative's probability of A is more than twice that away.
    q_joint = exact_pair_distribution(gen.draft, ids, params, min(gen.eos))
    p_cond = np.divide(joint, first[:, None], out=np.zeros_like(joint), where=first[:, None] > 0)
    q_cond = np.divide(q_joint, q_joint.sum(axis=1, keepdims=True))
    eos = min(gen.eos)
    q_cond[eos] = p_cond[eos]  # generation ends at a first-token EOS: nothing is drafted
    overlap = np.minimum(p_cond, q_cond)
    alternatives = {
        "accept every draft": first[:, None] * q_cond,
        "correction from p": first[:, None] * (overlap + (1 - overlap.sum(axis=1, keepdims=True)) * p_cond),
    }
    half = math.sqrt(math.log(2 / DELTA) / (2 * N))
    for name, alt in alternatives.items():
        assert alt.sum() == pytest.approx(1.0)
        region = joint > alt
        exact_mass = joint[region].sum()
        assert exact_mass - alt[region].sum() > 2 * half, f"no power against {name!r}"
        for label, samples in (("speculative", spec), ("target-only", base)):
            freq = np.mean([region[t1, t2] for t1, t2 in samples])
            assert abs(freq - exact_mass) <= half, (name, label, freq, exact_mass)


def test_seeded_sampling_reproducible_with_fixed_gamma(gens):
    gen = gens("noisy")
    kw = dict(max_new_tokens=40, temperature=1.0, seed=11, gamma=3)
    outs = {tuple(gen.generate("def add(a, b):", **kw).token_ids) for _ in range(3)}
    assert len(outs) == 1
    assert tuple(gen.generate("def add(a, b):", **{**kw, "seed": 12}).token_ids) not in outs


def test_seeded_sampling_reproducible_with_adaptive_gamma(gens):
    """Same seed, same arguments, default (adaptive) gamma: the output should not depend on how
    fast the previous calls ran. Timing is simulated deterministically by the cost estimates the
    generator carries between calls: drafting looks free, then prohibitively slow."""
    gen = gens("noisy")
    kw = dict(max_new_tokens=40, temperature=1.0, seed=11)
    outs = []
    for cost_draft in (1e-6, 1.0):
        gen._controllers[("draft", None, gen.config.controller_key)] = GammaController(
            cost_draft=cost_draft, cost_decode=1e-3, verify_costs={2: 1.1e-3, 5: 1.2e-3, 9: 1.4e-3}
        )
        outs.append(gen.generate("def add(a, b):", **kw).token_ids)
    gen._controllers.clear()
    assert outs[0] == outs[1]


def test_sampling_with_top_k_top_p_follows_target(gens):
    """temperature 0.8, top_k 20, top_p 0.9 on 'noisy' with gamma 3: no sampled pair lies outside
    the support of the filtered target distribution, and the pairs fit it (chi-square as above)."""
    gen = gens("noisy")
    ids = gen.codec.encode("def add(a, b):")
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9)
    N = 1200
    spec = sample_pairs(gen, ids, range(N), True, temperature=0.8, top_k=20, top_p=0.9, gamma=3)
    joint = exact_pair_distribution(gen.target, ids, params, min(gen.eos))
    support = joint > 0
    assert support.sum(axis=1).max() <= 20  # the filters did cut
    assert all(support[t1, t2] for t1, t2 in spec), "sampled a token outside the top-k/top-p set"
    bins = make_pair_bins(joint, N)
    stat, df = chi2_stat(counts_of(spec, bins), binned(joint, bins))
    assert df >= 5
    assert chi2_sf(stat, df) > ALPHA, f"chi2 {stat:.1f} on {df} df"


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
            assert gen._controllers[("draft", None, config.controller_key)].gamma_tolerance == tol
        with pytest.raises(InvalidArgument, match="gamma_tolerance"):
            gen.generate("def add(a, b):", max_new_tokens=5, controller={"gamma_tolerance": 1.5})
        with pytest.raises(InvalidArgument, match="controller option 'gamma'"):
            gen.generate("def add(a, b):", max_new_tokens=5, controller={"gamma": 2})
    finally:
        gen._controllers.clear()


def check_first_two_tokens_follow_target(gen, ids, proposer: str, N: int = 2000) -> None:
    """Temperature 1, gamma 3, `proposer`: the first two tokens of N speculative samples against
    the exact target law (chi-square, ALPHA) and against N target-only samples (TV bound, DELTA)."""
    spec = sample_pairs(gen, ids, range(N), True, temperature=1.0, top_k=0, gamma=3, proposer=proposer)
    base = sample_pairs(gen, ids, range(N, 2 * N), False, temperature=1.0, top_k=0)
    joint = exact_pair_distribution(gen.target, ids, SamplingParams(temperature=1.0), min(gen.eos))
    first = joint.sum(axis=1)
    pair_bins = make_pair_bins(joint, N)
    for label, bins, p, marg in (("first token", make_bins(first, N), first, True), ("pair", pair_bins, joint, False)):
        stat, df = chi2_stat(counts_of(spec, bins, marg), binned(p, bins))
        assert chi2_sf(stat, df) > ALPHA, f"{proposer} {label}: chi2 {stat:.1f} on {df} df"
    tv = 0.5 * np.abs(counts_of(spec, pair_bins) - counts_of(base, pair_bins)).sum() / N
    assert tv <= tv_bound(binned(joint, pair_bins), N, DELTA), tv


@pytest.mark.parametrize("kind", ["eagle3", "eagle3-portable"])
def test_sampling_with_an_eagle_head_follows_the_target(gens, kind):
    """The `eagle` proposer (a random EAGLE-3 head, draft vocabulary half the target's, so
    q = 0 outside it; fused and portable graph forms) at temperature 1, gamma 3: the first two
    tokens against the exact target law (chi-square, ALPHA as above) and against target-only
    samples (TV bound)."""
    gen = gens(kind)
    ids = gen.codec.encode("The quick brown fox")
    check_first_two_tokens_follow_target(gen, ids, "eagle")
    run = gen.events(ids, proposer="eagle", gamma=3, max_new_tokens=4)
    assert run.collect().stats is run.stats and run.stats.prompt_tokens == len(ids)
