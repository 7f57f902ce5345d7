"""Prefix reuse in gen.generate / gen.chat (prefix_cache.py): a hit gives exactly the tokens of a
cold start. The reference is a second generator on the same artifact with the pool off
(prefix_cache_bytes 0), served the same requests in the same order, so that what proposers learn
across requests (the suffix store, gamma controllers) is the same on both sides; greedy answers
are also checked against target-only decoding."""

from __future__ import annotations

import numpy as np
import pytest

from specexport_runtime.api import load
from specexport_runtime.errors import InvalidArgument
from specexport_runtime.suffix import SuffixConfig

SYSTEM = "You are a careful assistant for a code editor: answer briefly."  # the tiny context is 256 ids
TURNS = ["def add(a, b):", "Now for three.", "The quick fox?"]


@pytest.fixture(scope="module")
def pair(tiny_artifacts):
    """kind -> (warm generator with a pool, cold generator without), loaded once per module."""
    cache: dict = {}

    def get(kind: str, fresh: str = "", **config):
        """fresh: a pair of its own, apart from the other tests' (keyed by this name)."""
        key = (kind, fresh, tuple(sorted(config.items())))
        if key not in cache:
            root = tiny_artifacts[kind]
            cache[key] = (load(root, config=config), load(root, config={**config, "prefix_cache_bytes": 0}))
        return cache[key]

    return get


def chat_turns(gen, settings: dict, turns=TURNS, tokens: int = 16):
    """Three chat turns, each sending the whole history; -> [(token ids, cached tokens, logprobs)]:
    each token's log-probability under the target, so a differing bit in a row it was picked from
    shows even where the token does not change."""
    messages = [{"role": "system", "content": SYSTEM}]
    out = []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        r = gen.chat(messages, max_new_tokens=tokens, logprobs=0, **settings)
        out.append((r.token_ids, r.stats.cached_tokens, r.logprobs))
        messages.append({"role": "assistant", "content": r.text})
    return out


def check_turns(warm, cold, settings: dict) -> list:
    for gen in (warm, cold):  # the same learned state on both sides (the suffix store of earlier answers)
        gen.forget_history()
    got, want = chat_turns(warm, settings), chat_turns(cold, settings)
    assert [ids for ids, _, _ in got] == [ids for ids, _, _ in want]
    assert [lp for _, _, lp in got] == [lp for _, _, lp in want]
    assert all(cached == 0 for _, cached, _ in want)
    assert all(cached > 0 for _, cached, _ in got[1:]), got  # turns 2 and 3 reuse the history
    return got


@pytest.mark.parametrize("proposer", ["draft", "ngram", "suffix", "hybrid", "none"])
def test_greedy_hits_equal_a_cold_start_for_every_proposer(pair, proposer):
    warm, cold = pair("noisy")
    got = check_turns(warm, cold, {"proposer": proposer})
    target_only = chat_turns(cold, {"proposer": "none"})
    assert [ids for ids, _, _ in got] == [ids for ids, _, _ in target_only]


# seeded sampling: the suffix draft limit fixed (its tuner picks a limit from timings, and a
# deterministic draft's length decides how many random draws verification takes), and fresh
# generators (what the suffix proposer measured of earlier requests is the same on both sides)
SEEDED = {"temperature": 0.9, "top_p": 0.95, "seed": 11, "suffix": SuffixConfig(limit_scales=(1.0,))}


@pytest.mark.parametrize("proposer", ["draft", "hybrid", "suffix"])
def test_seeded_sampling_hits_equal_a_cold_start(pair, proposer):
    warm, cold = pair("noisy", fresh=proposer)
    check_turns(warm, cold, {"proposer": proposer, **SEEDED})


@pytest.mark.parametrize("settings", [{"proposer": "draft"}, {"proposer": "hybrid", **SEEDED}])
def test_the_fused_layout_hits_equal_a_cold_start(pair, settings):
    warm, cold = pair("noisy-fused", fresh=settings["proposer"])
    check_turns(warm, cold, settings)


def test_a_grammar_hit_equals_a_cold_start(pair):
    pytest.importorskip("llguidance")
    from specexport_runtime.structured import Grammar

    warm, cold = pair("noisy")
    grammar = Grammar.regex(r"(yes|no), [a-z ]{3,20}")
    check_turns(warm, cold, {"proposer": "draft", "grammar": grammar})


def test_a_hit_restores_the_rows_one_prefill_computes(pair):
    """The K/V rows after a hit's prefill (restored rows + the rest) equal a cold prefill's, bit
    for bit (a bitwise artifact)."""
    warm, cold = pair("noisy", prefix_cache_bytes=1 << 26)
    prompt = SYSTEM + " " + TURNS[0]
    warm.generate(prompt, max_new_tokens=16, proposer="draft")
    longer = prompt + " and more words after it"
    r = warm.generate(longer, max_new_tokens=1, proposer="draft")
    cold.generate(longer, max_new_tokens=1, proposer="draft")
    n = r.stats.prompt_tokens
    assert 0 < r.stats.cached_tokens < n
    for a, b in zip(warm.target.kv_rows(0, n), cold.target.kv_rows(0, n)):
        assert np.array_equal(a, b)


def test_an_edited_earlier_turn_reuses_only_up_to_the_edit(pair):
    warm, cold = pair("noisy", prefix_cache_bytes=1 << 26)
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TURNS[0]}]
    r = warm.chat(first, max_new_tokens=16, proposer="draft")
    stored = warm.prepare_chat(first).ids + r.token_ids
    edited = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "def sub(a, b):"},  # the earlier turn, edited
        {"role": "assistant", "content": r.text},
        {"role": "user", "content": TURNS[1]},
    ]
    ids = warm.prepare_chat(edited).ids
    common = next(i for i, (a, b) in enumerate(zip(ids, stored)) if a != b)
    got = warm.chat(edited, max_new_tokens=16, proposer="draft")
    assert got.stats.cached_tokens == common
    cold.chat(first, max_new_tokens=16, proposer="draft")
    assert got.token_ids == cold.chat(edited, max_new_tokens=16, proposer="draft").token_ids


def test_eviction_under_the_bound_leaves_every_answer_correct(pair):
    rows = 120  # the bound: 120 rows of target and draft, under two of the sequences below
    warm, cold = pair("noisy", prefix_cache_bytes=rows * warm_row_bytes(pair))
    prompts = [f"{SYSTEM[: 30 + 7 * k]} {TURNS[k % 3]}" for k in range(4)]
    for p in prompts + prompts[::-1] + prompts:  # a fixed gamma: the draft runs (and keeps rows) whatever the timings
        a = warm.generate(p, max_new_tokens=12, proposer="draft", gamma=4)
        b = cold.generate(p, max_new_tokens=12, proposer="draft", gamma=4)
        assert a.token_ids == b.token_ids
        assert warm.prefix_cache.pool.nbytes <= warm.prefix_cache.pool.max_bytes
    stats = warm.prefix_cache.describe()
    assert stats["evictions"] > 0 and stats["hits"] > 0, stats


def warm_row_bytes(pair) -> int:
    """Bytes of one cached row of the target and the draft of the noisy artifact."""
    gen, _ = pair("noisy")
    return (gen.target.kv_nbytes() // gen.target.cache_rows) + (gen.draft.kv_nbytes() // gen.draft.cache_rows)


def test_cache_prompt_false_neither_reuses_nor_keeps(pair):
    warm, _ = pair("noisy", prefix_cache_bytes=1 << 26)
    prompt = "A prompt nobody sent before: " + SYSTEM
    before = warm.prefix_cache.describe()
    r = warm.generate(prompt, max_new_tokens=8, cache_prompt=False, cache_salt="opt-out")
    assert r.stats.cached_tokens == 0 and warm.prefix_cache.describe() == before
    again = warm.generate(prompt, max_new_tokens=8, cache_salt="opt-out")
    assert again.stats.cached_tokens == 0  # nothing was kept
    assert (
        warm.generate(prompt, max_new_tokens=8, cache_salt="opt-out").stats.cached_tokens == r.stats.prompt_tokens - 1
    )


def test_salts_do_not_share_prefixes(pair):
    warm, _ = pair("noisy", prefix_cache_bytes=1 << 26)
    prompt = "Salted: " + SYSTEM
    warm.generate(prompt, max_new_tokens=4, cache_salt="alice")
    assert warm.generate(prompt, max_new_tokens=4, cache_salt="bob").stats.cached_tokens == 0
    assert warm.generate(prompt, max_new_tokens=4).stats.cached_tokens == 0
    assert warm.generate(prompt, max_new_tokens=4, cache_salt="alice").stats.cached_tokens > 0


def test_a_closed_generation_leaves_its_prefix_unless_the_models_ran_since(pair):
    warm, cold = pair("noisy", prefix_cache_bytes=1 << 26)
    prompt = "Closed early: " + SYSTEM
    run = warm.events(prompt, max_new_tokens=40, proposer="draft", cache_salt="closed")
    next(run)
    next(run)
    run.close()
    r = warm.generate(prompt, max_new_tokens=12, proposer="draft", cache_salt="closed")
    assert r.stats.cached_tokens == r.stats.prompt_tokens - 1
    assert r.token_ids == cold.generate(prompt, max_new_tokens=12, proposer="draft").token_ids
    other = "Another early close: " + SYSTEM
    run = warm.events(other, max_new_tokens=40, proposer="draft", cache_salt="foreign")
    next(run)
    warm.target.forward([5, 6])  # someone else's call: the cache no longer holds `other`'s rows only
    run.close()
    assert warm.generate(other, max_new_tokens=4, cache_salt="foreign").stats.cached_tokens == 0


def test_a_bad_setting_is_refused_in_one_line():
    from specexport_runtime.config import GeneratorConfig

    with pytest.raises(InvalidArgument, match="prefix_cache_bytes must be an integer >= 0"):
        GeneratorConfig(prefix_cache_bytes=-5)
    with pytest.raises(InvalidArgument, match="cache_prompt must be true or false"):
        GeneratorConfig(cache_prompt="yes")
    with pytest.raises(InvalidArgument, match="cache_salt must be a string"):
        GeneratorConfig(cache_salt=3)


@pytest.mark.parametrize("proposer", ["draft", "hybrid"])
def test_batch_slots_adopt_a_prefix_and_equal_a_cold_batch(tiny_artifacts, proposer):
    """Sequences leaving their slots keep their rows; the next batch's sequences start from them
    (in whatever slot) and give the cold batch's tokens, which are the solo target-only tokens."""
    root = tiny_artifacts["noisy-fused-batch4"]
    warm, cold = load(root, batch=True), load(root, batch=True, config={"prefix_cache_bytes": 0})
    first = [f"{SYSTEM} {t}" for t in TURNS]
    warm.batch(first, max_new_tokens=12, proposer=proposer)
    cold.batch(first, max_new_tokens=12, proposer=proposer)
    second = [f"{p} and then?" for p in first[::-1]] + [SYSTEM]
    got = warm.batch(second, max_new_tokens=12, proposer=proposer)
    want = cold.batch(second, max_new_tokens=12, proposer=proposer)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert all(r.stats.cached_tokens > len(SYSTEM) // 4 for r in got), [r.stats.cached_tokens for r in got]
    assert all(r.stats.cached_tokens == 0 for r in want)
    solo = [cold.generate(p, max_new_tokens=12, speculative=False).token_ids for p in second]
    assert [r.token_ids for r in got] == solo


@pytest.mark.parametrize(
    "settings",
    [{"proposer": "eagle"}, {"proposer": "hybrid"}, {"proposer": "eagle", **SEEDED}],
    ids=["eagle", "hybrid", "eagle-seeded"],
)
def test_an_eagle_head_hit_equals_a_cold_start(pair, settings):
    """An EAGLE-3 head also restores the target's features of the cached positions (and, greedy,
    its own rows)."""
    warm, cold = pair("eagle3", fresh=str(settings))
    got = check_turns(warm, cold, settings)
    assert warm.prefix_cache.describe()["hits"] >= 2 and got[2][1] > got[1][1]


def test_a_prefix_ending_inside_a_word_reuses_the_common_ids(pair):
    warm, cold = pair("noisy", prefix_cache_bytes=1 << 26)
    short, longer = SYSTEM + " The quick br", SYSTEM + " The quick brown fox"
    a = warm.generate(short, max_new_tokens=6, cache_salt="word")
    stored = warm.codec.encode(short) + a.token_ids
    ids = warm.codec.encode(longer)
    common = next((i for i, (x, y) in enumerate(zip(ids, stored)) if x != y), min(len(ids), len(stored)))
    got = warm.generate(longer, max_new_tokens=12, cache_salt="word")
    assert got.stats.cached_tokens == min(common, len(ids) - 1) > 0
    assert got.token_ids == cold.generate(longer, max_new_tokens=12).token_ids


def test_many_batched_sessions_keep_the_bound_and_their_answers(tiny_artifacts):
    """Twelve sessions with distinct histories, two turns each, four slots at once, a pool that
    holds a few of them: the bound holds after every sequence leaves, and every answer is the
    cold batch's."""
    root = tiny_artifacts["noisy-fused-batch4"]
    warm = load(root, batch=True, config={"prefix_cache_bytes": 200 * warm_row_bytes_of(root)})
    cold = load(root, batch=True, config={"prefix_cache_bytes": 0})
    pool = warm.prefix_cache.pool
    sessions = [f"Session {k}: {SYSTEM[: 20 + 3 * k]}" for k in range(12)]
    for _ in range(2):  # two turns
        scheduler = warm.scheduler()
        seqs = [scheduler.submit(p, max_new_tokens=8, proposer="draft") for p in sessions]
        while not scheduler.idle:
            scheduler.step()
            assert pool.nbytes <= pool.max_bytes
        want = cold.batch(sessions, max_new_tokens=8, proposer="draft")
        assert [s.result().token_ids for s in seqs] == [r.token_ids for r in want]
        sessions = [p + s.text + " ok?" for p, s in zip(sessions, seqs)]
    stats = warm.prefix_cache.describe()
    assert stats["evictions"] > 0 and stats["hits"] > 0, stats


def warm_row_bytes_of(root) -> int:
    """Bytes of one cached row of the target and the draft of an artifact (its manifest)."""
    from specexport_runtime.manifest import read_manifest

    m = read_manifest(root)
    return sum(e.graph_spec().kv_bytes(1) for e in (m.target, m.draft))
