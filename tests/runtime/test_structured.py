"""Constrained decoding (structured.py) with exact speculation.

The reference is constrained target-only decoding: the target's rows with the grammar's
forbidden tokens masked out. Checked here:
  * greedy: every registered proposer, gamma 1..8, equals constrained target-only token for
    token (drafts the grammar cuts at position 0 included: an unconstrained draft model's first
    token is often invalid), and the output matches the grammar;
  * sampling: the first two tokens follow the masked target law (chi-square and a two-sample
    bound), with a draft model whose cut tokens travel as cut_q;
  * forced tokens are free: an output the grammar fixes completely takes one target call per
    forced run; counts of forced and drafted tokens are kept apart;
  * logprobs are the masked target's, equal with speculation on and off;
  * the pure pieces (apply_mask, verify_sampled's cut_q, token_logprobs) against hand-made cases;
  * errors: an invalid schema, a bad regex, and no llguidance installed, each one typed line.
"""

from __future__ import annotations

import json
import re
import sys

import jsonschema
import numpy as np
import pytest
from exactness_support import ALPHA, DELTA, binned, chi2_sf, chi2_stat, counts_of, make_bins, make_pair_bins, tv_bound

from specexport_runtime import registry
from specexport_runtime.errors import InvalidArgument
from specexport_runtime.sampling import SamplingParams, probabilities, residual, token_logprobs, verify_sampled
from specexport_runtime.structured import Grammar, GrammarError, StructuredUnavailable, apply_mask

pytest.importorskip("llguidance")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
PROMPTS = ["def add(a, b):", "The quick brown fox"]


def kinds_for(name: str) -> list[str]:
    """Tiny artifact kinds a proposer runs on (conftest's tiny_artifacts)."""
    spec = registry.get(name)
    if not spec.needs:
        return ["ngram"]
    return (["noisy", "noisy-fused"] if "decoder" in spec.needs else []) + (
        ["eagle3"] if "eagle3_head" in spec.needs else []
    )


CASES = [(name, kind) for name in registry.names() if name != registry.NONE for kind in kinds_for(name)]


@pytest.mark.parametrize("proposer, kind", CASES, ids=[f"{p}-{k}" for p, k in CASES])
def test_greedy_constrained_speculation_equals_constrained_target_only(gens, proposer, kind):
    gen = gens(kind)
    grammar = Grammar.json_schema(SCHEMA)
    for prompt in PROMPTS:
        base = gen.generate(prompt, max_new_tokens=64, grammar=grammar, speculative=False)
        assert base.stats.forced == base.stats.drafted == 0 and base.stats.rounds == 0
        for gamma in range(1, 9):
            gen.forget_history()
            got = gen.generate(prompt, max_new_tokens=64, grammar=grammar, proposer=proposer, gamma=gamma)
            assert got.token_ids == base.token_ids, (proposer, kind, gamma, prompt)
        if base.finish_reason == "eos":  # complete: it parses and validates
            jsonschema.validate(json.loads(base.text), SCHEMA)


def test_an_unconstrained_draft_is_cut_at_position_zero(gens):
    """The tiny EAGLE-3 head drafts without the grammar: many of its drafts are cut before the
    target sees them, some at their first token (the round becomes a plain step)."""
    gen = gens("eagle3")
    r = gen.generate(PROMPTS[0], max_new_tokens=64, grammar=Grammar.json_schema(SCHEMA), proposer="eagle", gamma=4)
    assert r.stats.grammar_cut > 0 and r.stats.plain_steps > 0 and r.stats.forced > 0


def test_the_draft_model_drafts_inside_the_grammar(gens):
    """The draft model masks its own drafting with the grammar (Proposer.constrain): its drafts
    are never cut, except at an end of sequence, and the output still equals target-only."""
    from specexport_runtime import structured

    cut: list[list[int]] = []
    shape = structured.Guide.shape

    def watched(self, proposal, forced, limit):
        out = shape(self, proposal, forced, limit)
        if out.cut:
            cut.append(list(proposal.tokens))
        return out

    gen = gens("noisy")
    grammar = Grammar.json_schema(SCHEMA)
    base = gen.generate(PROMPTS[0], max_new_tokens=64, grammar=grammar, speculative=False)
    structured.Guide.shape = watched
    try:
        r = gen.generate(PROMPTS[0], max_new_tokens=64, grammar=grammar, proposer="draft", gamma=4)
    finally:
        structured.Guide.shape = shape
    assert r.token_ids == base.token_ids and r.stats.drafted > 0
    assert all(tokens[len(tokens) - 1] in gen.eos for tokens in cut), cut


def test_forced_tokens_are_free(gens):
    """An output the grammar fixes completely: the forced run is drafted at once (no proposer
    token) and verified in one call, whose last row gives the end of sequence."""
    gen = gens("noisy")
    grammar = Grammar.json_schema(
        {
            "type": "object",
            "properties": {"greeting": {"const": "hello world, fox"}},
            "required": ["greeting"],
            "additionalProperties": False,
        }
    )
    base = gen.generate(PROMPTS[1], max_new_tokens=40, grammar=grammar, speculative=False)
    got = gen.generate(PROMPTS[1], max_new_tokens=40, grammar=grammar, proposer="draft", gamma=4)
    assert json.loads(got.text) == {"greeting": "hello world, fox"}
    assert got.token_ids == base.token_ids and got.finish_reason == base.finish_reason == "eos"
    s = got.stats
    assert s.forced == s.forced_accepted == len(got.token_ids) - 1  # all but the prefill's first token
    assert s.drafted == 0 and s.rounds == 1 and s.plain_steps == 0  # one call after the prefill
    assert base.stats.plain_steps == len(base.token_ids)  # target-only: one call per token (the last gives EOS)
    assert s.mean_accepted_length == pytest.approx(s.forced_accepted + 1)


def test_a_round_past_the_end_of_sequence_commits_up_to_it(gens):
    """A verify call can accept a draft's end of sequence and emit tokens after it in the same
    round (never output): the matcher consumes up to the end and ignores the rest; an end of
    sequence before the match is complete is refused."""
    gen = gens("ngram")
    engine = gen.constraints()
    eos = min(engine.eos_ids)
    yes = gen.codec.encode("yes", add_special_tokens=False)
    matcher = engine.matcher(Grammar.regex("yes"))
    matcher.commit(yes + [eos] + yes)
    assert matcher.committed == len(yes) and matcher.accepting
    early = engine.matcher(Grammar.regex("yes"))
    with pytest.raises(GrammarError, match=f"end-of-sequence token {eos}"):
        early.commit([eos])


def test_a_draft_is_cut_after_its_end_of_sequence(gens):
    from specexport_runtime.proposers import Proposal
    from specexport_runtime.structured import Guide

    gen = gens("ngram")
    engine = gen.constraints()
    eos = min(engine.eos_ids)
    yes = gen.codec.encode("yes", add_special_tokens=False)
    guide = Guide(engine.matcher(Grammar.regex("yes")))
    shaped = guide.shape(Proposal(yes + [eos] + yes, None), [], limit=16)
    assert shaped.tokens == yes + [eos] and shaped.cut == len(yes)


def test_output_matches_a_regex_and_stops_at_the_end_of_the_match(gens):
    gen = gens("ngram")
    for speculative in (False, True):
        r = gen.generate(
            PROMPTS[0],
            max_new_tokens=30,
            grammar=Grammar.regex(r"(yes|no), [0-9]{3}"),
            speculative=speculative,
            proposer="ngram",
            gamma=4,
        )
        assert r.finish_reason == "eos" and re.fullmatch(r"(yes|no), [0-9]{3}", r.text), r.text


def test_logprobs_are_the_masked_targets_and_equal_with_speculation_on_and_off(gens):
    gen = gens("noisy-fused")
    grammar = Grammar.json_schema(SCHEMA)
    off = gen.generate(PROMPTS[0], max_new_tokens=40, grammar=grammar, speculative=False, logprobs=3)
    on = gen.generate(PROMPTS[0], max_new_tokens=40, grammar=grammar, proposer="draft", gamma=4, logprobs=3)
    assert on.token_ids == off.token_ids and len(off.logprobs) == len(off.token_ids)
    assert on.logprobs == off.logprobs  # the bitwise target's rows are the same in either call shape
    for entry, token in zip(off.logprobs, off.token_ids):
        assert entry["token"] == token and entry["logprob"] <= 0.0 and len(entry["top"]) == 3
        assert entry["top"][0][1] >= entry["logprob"]  # greedy picked the most probable (masked) token
        assert entry["top"][0][0] == token
    # a forbidden token has probability 0: the first token must open the object
    first = off.logprobs[0]
    assert gen.codec.decode([first["token"]]).startswith("{") and all(np.isfinite(lp) for _, lp in first["top"][:1])
    assert gen.generate(PROMPTS[0], max_new_tokens=5).logprobs is None  # off unless asked


# --------------------------------------------------------------------------- the sampling law


def masked_pair_distribution(gen, ids: list[int], grammar: Grammar, params: SamplingParams, eos: int) -> np.ndarray:
    """P(t1, t2) under the masked target: p(t1 | ids, mask_0) p(t2 | ids, t1, mask(t1))."""
    matcher = gen.constraints().matcher(grammar)
    model = gen.target
    model.reset()
    first = apply_mask(model.forward(ids)[:1], matcher.masks([]))
    p1 = probabilities(first, params)[0]
    V = p1.shape[0]
    joint = np.zeros((V, V))
    masks = {}
    for t1 in np.flatnonzero(p1 > 0):
        if t1 == eos:
            joint[t1, t1] = p1[t1]
            continue
        masks[int(t1)] = matcher.masks([int(t1)])[1:]  # the grammar after t1
        model.truncate(len(ids))
        joint[t1] = p1[t1] * probabilities(apply_mask(model.forward([int(t1)])[:1], masks[int(t1)]), params)[0]
    model.reset()
    return joint


@pytest.mark.slow
@pytest.mark.parametrize("kind, proposer", [("noisy", "draft"), ("eagle3", "eagle")])
def test_sampling_follows_the_masked_target(gens, kind, proposer):
    """temperature 1, gamma 3, q non-one-hot: the draft model samples from its own masked law; the
    EAGLE-3 head drafts without the grammar, so its tokens are often cut and their q becomes the
    correction's cut_q. The first two tokens against the exact masked law, and against
    constrained target-only samples."""
    gen = gens(kind)
    grammar = Grammar.regex(r"[a-z ]{2,12}")
    ids = gen.codec.encode("The quick brown fox")
    params = SamplingParams(temperature=1.0)
    N = 2000
    (eos,) = gen.eos

    def pairs(seeds, speculative):
        out = []
        for seed in seeds:
            r = gen.generate(
                ids,
                max_new_tokens=2,
                seed=seed,
                speculative=speculative,
                temperature=1.0,
                top_k=0,
                gamma=3,
                proposer=proposer,
                grammar=grammar,
                seeded_noise=False,  # rejection sampling (cut_q); seeded noise: test_seeded.py
            )
            tokens = list(r.token_ids) + [eos] * (2 - len(r.token_ids))
            out.append(tuple(tokens))
        return out

    spec = pairs(range(N), True)
    base = pairs(range(N, 2 * N), False)
    joint = masked_pair_distribution(gen, ids, grammar, params, eos)
    assert joint.sum() == pytest.approx(1.0)
    first = joint.sum(axis=1)
    assert np.count_nonzero(first) < first.size // 2  # the grammar really masks
    pair_bins, first_bins = make_pair_bins(joint, N), make_bins(first, N)
    assert pair_bins.max() >= 10 and first_bins.max() >= 10
    for name, samples in (("speculative", spec), ("target-only", base)):
        for label, bins, p, marg in (("first", first_bins, first, True), ("pair", pair_bins, joint, False)):
            stat, df = chi2_stat(counts_of(samples, bins, marg), binned(p, bins))
            assert chi2_sf(stat, df) > ALPHA, f"{name} {label}: chi2 {stat:.1f} on {df} df"
    tv = 0.5 * np.abs(counts_of(spec, pair_bins) - counts_of(base, pair_bins)).sum() / N
    assert tv <= tv_bound(binned(joint, pair_bins), N, DELTA), tv


# --------------------------------------------------------------------------- pure pieces


def test_apply_mask_forbids_and_pads():
    logits = np.array([[1.0, 2.0, 3.0, 4.0], [0.5, 0.5, 0.5, 0.5]], np.float32)
    allowed = np.array([[True, False, True], [False, False, True]])
    out = apply_mask(logits, allowed)
    assert np.array_equal(out[0], [1.0, -np.inf, 3.0, -np.inf])  # column 3 lies past the grammar's vocabulary
    assert np.array_equal(out[1], [-np.inf, -np.inf, 0.5, -np.inf])
    assert logits[0, 1] == 2.0  # a new array


def test_verify_sampled_with_cut_q_samples_the_correction():
    """All gamma accepted and a cut token behind them: the next token follows residual(p, cut_q),
    which is what verifying the cut token (p(x) = 0: rejected for sure) would give."""
    p = np.array([[0.0, 1.0, 0.0], [0.5, 0.5, 0.0]])  # row 0 accepts token 1 for sure
    q = np.array([[0.0, 1.0, 0.0]])
    cut_q = np.array([0.6, 0.0, 0.4])  # the draft drew token 2 (forbidden) from this
    want = residual(p[1], cut_q)
    assert want == pytest.approx([0.0, 1.0, 0.0])  # max(0, p - q): only token 1 keeps mass
    rng = np.random.default_rng(0)
    draws = [verify_sampled(p, q, [1], rng, cut_q) for _ in range(200)]
    assert all(d == (1, 1) for d in draws)
    plain = {verify_sampled(p, q, [1], np.random.default_rng(s))[1] for s in range(200)}
    assert plain == {0, 1}  # without cut_q the bonus row p[1] gives both
    with pytest.raises(InvalidArgument, match="cut_q"):
        verify_sampled(p, q, [1], rng, np.ones(4) / 4)


def test_token_logprobs_are_log_softmax_with_ranked_alternatives():
    logits = np.array([[0.0, np.log(3.0), -np.inf, 0.0]])
    (entry,) = token_logprobs(logits, [3], top=2)
    assert entry["logprob"] == pytest.approx(np.log(1 / 5))
    assert entry["top"] == [(1, pytest.approx(np.log(3 / 5))), (0, pytest.approx(np.log(1 / 5)))]  # ties: smaller id
    assert token_logprobs(logits, [1], top=0)[0]["top"] == []


def test_grammar_errors_are_one_line(gens):
    gen = gens("ngram")
    with pytest.raises(GrammarError, match="strin"):
        gen.generate(
            "x",
            max_new_tokens=4,
            grammar=Grammar.json_schema({"type": "object", "properties": {"a": {"type": "strin"}}}),
        )
    with pytest.raises(GrammarError, match="regex"):
        gen.generate("x", max_new_tokens=4, grammar=Grammar.regex("(unclosed"))
    with pytest.raises(GrammarError, match="JSON object"):
        Grammar.json_schema([1, 2])
    with pytest.raises(InvalidArgument, match="grammar"):
        gen.generate("x", max_new_tokens=4, grammar="{}")
    with pytest.raises(InvalidArgument, match="logprobs"):
        gen.generate("x", max_new_tokens=4, logprobs=21)


def test_without_llguidance_a_constrained_request_names_the_extra(gens, monkeypatch):
    gen = gens("ngram")
    monkeypatch.setitem(sys.modules, "llguidance", None)  # import llguidance now raises ImportError
    with pytest.raises(StructuredUnavailable, match=r"specexport-runtime\[structured\]"):
        Grammar.json_object().compiled()
    assert gen.generate("x", max_new_tokens=3).token_ids  # free generation still works
