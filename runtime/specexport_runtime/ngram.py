"""Prompt-lookup proposer: draft tokens by copying what followed an earlier match.

Like "prompt lookup decoding": take the last n tokens of the history, find their most
recent EARLIER occurrence (in the prompt or in generated text) and propose the tokens that
followed it. Larger n is tried first. The proposer is deterministic (q one-hot), so the
verifier compares its drafts by index (sampling.verify_deterministic) and stays exact under
sampling.

Index invariant: after the history has length L, index[n] maps every n-gram that ENDS
before L (exclusive end e <= L - 1) to the largest such e. The suffix n-gram (exclusive end
L) is therefore not in the index, so a lookup returns its most recent earlier occurrence
and tokens[e] always exists: a match proposes at least one token. Appending one token adds
one n-gram per n, so extend is O(len(new) * sum(ngram_sizes)) and propose is O(n + gamma).
"""

from __future__ import annotations

import numbers
import operator

from .constants import DEFAULT_MAX_GAMMA, DEFAULT_NGRAM_SIZES
from .errors import InvalidArgument


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _as_tokens(tokens, what: str) -> list[int]:
    out = []
    for t in tokens:
        try:
            v = operator.index(t)
        except TypeError:
            raise InvalidArgument(f"{what} must be integer token ids, got {t!r}") from None
        if v < 0:
            raise InvalidArgument(f"{what} must be token ids >= 0, got {v}")
        out.append(v)
    return out


class NgramProposer:
    """Proposes up to min(gamma, max_gamma) tokens by n-gram lookup in the history."""

    def __init__(self, ngram_sizes=DEFAULT_NGRAM_SIZES, max_gamma: int = DEFAULT_MAX_GAMMA) -> None:
        sizes = tuple(ngram_sizes)
        if not sizes:
            raise InvalidArgument("ngram_sizes must name at least one n-gram size, got ()")
        for n in sizes:
            if not _is_int(n) or n < 1:
                raise InvalidArgument(f"ngram_sizes must be integers >= 1, got {sizes!r}")
        sizes = tuple(int(n) for n in sizes)
        if len(set(sizes)) != len(sizes):
            raise InvalidArgument(f"ngram_sizes must not repeat a size, got {sizes!r}")
        if not _is_int(max_gamma) or max_gamma < 1:
            raise InvalidArgument(f"max_gamma must be an integer >= 1, got {max_gamma!r}")
        self.ngram_sizes: tuple[int, ...] = tuple(sorted(sizes, reverse=True))  # largest first
        self.max_gamma = int(max_gamma)
        self._tokens: list[int] = []
        # n -> {n-gram: latest exclusive end e, with e <= len(tokens) - 1}
        self._index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.ngram_sizes}

    @property
    def tokens(self) -> tuple[int, ...]:
        """The history (prompt + accepted tokens)."""
        return tuple(self._tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    def reset(self, tokens) -> None:
        """Start a new sequence with the prompt ids."""
        self._tokens = []
        self._index = {n: {} for n in self.ngram_sizes}
        self.extend(tokens)

    def extend(self, new_tokens) -> None:
        """Append accepted tokens to the history and index the n-grams they complete."""
        new = _as_tokens(new_tokens, "new_tokens")
        toks = self._tokens
        for t in new:
            end = len(toks)  # the n-grams ending just before t stop being the suffix now
            for n, index in self._index.items():
                if end >= n:
                    index[tuple(toks[end - n : end])] = end
            toks.append(t)

    def propose(self, gamma: int) -> list[int]:
        """Up to min(gamma, max_gamma) tokens that followed the most recent earlier
        occurrence of the longest matching suffix n-gram; [] when nothing matches."""
        return self.match(gamma)[1]

    def match(self, gamma: int) -> tuple[int, list[int]]:
        """(n, tokens): the size of the longest suffix n-gram that occurred earlier and up to
        min(gamma, max_gamma) tokens that followed it; (0, []) when nothing matches."""
        if not _is_int(gamma) or gamma < 0:
            raise InvalidArgument(f"gamma must be an integer >= 0, got {gamma!r}")
        g = min(int(gamma), self.max_gamma)
        toks = self._tokens
        L = len(toks)
        if g == 0:
            return 0, []
        for n in self.ngram_sizes:
            if L <= n:  # an earlier occurrence needs at least n + 1 tokens
                continue
            e = self._index[n].get(tuple(toks[L - n :]))
            if e is not None:
                return n, toks[e : e + g]
        return 0, []
