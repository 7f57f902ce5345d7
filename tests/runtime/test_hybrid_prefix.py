"""Prefix reuse on hybrid targets (prefix_cache.py with recurrent-state checkpoints): a request
whose prompt extends an earlier one resumes at the last checkpoint within the match (a multiple
of recurrent.MAX_CALL_ROWS rows: the states a cold prompt reaches in the same calls) and gives a
cold start's tokens and log-probabilities bit for bit. The reference is a second generator on
the same artifact with the pool off, served the same requests in the same order."""

from __future__ import annotations

import numpy as np
import pytest
from tiny import build_tiny_artifact

from specexport_runtime.api import load
from specexport_runtime.recurrent import MAX_CALL_ROWS

CASES = [
    ("granitemoehybrid", "noisy"),
    ("qwen3_5_text", "noisy-fused"),
    pytest.param("lfm2", "ngram", marks=pytest.mark.slow),
]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    built: dict = {}

    def get(arch: str, kind: str):
        if (arch, kind) not in built:
            root = build_tiny_artifact(tmp_path_factory.mktemp(f"{arch}-{kind}"), kind, arch=arch, max_context=768)
            built[arch, kind] = load(root), load(root, config={"prefix_cache_bytes": 0})
        return built[arch, kind]

    return get


def _turn(gen, ids: list[int], **kw):
    r = gen.generate(ids, max_new_tokens=16, logprobs=0, **kw)
    return r.token_ids, r.stats.cached_tokens, r.logprobs


@pytest.mark.parametrize("arch, kind", CASES)
def test_a_longer_prompt_resumes_at_a_checkpoint_and_equals_a_cold_start(pairs, arch, kind):
    warm, cold = pairs(arch, kind)
    for gen in (warm, cold):
        gen.forget_history()
    rng = np.random.default_rng(3)
    first = [int(t) for t in rng.integers(3, 300, size=300)]
    proposer = "draft" if warm.manifest.draft is not None else "ngram"
    history = list(first)
    cached = []
    for turn in range(3):  # each request: the whole history, then new ids
        got, want = _turn(warm, history, proposer=proposer), _turn(cold, history, proposer=proposer)
        assert got[0] == want[0] and got[2] == want[2], f"turn {turn}: a hit differs from a cold start"
        assert want[1] == 0
        cached.append(got[1])
        history += list(got[0]) + [int(t) for t in rng.integers(3, 300, size=40)]
    assert cached[0] == 0 and cached[1] == MAX_CALL_ROWS  # 300 prompt ids: one checkpoint at 256
    assert cached[2] == MAX_CALL_ROWS  # the second request read 256.. in one call: 512 is past its prompt (356)


def test_a_prompt_shorter_than_a_checkpoint_is_not_reused(pairs):
    warm, _ = pairs("granitemoehybrid", "noisy")
    ids = [int(t) for t in np.random.default_rng(4).integers(3, 300, size=100)]
    warm.generate(ids, max_new_tokens=8)
    assert warm.generate(ids + [5, 6, 7], max_new_tokens=8).stats.cached_tokens == 0


def test_the_pool_holds_checkpoints_at_whole_calls_only(pairs):
    """A 600-id prompt is read as calls of 256, 256 and 88 rows: checkpoints at 256 and 512, none
    at the prompt's end (its state came from an 88-row call, which a longer prompt reads otherwise)."""
    warm, cold = pairs("granitemoehybrid", "noisy")
    warm.forget_history()
    ids = [int(t) for t in np.random.default_rng(5).integers(3, 300, size=600)]
    warm.generate(ids, max_new_tokens=4)
    match = warm.prefix_cache.pool.match("", ids + [9] * 10, ("target",))
    assert [n for n, _ in match.checkpoints["target"]] == [256, 512]
    longer = ids + [9] * 10
    a, b = warm.generate(longer, max_new_tokens=8, logprobs=0), cold.generate(longer, max_new_tokens=8, logprobs=0)
    assert a.stats.cached_tokens == 512 and a.token_ids == b.token_ids and a.logprobs == b.logprobs
