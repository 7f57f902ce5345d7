"""An idle batch slot's rows taken in place (batch.py, prefix_cache.Lease.resident): a sequence
that leaves keeps its committed rows in its slot; other sequences' rounds leave them untouched
bit for bit but row 0 (the idle slot's throwaway row; a copy is kept); a next turn of the same
conversation joins that slot and skips those rows without the prefix pool (its bound here keeps
nothing), answering as a cold solo run does, greedy and seeded; another namespace does not take
them. Fused (in-place) and portable slots graphs."""

from __future__ import annotations

import numpy as np
import pytest

from specexport_runtime.api import load
from specexport_runtime.prefix_cache import TARGET

KINDS = ["noisy-fused-batch4", "noisy-batch3"]
FIRST, OTHER = "Write a function that adds two numbers.", "The quick brown fox jumps over the lazy dog"
SAMPLING = {"greedy": {"temperature": 0.0}, "seeded": {"temperature": 0.8, "seed": 5}}


@pytest.fixture(scope="module", params=KINDS)
def gens(request, tiny_artifacts):
    """(a batch generator whose prefix pool keeps nothing, a solo generator without a pool)."""
    root = tiny_artifacts[request.param]
    warm = load(root, threads=1, batch=True, config={"prefix_cache_bytes": 1})
    return warm, load(root, threads=1, config={"prefix_cache_bytes": 0})


def slot_of(scheduler, seq) -> int:
    return next(e.slot for e in scheduler.events if e.kind == "join" and e.sequence == seq.id)


@pytest.mark.parametrize("sampling", list(SAMPLING))
def test_a_next_turn_takes_the_idle_slots_rows_in_place_and_answers_as_a_cold_run(gens, sampling):
    warm, cold = gens
    options = {"max_new_tokens": 10, **SAMPLING[sampling]}
    scheduler = warm.scheduler(max_running=2)
    first = scheduler.submit(FIRST, **options)
    other = scheduler.submit(OTHER, max_new_tokens=60, temperature=0.0)  # runs on while the first's slot idles
    while not first.done:
        scheduler.step()
    slot = slot_of(scheduler, first)
    namespace, tokens, held, row0 = scheduler.resident[slot]
    assert tokens == first.prompt_ids + first.tokens and held[TARGET] >= len(first.prompt_ids)
    before = [r.copy() for r in scheduler.model.kv_rows(slot, 0, held[TARGET])]
    assert np.array_equal(row0[TARGET], np.stack(before)[:, :1])
    for _ in range(4):
        scheduler.step()
    assert not other.done  # the rounds above ran with the slot idle
    after = scheduler.model.kv_rows(slot, 0, held[TARGET])
    assert all(np.array_equal(a[1:], b[1:]) for a, b in zip(before, after))
    turn = tokens + warm.codec.encode(" Then test it.", add_special_tokens=False)
    second = scheduler.submit(turn, **options)
    scheduler.run()
    assert slot_of(scheduler, second) == slot and second.stats.cached_tokens == held[TARGET]
    assert warm.prefix_cache.pool.describe()["tokens"] == 0  # the pool held none of them
    assert second.tokens == cold.generate(turn, **options).token_ids
    # row 0, which the idle rounds overwrote, was written back: the copy taken as it left again equals it
    assert np.array_equal(scheduler.resident[slot][3][TARGET], row0[TARGET])


def test_another_namespace_does_not_take_the_rows(gens):
    warm, cold = gens
    scheduler = warm.scheduler(max_running=1)
    first = scheduler.submit(FIRST, max_new_tokens=8, temperature=0.0)
    scheduler.run()
    turn = first.prompt_ids + first.tokens + warm.codec.encode(" Then test it.", add_special_tokens=False)
    second = scheduler.submit(turn, max_new_tokens=8, temperature=0.0, cache_salt="another key")
    scheduler.run()
    assert second.stats.cached_tokens == 0
    assert second.tokens == cold.generate(turn, max_new_tokens=8, temperature=0.0).token_ids
