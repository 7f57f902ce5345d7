"""A static corpus datastore for retrieval drafts (REST-style): the longest suffix of the recent
tokens that occurs in the corpus, then the most frequent continuation chain among its
occurrences (suffix.draft_chain, the same rule as the suffix proposer's).

On disk (built by specexport.build.datastore): `tokens` int32 [N], the corpus tokenized with the
artifact's tokenizer, documents separated by SEP (-1); `suffix_array` int32/int64 [N], the
suffix array of the REVERSED token array. Matching a context backwards is then matching the
reversed context forwards, so the occurrences of context[-m-1:] are a sub-range of those of
context[-m:]: the range narrows one token at a time (two binary searches over one column each),
never restarting. Both arrays are memory-mapped, never held whole: opening streams the tokens
once to count each token id, which gives the first token's range directly (the column at depth
0 is sorted by token id, SEP first), so the widest search, over all N suffixes, costs nothing.

    rev[j] = tokens[N - 1 - j];  rev suffix at j matches reversed(context)[:m]
    <=> tokens[N - m - j .. N - 1 - j] == context[-m:]  (the match ends at e = N - 1 - j)
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .drafts import SuffixConfig
from .errors import ArtifactError
from .suffix_index import MAX_CANDIDATES, SEP, Occurrences, draft

VECTOR_RANGE = 4096  # below this many candidates, a column is gathered and searched with numpy
COUNT_CHUNK = 1 << 20  # tokens counted per step when the first-token table is made


class Datastore:
    def __init__(self, tokens: np.ndarray, suffix_array: np.ndarray):
        """tokens int32 [N] (may be a memmap); suffix_array [N] of the reversed tokens."""
        if tokens.ndim != 1 or suffix_array.shape != tokens.shape or tokens.dtype != np.int32:
            raise ArtifactError(
                f"datastore arrays must be int32 tokens [N] and a suffix array [N], got "
                f"{tokens.dtype} {list(tokens.shape)} and {suffix_array.dtype} {list(suffix_array.shape)}"
            )
        self.tokens, self.sa = tokens, suffix_array
        self.n = int(tokens.shape[0])
        # plain ndarray views of the same mapped memory: numpy.memmap's __getitem__ costs ~1 us a call
        self._sa = suffix_array.view(np.ndarray)
        self.rev = tokens.view(np.ndarray)[::-1]  # rev[j] = tokens[N - 1 - j]
        self.first = _first_token_starts(tokens)  # [V + 1]: token t starts the rows first[t]:first[t + 1]

    @classmethod
    def open(cls, tokens_path: Path, suffix_array_path: Path) -> Datastore:
        try:
            tokens = np.load(tokens_path, mmap_mode="r", allow_pickle=False)
            sa = np.load(suffix_array_path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise ArtifactError(
                f"datastore {tokens_path.name} / {suffix_array_path.name} is not readable: {exc}"
            ) from exc
        return cls(tokens, sa)

    def _column(self, lo: int, hi: int, depth: int) -> np.ndarray:
        """Token `depth` of the reversed suffixes sa[lo:hi] (SEP past the end)."""
        pos = np.asarray(self._sa[lo:hi], np.int64) + depth
        out = np.full(hi - lo, SEP, np.int64)
        ok = pos < self.n
        out[ok] = self.rev[pos[ok]]
        return out

    def _token(self, i: int, depth: int) -> int:
        p = int(self._sa[i]) + depth
        return int(self.rev[p]) if p < self.n else SEP

    def _narrow(self, lo: int, hi: int, depth: int, token: int) -> tuple[int, int]:
        """The sub-range of [lo, hi) whose reversed suffixes have `token` at `depth` (sorted there)."""
        if hi - lo <= VECTOR_RANGE:
            col = self._column(lo, hi, depth)
            return lo + int(np.searchsorted(col, token, "left")), lo + int(np.searchsorted(col, token, "right"))
        column = range(lo, hi)  # sorted by the token at `depth` within [lo, hi): two binary searches

        def key(i: int) -> int:
            return self._token(i, depth)

        return bisect.bisect_left(column, token, key=key) + lo, bisect.bisect_right(column, token, key=key) + lo

    def match(self, context: Sequence[int], max_depth: int) -> tuple[int, int, int]:
        """(m, lo, hi): the longest m <= max_depth with context[-m:] in the corpus, and the
        suffix-array range of its occurrences; (0, 0, 0) when even the last token is absent."""
        if not context or max_depth < 1 or not 0 <= (last := int(context[-1])) < self.first.size - 1:
            return 0, 0, 0
        lo, hi = int(self.first[last]), int(self.first[last + 1])
        if lo >= hi:
            return 0, 0, 0
        m = 1
        for depth in range(1, min(max_depth, len(context))):
            a, b = self._narrow(lo, hi, depth, int(context[-1 - depth]))
            if a >= b:
                break
            lo, hi, m = a, b, depth + 1
        return m, lo, hi

    def occurrences(self, context: Sequence[int], config: SuffixConfig) -> Occurrences | None:
        m, lo, hi = self.match(context, config.max_depth)
        if m == 0:
            return None
        hi = min(hi, lo + MAX_CANDIDATES)  # bound the cost: the first occurrences in suffix order
        ends = self.n - 1 - np.asarray(self._sa[lo:hi], np.int64)  # forward index of each match's last token
        return Occurrences(m, self.rev[::-1], ends, self.n)

    def propose(self, context: Sequence[int], config: SuffixConfig, room: int) -> tuple[list[int], float, int]:
        """(tokens, score, match length) by suffix_index.draft_chain over the occurrences."""
        return draft(self.occurrences(context, config), config, room)[:3]

    def describe(self) -> dict:
        return {"tokens": self.n, "bytes": int(self.tokens.nbytes + self.sa.nbytes)}


def _first_token_starts(tokens: np.ndarray) -> np.ndarray:
    """first int64 [V + 1]: the suffixes starting with token t (t >= 0) are rows first[t]:first[t + 1]
    of the suffix array (rows below first[0] start with SEP); counted COUNT_CHUNK tokens at a time."""
    counts = np.zeros(0, np.int64)
    seps = 0
    for at in range(0, tokens.shape[0], COUNT_CHUNK):
        chunk = np.asarray(tokens[at : at + COUNT_CHUNK])
        ids = chunk[chunk >= 0]
        seps += chunk.size - ids.size
        part = np.bincount(ids, minlength=counts.size)
        part[: counts.size] += counts
        counts = part
    return np.concatenate([[seps], seps + np.cumsum(counts)]).astype(np.int64)


__all__ = ["Datastore"]
