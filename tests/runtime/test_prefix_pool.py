"""The prefix pool's radix tree (prefix_pool.py) against brute force: longest prefix, rows per
part, contiguity, LRU eviction under the byte bound, namespaces. No models: a part's row t is a
value computed from ids[:t + 1] alone (as a causal model's K/V row is), so every row read back
can be checked against an independent oracle."""

from __future__ import annotations

import numpy as np
import pytest

from specexport_runtime.errors import InvalidArgument
from specexport_runtime.prefix_pool import PrefixPool

B, H, D = 4, 2, 3  # buffers, KV heads, head dim of the synthetic rows


def row_value(ids, t: int, part: str) -> np.ndarray:
    """The oracle: part's row t of `ids`, a function of ids[:t + 1] only. [B, H, D]"""
    h = 0
    for x in ids[: t + 1]:
        h = (h * 1_000_003 + int(x) + 7) % 2_147_483_647
    h += 17 if part == "draft" else 0
    return np.full((B, H, D), float(h % 65_521), np.float32) + np.arange(B * H * D, dtype=np.float32).reshape(B, H, D)


def source(ids, part: str):
    """rows [start, stop) of `ids` as [B, n, H, D]."""

    def read(start: int, stop: int) -> np.ndarray:
        return np.stack([row_value(ids, t, part) for t in range(start, stop)], axis=1)

    return read


def read_back(pool: PrefixPool, match, part: str, stop: int, ids) -> None:
    out = np.zeros((B, stop, H, D), np.float32)

    def write(start: int, rows: np.ndarray) -> None:
        out[:, start : start + rows.shape[1]] = rows

    pool.read(match, part, stop, write)
    want = source(ids, part)(0, stop)
    assert np.array_equal(out, want)


def lcp(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_matches_the_longest_prefix_and_its_rows_as_brute_force_does():
    rng = np.random.default_rng(0)
    pool = PrefixPool(1 << 30)
    stored: list[tuple[list[int], int, int]] = []  # ids, target rows, draft rows
    for _ in range(40):
        if stored and rng.random() < 0.6:  # share a prefix with an earlier sequence
            base = stored[rng.integers(len(stored))][0]
            ids = base[: rng.integers(0, len(base) + 1)] + rng.integers(0, 4, rng.integers(1, 12)).tolist()
        else:
            ids = rng.integers(0, 4, rng.integers(1, 20)).tolist()
        nt = int(rng.integers(0, len(ids) + 1))
        nd = int(rng.integers(0, len(ids) + 1))
        pool.insert("", ids, {"target": (nt, source(ids, "target")), "draft": (nd, source(ids, "draft"))})
        stored.append((ids, nt, nd))
    for _ in range(200):
        q = rng.integers(0, 4, rng.integers(1, 25)).tolist()
        if rng.random() < 0.5:
            base = stored[rng.integers(len(stored))][0]
            q = base[: rng.integers(0, len(base) + 1)] + q
        m = pool.match("", q, ("target", "draft"))
        assert m.tokens == max(lcp(q, s[: max(nt, nd)]) for s, nt, nd in stored)
        assert m.rows["target"] == max(min(lcp(q, s), nt) for s, nt, _ in stored)
        assert m.rows["draft"] == max(min(lcp(q, s), nd) for s, _, nd in stored)
        for part in ("target", "draft"):
            if m.rows[part]:
                read_back(pool, m, part, m.rows[part], q)
    assert pool.nbytes == sum(a.nbytes for n in pool._nodes() for a in n.rows.values())
    nodes = list(pool._nodes())
    assert (pool.nodes, pool.tokens) == (len(nodes), sum(n.tokens.size for n in nodes))


def test_eviction_keeps_the_bound_and_drops_the_least_recently_used_first():
    row_bytes = B * H * D * 4
    pool = PrefixPool(30 * row_bytes)
    seqs = [[k] * 10 + list(range(10)) for k in range(5)]  # 20 ids each, nothing shared
    for s in seqs[:3]:
        pool.insert("", s, {"target": (20, source(s, "target"))})
    assert pool.nbytes <= pool.max_bytes
    assert pool.match("", seqs[0], ("target",)).tokens == 0  # evicted: the oldest
    assert pool.match("", seqs[2], ("target",)).rows["target"] == 20
    pool.insert("", seqs[3], {"target": (20, source(seqs[3], "target"))})
    assert pool.match("", seqs[2], ("target",)).tokens == 0  # the bound holds one sequence: the newest
    assert pool.match("", seqs[3], ("target",)).rows["target"] == 20
    assert pool.nbytes == sum(a.nbytes for n in pool._nodes() for a in n.rows.values()) <= pool.max_bytes
    assert pool.stats.evictions == 3 and pool.stats.evicted_tokens == 60
    pool.resize(0)
    assert pool.nbytes == 0 and pool.describe()["nodes"] == 0


def test_a_used_prefix_outlives_a_newer_unused_one():
    row_bytes = B * H * D * 4
    pool = PrefixPool(45 * row_bytes)
    a, b, c = [1] * 20, [2] * 20, [3] * 20
    for s in (a, b):
        pool.insert("", s, {"target": (20, source(s, "target"))})
    pool.match("", a, ("target",))  # a is now more recent than b
    pool.insert("", c, {"target": (20, source(c, "target"))})
    assert pool.match("", a, ("target",)).rows["target"] == 20
    assert pool.match("", b, ("target",)).tokens == 0


def test_a_shared_prefix_is_stored_once_and_splits_keep_every_row():
    pool = PrefixPool(1 << 30)
    a = list(range(30))
    b = list(range(12)) + [99] * 8
    pool.insert("", a, {"target": (30, source(a, "target"))})
    pool.insert("", b, {"target": (20, source(b, "target"))})
    assert pool.describe()["tokens"] == 38  # 12 shared + 18 + 8
    for s in (a, b):
        m = pool.match("", s, ("target",))
        read_back(pool, m, "target", len(s), s)


def test_namespaces_never_share_a_prefix():
    pool = PrefixPool(1 << 30)
    s = list(range(10))
    pool.insert("alice", s, {"target": (10, source(s, "target"))})
    assert pool.match("bob", s, ("target",)).tokens == 0
    assert pool.match("", s, ("target",)).tokens == 0
    assert pool.match("alice", s, ("target",)).rows["target"] == 10


def test_rows_of_a_part_stay_contiguous_from_the_root():
    pool = PrefixPool(1 << 30)
    s = list(range(20))
    pool.insert("", s, {"target": (20, source(s, "target")), "draft": (5, source(s, "draft"))})
    longer = s + [50, 51]
    pool.insert("", longer, {"target": (22, source(longer, "target")), "draft": (22, source(longer, "draft"))})
    m = pool.match("", longer, ("target", "draft"))
    assert m.rows == {"target": 22, "draft": 22}  # the second insert filled the draft's gap
    read_back(pool, m, "draft", 22, longer)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1"])
def test_a_bad_bound_is_refused_in_one_line(bad):
    with pytest.raises(InvalidArgument, match="max_bytes must be an integer >= 0"):
        PrefixPool(bad)


def state_value(ids, n: int) -> list[np.ndarray]:
    """The oracle of a stateful part's checkpoint after ids[:n]: two state sites [1, 2] and [1, 3]."""
    h = float(row_value(ids, n - 1, "target")[0, 0, 0])
    return [np.full((1, 2), h, np.float32), np.full((1, 3), -h, np.float32)]


def test_checkpoints_end_nodes_survive_splits_and_count_bytes():
    """A stateful part's checkpoints: a node ends at each, a later insert that splits an edge
    leaves each checkpoint where it was taken, a match lists those within its rows, and the
    byte count follows inserts and evictions."""
    a = np.arange(100, 112)  # 12 ids
    pool = PrefixPool(1 << 20)
    pool.insert("", a, {"target": (12, source(a, "target"))}, {"target": {4: state_value(a, 4), 9: state_value(a, 9)}})
    m = pool.match("", a[:10], ("target",))
    assert m.rows["target"] == 10 and [n for n, _ in m.checkpoints["target"]] == [4, 9]
    for n, st in m.checkpoints["target"]:
        assert all(np.array_equal(x, y) for x, y in zip(st, state_value(a, n)))
    b = np.concatenate([a[:6], [7, 8, 9]])  # diverges at 6: splits the edge [4, 9)
    pool.insert("", b, {"target": (9, source(b, "target"))}, {"target": {8: state_value(b, 8)}})
    m = pool.match("", a, ("target",))
    assert [n for n, _ in m.checkpoints["target"]] == [4, 9]
    assert all(np.array_equal(x, y) for x, y in zip(m.checkpoints["target"][1][1], state_value(a, 9)))
    m = pool.match("", b, ("target",))
    assert m.rows["target"] == 9 and [n for n, _ in m.checkpoints["target"]] == [4, 8]
    assert pool.match("", a[:3], ("target",)).checkpoints == {}  # none within 3 rows
    walked = sum(node.nbytes for node in pool._nodes())
    assert pool.nbytes == walked and walked > 0
    pool.resize(0)
    assert pool.nbytes == 0
