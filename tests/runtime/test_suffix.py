"""The suffix proposer (runtime/specexport_runtime/suffix.py): matching and chain drafting against
a brute-force reference over explicit substrings, the store of past responses (FIFO, bounded
memory, accepted output only), and exactness in the loop (greedy token for token, sampling in law)."""

from __future__ import annotations

import math
import random
from collections import Counter

import numpy as np
import pytest
from exactness_support import check_first_two_tokens_follow_target

from specexport_runtime.errors import InvalidArgument
from specexport_runtime.suffix import RequestSuffix, SuffixConfig, SuffixStore


def reference(
    seqs: list[list[int]], context: list[int], config: SuffixConfig, room: int = 10**9
) -> tuple[list[int], float, int]:
    """Brute force over explicit substrings. `seqs`: independent sequences (a match never spans
    two); for the request itself pass [context] and only earlier occurrences count (an
    occurrence must end before the context's last position)."""
    own = len(seqs) == 1 and seqs[0] is context
    # occurrences: (sequence, end index) of context[-m:], for the largest m that has any
    best_m, occ = 0, []
    for m in range(1, min(config.max_depth, len(context)) + 1):
        s = context[-m:]
        found = [
            (i, c)
            for i, seq in enumerate(seqs)
            for c in range(m - 1, len(seq))
            if seq[c - m + 1 : c + 1] == s and (not own or c < len(seq) - 1)
        ]
        if not found:
            break
        best_m, occ = m, found
    limit = min(config.max_spec, math.floor(config.factor * best_m + config.offset), room)
    tokens, p, score = [], 1.0, 0.0
    while occ and len(tokens) < limit:
        nxt = Counter(seqs[i][c + 1] for i, c in occ if c + 1 < len(seqs[i]))
        if not nxt:
            break
        top = max(nxt.values())
        token = min(t for t, n in nxt.items() if n == top)
        p *= top / len(occ)
        if p < config.min_prob:
            break
        tokens.append(token)
        score += p
        occ = [(i, c + 1) for i, c in occ if c + 1 < len(seqs[i]) and seqs[i][c + 1] == token]
    return tokens, score, best_m


@pytest.mark.parametrize("seed", range(40))
def test_request_matches_the_brute_force_reference(seed):
    rng = random.Random(seed)
    alphabet = rng.choice([3, 5, 12])
    seq = [rng.randrange(alphabet) for _ in range(rng.randrange(2, 120))]
    config = SuffixConfig(
        max_depth=rng.choice([1, 3, 8, 24]),
        max_spec=rng.choice([1, 4, 16]),
        factor=rng.choice([0.5, 1.0, 2.0]),
        offset=rng.choice([0.0, 1.0]),
        min_prob=rng.choice([0.0, 0.1, 0.4]),
    )
    req = RequestSuffix(capacity=4)  # grows
    req.reset(seq[:1])
    req.extend(seq[1:])
    room = rng.choice([0, 2, 100])
    tokens, score, m = req.propose(seq[-config.max_depth :], config, room)
    want = reference([seq], seq, config, room)
    assert (tokens, m) == (want[0], want[2])
    assert score == pytest.approx(want[1])


@pytest.mark.parametrize("seed", range(25))
def test_store_matches_the_brute_force_reference(seed):
    rng = random.Random(100 + seed)
    responses = [[rng.randrange(4) for _ in range(rng.randrange(2, 40))] for _ in range(rng.randrange(1, 8))]
    store = SuffixStore(max_tokens=10**6)
    for r in responses:
        store.add(r)
    config = SuffixConfig(max_depth=rng.choice([2, 6, 24]), max_spec=8, min_prob=rng.choice([0.0, 0.2]))
    context = [rng.randrange(4) for _ in range(rng.randrange(2, 12))]
    tokens, score, m = store.propose(context, config, room=100)
    want = reference(responses, context, config)
    if want[2] < 2:  # the store indexes bigrams: a one-token match proposes nothing
        assert tokens == [] and m == 0
    else:
        assert (tokens, m) == (want[0], want[2])
        assert score == pytest.approx(want[1])


def test_store_never_drafts_across_responses():
    store = SuffixStore(max_tokens=1000)
    store.add([1, 2, 3])
    store.add([9, 9, 9, 9])
    tokens, _, m = store.propose([1, 2, 3], SuffixConfig(min_prob=0.0), room=10)
    assert m == 3 and tokens == []  # 3 ended its response: what follows in the buffer is another one


@pytest.mark.slow
def test_store_is_fifo_and_bounded_after_10000_requests():
    """10,000 synthetic responses of 20-200 tokens into a 20,000-token store: live tokens stay
    within the budget, the buffer and the index within twice it (plus one response), the oldest
    responses are forgotten and the newest still drafted."""
    budget = 20_000
    store = SuffixStore(max_tokens=budget)
    rng = np.random.default_rng(0)
    peak_buf = peak_entries = 0
    first = None
    for i in range(10_000):
        r = rng.integers(0, 3000, size=int(rng.integers(20, 201))).tolist()
        if i == 0:
            first = r
        store.add(r)
        assert store.tokens <= budget
        peak_buf = max(peak_buf, store.size)
        if i % 500 == 0:
            peak_entries = max(peak_entries, sum(len(v) for v in store.index.values()))
    assert store.added == 10_000
    assert peak_buf <= 2 * budget + 2 * 201 and peak_entries <= 2 * budget + 201
    assert store.memory_bytes() < 2 * budget * (4 + 8 + 192)  # reported, and within the stated bound
    described = store.describe()
    assert described["tokens"] <= budget and described["memory_bytes"] == store.memory_bytes()
    config = SuffixConfig(min_prob=0.0, max_depth=24)
    assert store.propose(first[:10], config, room=8)[2] < 10  # the first response is gone
    assert store.propose(r[:12], config, room=8)[0] == r[12:20]  # the newest is drafted


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_depth", 0),
        ("max_spec", 1000),
        ("min_prob", 1.5),
        ("factor", -1.0),
        ("global_tokens", -1),
        ("max_depth", True),
    ],
)
def test_bad_config_is_refused_with_the_name(field, value):
    with pytest.raises(InvalidArgument, match=f"suffix {field}"):
        SuffixConfig(**{field: value})


# ------------------------------------------------------------------------- in the loop

PROMPTS = [
    "def add(a, b):",
    "for i in range(10):\n    print(i * i)\nfor i in range(10):\n    print(i * i)\n",
    [40, 41, 42, 43, 44] * 4,
    [7, 150, 33, 299, 12, 260, 5],
]


@pytest.mark.parametrize("kind", ["ngram", "int8-fused"])
def test_greedy_suffix_equals_target_only_with_a_contradicting_store(gens, kind):
    """Greedy with the suffix proposer equals target-only on every prompt, for fixed and
    adaptive gamma, while the store holds (a) the target's own earlier answers (drafts that are
    accepted) and (b) answers that contradict the target (drafts that are rejected)."""
    gen = gens(kind)
    gen.forget_history()
    rng = np.random.default_rng(1)
    base = {i: gen.generate(p, max_new_tokens=60, speculative=False).token_ids for i, p in enumerate(PROMPTS)}
    for p in PROMPTS:  # contradicting answers: each prompt's continuation, corrupted
        ids = gen.codec.encode(p) if isinstance(p, str) else list(p)
        wrong = list(ids[-3:]) + [int(t) for t in rng.integers(0, 300, size=30)]
        gen.learned("suffix").store.add(wrong)
    drafted = accepted = corrected = 0
    for gamma in (1, 4, None):
        for i, p in enumerate(PROMPTS):
            result = gen.generate(p, max_new_tokens=60, proposer="suffix", gamma=gamma)
            assert result.token_ids == base[i], f"{kind} gamma={gamma} prompt {i}"
            st = result.stats
            drafted, accepted, corrected = drafted + st.drafted, accepted + st.accepted, corrected + st.corrections
    assert accepted > 0 and corrected > 0 and drafted > accepted  # both outcomes were exercised
    gen.forget_history()


def test_store_holds_only_finished_accepted_output(gens):
    """After generations the store holds exactly the emitted tokens of each finished request
    (never a rejected draft, never the prompt); an abandoned stream adds nothing."""
    gen = gens("ngram")
    gen.forget_history()
    outputs = []
    for p in PROMPTS[:3]:
        r = gen.generate(p, max_new_tokens=40, proposer="suffix")
        outputs.append(r.token_ids)
    store = gen.learned("suffix").store
    held = store.buf[store.start - store.base : store.size].tolist()
    want = [t for out in outputs if len(out) >= 2 for t in out + [-1]]
    assert held == want
    stream = gen.stream(PROMPTS[1], max_new_tokens=40, proposer="suffix")
    next(stream)
    stream.close()  # abandoned
    assert store.added == sum(len(o) >= 2 for o in outputs)
    gen.forget_history()


def test_later_requests_draft_from_earlier_answers(gens):
    """The same request twice: the second run drafts the first run's answer from the store and
    accepts it (greedy), so it needs far fewer target calls."""
    gen = gens("ngram")
    gen.forget_history()
    prompt = [7, 150, 33, 299, 12, 260, 5]
    first = gen.generate(prompt, max_new_tokens=60, proposer="suffix", gamma=4)
    second = gen.generate(prompt, max_new_tokens=60, proposer="suffix", gamma=4)
    assert second.token_ids == first.token_ids

    def calls(st):
        return st.rounds + st.plain_steps

    assert second.stats.accepted > first.stats.accepted and calls(second.stats) < calls(first.stats) / 2
    gen.forget_history()


def test_drafts_longer_than_a_verify_call_are_cut_to_fit(gens):
    """max_spec above what one verify call holds (OrtModel.max_rows rows): the store drafts the
    whole 150-token earlier answer at once, the loop verifies the first max_rows - 1 tokens of
    it, and the output is the target's."""
    gen = gens("ngram")
    gen.forget_history()
    try:
        prompt = [7, 150, 33, 299, 12, 260, 5]
        first = gen.generate(prompt, max_new_tokens=150, speculative=False)
        gen.learned("suffix").store.add(prompt[-4:] + first.token_ids)
        second = gen.generate(
            prompt, max_new_tokens=150, proposer="suffix", gamma=4, suffix=SuffixConfig(max_spec=200, factor=64.0)
        )
    finally:
        gen.forget_history()
    assert second.token_ids == first.token_ids
    rows = gen.target.max_rows
    assert len(first.token_ids) > rows and len(second.stats.drafted_at) == rows - 1  # the longest round drafted


def test_sampling_with_suffix_follows_the_target(gens):
    """Temperature 1 on a repetitive prompt (the request proposes at once) while the store fills
    with earlier samples' outputs: the first two tokens against the exact target law (chi-square)
    and against target-only samples (TV bound), as in test_sampling_law."""
    gen = gens("ngram")
    gen.forget_history()
    check_first_two_tokens_follow_target(gen, [40, 41, 42, 43, 44] * 4, "suffix")
    assert gen.learned("suffix").store.added > 0
    gen.forget_history()


@pytest.mark.parametrize("kind", ["noisy", "int8-fused"])
def test_hybrid_with_suffix_retrieval_is_exact_and_uses_both(gens, kind):
    """hybrid_retrieval 'suffix': suffix drafts where they score, the draft model elsewhere;
    greedy output equals target-only for fixed and adaptive gamma, with the store holding both
    the target's answers and contradicting ones; rounds are counted per source."""
    gen = gens(kind)
    gen.forget_history()
    assert gen.config.hybrid_retrieval == "suffix"  # the default
    try:
        rng = np.random.default_rng(2)
        for p in PROMPTS:
            ids = gen.codec.encode(p) if isinstance(p, str) else list(p)
            gen.learned("suffix").store.add(list(ids[-2:]) + [int(t) for t in rng.integers(0, 300, size=20)])
        sources: set[str] = set()
        for gamma in (2, None):
            for p in PROMPTS:
                base = gen.generate(p, max_new_tokens=60, speculative=False).token_ids
                result = gen.generate(p, max_new_tokens=60, proposer="hybrid", gamma=gamma)
                assert result.token_ids == base, f"{kind} gamma={gamma} prompt {p!r}"
                sources |= set(result.stats.by_source)
        assert "draft" in sources and {"suffix-request", "suffix-store"} & sources, sources
        with pytest.raises(InvalidArgument, match="hybrid_retrieval must be one of lookup, suffix, got 'tree'"):
            gen.generate(PROMPTS[0], max_new_tokens=4, proposer="hybrid", hybrid_retrieval="tree")
    finally:
        gen.forget_history()


def test_source_calibration_follows_what_the_target_accepts():
    """A source whose drafts the target keeps rejecting is trusted less (its factor falls toward
    accepted / scored), one that is borne out keeps a factor near 1; old rounds fade (HORIZON)."""
    from specexport_runtime.suffix import SourceCalibration

    cal = SourceCalibration()
    assert cal.factor("datastore") == 1.0
    for _ in range(200):
        cal.record("datastore", 2.0, 0)  # claims 2 tokens, gets none
        cal.record("request", 2.0, 2)
    assert cal.factor("datastore") < 0.05 and cal.factor("request") == pytest.approx(1.0)
    assert cal.scored["datastore"] <= SourceCalibration.HORIZON
    for _ in range(2000):
        cal.record("datastore", 2.0, 2)  # now it is right: the factor recovers
    assert cal.factor("datastore") > 0.9


def test_a_rejected_corpus_is_trusted_less_in_the_loop(gens):
    """In the loop: a store full of text that contradicts the target is drafted from, rejected,
    and its calibration factor falls below the request's; output stays exact."""
    gen = gens("ngram")
    gen.forget_history()
    from specexport_runtime.suffix import SourceCalibration

    gen.learned("suffix").calibration = SourceCalibration()
    rng = np.random.default_rng(3)
    prompt = [7, 150, 33, 299, 12, 260, 5]
    base = gen.generate(prompt, max_new_tokens=60, speculative=False).token_ids
    wrong = {i: [int(t) for t in rng.integers(0, 300, size=6)] for i in range(len(base) - 1)}
    for _ in range(5):  # every bigram of the target's answer, continued wrongly (always the same way: confident)
        for i in range(len(base) - 1):
            gen.learned("suffix").store.add([base[i], base[i + 1]] + wrong[i])
    # one request (its own answer joins the store at its end and would be drafted right later)
    assert gen.generate(prompt, max_new_tokens=60, proposer="suffix", gamma=4).token_ids == base
    cal = gen.learned("suffix").calibration
    assert cal.scored.get("store", 0) > 0 and cal.factor("store") < 0.5
    gen.forget_history()
