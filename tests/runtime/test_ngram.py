"""Prompt-lookup proposer against a brute-force scan of the history."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specexport_runtime.errors import InvalidArgument
from specexport_runtime.ngram import NgramProposer


def brute_force(history, ngram_sizes, max_gamma, gamma):
    """Scan backwards for the most recent earlier occurrence of the last n tokens."""
    g = min(gamma, max_gamma)
    if g == 0:
        return []
    L = len(history)
    for n in sorted(ngram_sizes, reverse=True):
        if L < n:
            continue
        suffix = history[L - n :]
        for start in range(L - n - 1, -1, -1):
            if history[start : start + n] == suffix:
                return history[start + n : start + n + g]
    return []


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), max_size=60),
    cuts=st.lists(st.integers(0, 60), max_size=6),
    sizes=st.sets(st.integers(1, 4), min_size=1).map(tuple),
    max_gamma=st.integers(1, 8),
    gamma=st.integers(0, 10),
)
def test_matches_brute_force(tokens, cuts, sizes, max_gamma, gamma):
    """Prompt then chunks of accepted tokens; after every extend the proposal equals the scan."""
    bounds = sorted({0, len(tokens), *[min(c, len(tokens)) for c in cuts]})
    prop = NgramProposer(ngram_sizes=sizes, max_gamma=max_gamma)
    prop.reset(tokens[: bounds[1]] if len(bounds) > 1 else [])
    for lo, hi in zip(bounds[1:], bounds[2:]):
        assert prop.propose(gamma) == brute_force(tokens[:lo], sizes, max_gamma, gamma)
        prop.extend(tokens[lo:hi])
    assert prop.tokens == tuple(tokens)
    assert prop.propose(gamma) == brute_force(tokens, sizes, max_gamma, gamma)


def test_no_match_returns_empty():
    prop = NgramProposer()
    prop.reset([1, 2, 3, 4, 5])
    assert prop.propose(4) == []
    prop.reset([])
    assert prop.propose(4) == []
    prop.reset([7])  # the suffix's only occurrence is itself
    assert prop.propose(4) == []


def test_prefers_longer_ngrams():
    # last 2-gram (1, 2) occurred at the start, followed by 9; the last 1-gram (2) occurred
    # more recently, followed by 5: the 2-gram wins
    prop = NgramProposer(ngram_sizes=(1, 2))
    prop.reset([1, 2, 9, 9, 0, 2, 5, 1, 2])
    assert prop.ngram_sizes == (2, 1)
    assert prop.propose(2) == [9, 9]
    only_unigrams = NgramProposer(ngram_sizes=(1,))
    only_unigrams.reset([1, 2, 9, 9, 0, 2, 5, 1, 2])
    assert only_unigrams.propose(2) == [5, 1]


def test_most_recent_occurrence_wins():
    prop = NgramProposer(ngram_sizes=(2,))
    prop.reset([4, 5, 1, 0, 4, 5, 2, 0, 4, 5])
    assert prop.propose(3) == [2, 0, 4]


def test_respects_gamma_and_max_gamma():
    prop = NgramProposer(max_gamma=3)
    prop.reset([10, 11, 12, 13, 14, 15, 16, 10, 11, 12])
    assert prop.propose(2) == [13, 14]
    assert prop.propose(10) == [13, 14, 15]
    assert prop.propose(0) == []


def test_copies_a_repeated_span():
    """Copying code or a quoted passage: every proposal of the second copy is right."""
    span = [101, 7, 42, 42, 9, 13, 250, 3, 77, 5]
    prop = NgramProposer(ngram_sizes=(3, 2, 1), max_gamma=4)
    prop.reset([1, 2] + span + [0, 8] + span[:3])
    emitted = span[:3]
    while len(emitted) < len(span):
        draft = prop.propose(4)
        want = span[len(emitted) : len(emitted) + 4]  # shorter at the end of the span
        assert draft[: len(want)] == want and len(draft) == 4
        prop.extend(want)
        emitted += want


def test_overlapping_match_proposes_what_exists():
    prop = NgramProposer(ngram_sizes=(3,))
    prop.reset([5, 5, 5, 5])
    assert prop.propose(4) == [5]  # earlier (5, 5, 5) ends at 3, only one follower exists


def test_accepts_numpy_ints():
    prop = NgramProposer(ngram_sizes=[np.int64(2)], max_gamma=np.int64(2))
    prop.reset(np.array([1, 2, 3, 1, 2]))
    assert prop.propose(np.int32(5)) == [3, 1]
    assert len(prop) == 5


@pytest.mark.parametrize(
    "kwargs, shown",
    [
        ({"ngram_sizes": ()}, "()"),
        ({"ngram_sizes": (3, 0)}, "(3, 0)"),
        ({"ngram_sizes": (2, 2)}, "(2, 2)"),
        ({"ngram_sizes": (1.5,)}, "(1.5,)"),
        ({"max_gamma": 0}, "0"),
        ({"max_gamma": True}, "True"),
    ],
)
def test_constructor_validation(kwargs, shown):
    with pytest.raises(InvalidArgument) as e:
        NgramProposer(**kwargs)
    assert shown in str(e.value)


def test_argument_validation():
    prop = NgramProposer()
    with pytest.raises(InvalidArgument, match="-1"):
        prop.propose(-1)
    with pytest.raises(InvalidArgument, match="1.5"):
        prop.reset([1, 1.5])
    with pytest.raises(InvalidArgument, match="-2"):
        prop.extend([-2])
