"""A bounded pool of cached K/V rows keyed by token prefix: a radix tree over token ids.

Each node holds an edge (the token ids from its parent) and, per part (a model whose cache the
pool keeps: "target", "draft"), that model's K/V rows of the edge's tokens as one array
    rows[part]: [B, r, H_kv, D]   B = 2 x layers buffers (K0, V0, K1, V1, ...), r <= len(edge)
Invariants:
- The rows of a part are contiguous from the root: a node has rows of a part only if every node
  above it holds that part's full edge, and a node holding fewer rows than its edge (r < n) has no
  descendant with that part. So a path gives, per part, the rows of one prefix [0, R).
- Row t of a part is the K/V that model computed for token ids[t] at position t after ids[:t].
  Since attention is causal it depends on ids[:t + 1] only, which is what the path spells.
- Trees are per namespace (a `cache_salt`, e.g. an API key): a prefix is never matched across
  namespaces. Every namespace shares the one byte bound and the one LRU clock.
- `nbytes` is the sum of every node's row arrays (each a copy owned by the pool, never a view of
  a model's buffer); after `insert` it is at most `max_bytes`: leaves are evicted least recently
  used first (a node's use: the last lookup or insert whose path went through it).
- A hybrid model's part may also hold, at a node, its recurrent state after the node's last id
    states[part]: [arrays [1, *s_j], one per state site]   (a checkpoint at that prefix length)
  A stateful part's rows are only usable up to a checkpoint on the path (Match.checkpoints), so an
  insert ends a node wherever a checkpoint falls (splitting an edge), and a split leaves the
  checkpoint with the lower node, which still ends where it was taken.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from .errors import InvalidArgument

# part -> f(start, stop) -> [B, stop - start, H_kv, D], a copy of that model's rows
RowSource = Callable[[int, int], np.ndarray]


@dataclass(eq=False)
class Node:
    tokens: np.ndarray  # int64 [n]: the edge from the parent
    parent: Node | None
    children: dict[int, Node] = field(default_factory=dict)  # first token of a child's edge -> child
    rows: dict[str, np.ndarray] = field(default_factory=dict)  # part -> [B, r, H_kv, D], r <= n
    states: dict[str, list[np.ndarray]] = field(default_factory=dict)  # part -> its state after the edge's last id
    used: int = 0  # LRU clock of the last lookup or insert through this node
    namespace: str = ""

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.rows.values()) + sum(a.nbytes for v in self.states.values() for a in v)

    def covered(self, part: str) -> int:
        """Rows of `part` this node holds (0..len(tokens))."""
        a = self.rows.get(part)
        return 0 if a is None else a.shape[1]


@dataclass(frozen=True)
class Match:
    """The longest cached prefix of a lookup: `tokens` ids matched, and per part the nodes and
    row counts that hold its rows [0, rows[part]) (rows[part] <= tokens)."""

    tokens: int
    rows: Mapping[str, int]
    segments: tuple[tuple[Node, int], ...]  # (node, ids of its edge on the matched path), root first
    # part -> (length, states) of each checkpoint within its rows, shortest first (stateful parts)
    checkpoints: Mapping[str, tuple[tuple[int, list[np.ndarray]], ...]] = field(default_factory=dict)


@dataclass
class PoolStats:
    lookups: int = 0
    hits: int = 0  # lookups that reused at least one row of the target
    prompt_tokens: int = 0  # prompt ids of every lookup
    cached_tokens: int = 0  # target rows reused (prefill skipped)
    inserts: int = 0
    evictions: int = 0  # nodes evicted for the byte bound
    evicted_tokens: int = 0  # their edges' ids


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two int64 vectors."""
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


class PrefixPool:
    """The radix tree (module docstring) with its byte bound and statistics."""

    def __init__(self, max_bytes: int):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise InvalidArgument(f"the prefix pool's max_bytes must be an integer >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.roots: dict[str, Node] = {}
        self.nbytes = 0
        self.nodes = self.tokens = 0  # nodes and the ids of their edges (kept as counts: describe() never walks)
        self.clock = 0
        self.stats = PoolStats()

    def _root(self, namespace: str) -> Node:
        if namespace not in self.roots:
            self.roots[namespace] = Node(np.zeros(0, np.int64), None, namespace=namespace)
        return self.roots[namespace]

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    # --- lookup ------------------------------------------------------------------------------
    def match(self, namespace: str, ids, parts: tuple[str, ...]) -> Match:
        """The longest prefix of `ids` the pool holds in `namespace`, and each part's rows of it;
        marks the path used."""
        ids = np.asarray(ids, np.int64)
        node, pos, now = self.roots.get(namespace), 0, self._tick()
        segments: list[tuple[Node, int]] = []
        while node is not None and pos < ids.size:
            child = node.children.get(int(ids[pos]))
            if child is None:
                break
            c = _common(child.tokens, ids[pos:])
            child.used = now
            segments.append((child, c))
            pos += c
            if c < child.tokens.size:
                break
            node = child
        rows, checkpoints = {}, {}
        for part in parts:
            total, points = 0, []
            for seg, used in segments:
                have = min(seg.covered(part), used)
                total += have
                if have < seg.tokens.size:  # the part's rows end here
                    break
                if part in seg.states:
                    points.append((total, seg.states[part]))
            rows[part] = total
            if points:
                checkpoints[part] = tuple(points)
        return Match(pos, rows, tuple(segments), checkpoints)

    @staticmethod
    def read(match: Match, part: str, stop: int, write: Callable[[int, np.ndarray], None]) -> None:
        """Hand the rows [0, stop) of `part` (stop <= match.rows[part]) to write(start, rows), one
        call per node: rows [B, n, H_kv, D] are the pool's own arrays (read them, do not keep them)."""
        if stop > match.rows.get(part, 0):
            raise InvalidArgument(f"the match holds {match.rows.get(part, 0)} rows of {part!r}, not {stop}")
        pos = 0
        for node, _ in match.segments:
            if pos >= stop:
                break
            n = min(node.covered(part), stop - pos)
            write(pos, node.rows[part][:, :n])
            pos += n

    # --- insert and evict --------------------------------------------------------------------
    def insert(
        self,
        namespace: str,
        ids,
        sources: Mapping[str, tuple[int, RowSource]],
        checkpoints: Mapping[str, Mapping[int, list[np.ndarray]]] | None = None,
    ) -> None:
        """Keep the rows [0, count) of each part (sources: part -> (count, rows of [start, stop)))
        under the ids (their first max(count) ids are the key); only rows the pool lacks are read.
        checkpoints: part -> {length: states} of stateful parts (length <= the part's count; the
        states are copied). Then evict to the byte bound."""
        ids = np.asarray(ids, np.int64)
        length = min(ids.size, max((count for count, _ in sources.values()), default=0))
        if length == 0 or self.max_bytes == 0:
            return
        self.stats.inserts += 1
        now = self._tick()
        node, pos = self._root(namespace), 0
        full = dict.fromkeys(sources, True)  # the part's rows are contiguous from the root to `node`
        points = {(n, part): st for part, by in (checkpoints or {}).items() for n, st in by.items() if 0 < n <= length}
        cuts = sorted({n for n, _ in points})
        while pos < length:
            end = next((n for n in cuts if n > pos), length)  # a node ends at each checkpoint
            child = node.children.get(int(ids[pos]))
            if child is None:
                child = Node(ids[pos:end].copy(), node, used=now, namespace=namespace)
                node.children[int(ids[pos])] = child
                self.nodes, self.tokens = self.nodes + 1, self.tokens + child.tokens.size
            else:
                c = _common(child.tokens, ids[pos:end])
                if c < child.tokens.size:
                    child = self._split(child, c)
                child.used = now
            self._fill(child, pos, sources, full)
            pos += child.tokens.size
            for (n, part), st in points.items():
                if n == pos and full.get(part) and part not in child.states:
                    child.states[part] = [np.array(a, copy=True) for a in st]
                    self.nbytes += sum(a.nbytes for a in child.states[part])
            node = child
        self._evict(protect=None)

    def _fill(self, node: Node, start: int, sources: Mapping[str, tuple[int, RowSource]], full: dict) -> None:
        """Give `node` (edge at ids [start, start + n)) the rows its parts lack, where the parts'
        rows reach it; update `full` for the nodes below."""
        n = node.tokens.size
        for part, (count, source) in sources.items():
            have = node.covered(part)
            want = min(n, max(0, count - start)) if full[part] else 0
            if want > have:
                old = node.rows.get(part)
                node.rows[part] = np.ascontiguousarray(source(start, start + want))  # [B, want, H_kv, D]
                self.nbytes += node.rows[part].nbytes - (0 if old is None else old.nbytes)
                have = want
            full[part] = full[part] and have == n

    def _split(self, node: Node, at: int) -> Node:
        """Cut `node`'s edge after `at` ids: returns the new upper node (edge [:at]); the lower
        keeps the rest, its rows and children. Rows are copied, so each array is owned once."""
        parent = node.parent
        upper = Node(node.tokens[:at].copy(), parent, used=node.used, namespace=node.namespace)
        before = node.nbytes
        for part, a in list(node.rows.items()):
            upper.rows[part] = a[:, :at].copy()
            if a.shape[1] > at:
                node.rows[part] = a[:, at:].copy()
            else:
                del node.rows[part]
        self.nbytes += upper.nbytes + node.nbytes - before
        self.nodes += 1
        parent.children[int(upper.tokens[0])] = upper
        node.tokens = node.tokens[at:].copy()
        node.parent = upper
        upper.children[int(node.tokens[0])] = node
        return upper

    def _nodes(self):
        stack = [c for r in self.roots.values() for c in r.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _evict(self, protect: Node | None) -> None:
        """Drop least recently used leaves until nbytes <= max_bytes."""
        while self.nbytes > self.max_bytes:
            leaves = [n for n in self._nodes() if not n.children and n is not protect]
            if not leaves:
                return
            self.remove(min(leaves, key=lambda n: n.used))

    def remove(self, node: Node) -> None:
        """Evict a leaf."""
        if node.children:
            raise InvalidArgument("only a leaf of the prefix pool can be evicted")
        self.nbytes -= node.nbytes
        self.nodes, self.tokens = self.nodes - 1, self.tokens - node.tokens.size
        self.stats.evictions += 1
        self.stats.evicted_tokens += int(node.tokens.size)
        del node.parent.children[int(node.tokens[0])]
        if node.parent.parent is None and not node.parent.children:
            self.roots.pop(node.parent.namespace, None)

    def resize(self, max_bytes: int) -> None:
        """A new byte bound, enforced at once."""
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise InvalidArgument(f"the prefix pool's max_bytes must be an integer >= 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._evict(protect=None)

    def clear(self) -> None:
        self.roots.clear()
        self.nbytes = self.nodes = self.tokens = 0

    def describe(self) -> dict:
        """What /metrics and the stats report (counts only: safe to call from another thread)."""
        s = self.stats
        return {
            "bytes": self.nbytes,
            "max_bytes": self.max_bytes,
            "nodes": self.nodes,
            "tokens": int(self.tokens),
            "namespaces": len(self.roots),
            "lookups": s.lookups,
            "hits": s.hits,
            "prompt_tokens": s.prompt_tokens,
            "cached_tokens": s.cached_tokens,
            "token_hit_rate": s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
            "request_hit_rate": s.hits / s.lookups if s.lookups else 0.0,
            "inserts": s.inserts,
            "evictions": s.evictions,
            "evicted_tokens": s.evicted_tokens,
        }
