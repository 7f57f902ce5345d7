"""Seeded sampling that does not depend on speculation: per-position Gumbel-max noise.

With a seed s, the token at sequence position t (its index in prompt + output) is

    x_t = argmax_i  p_t(i) / E(s, t, i)        E(s, t, i) = -log U(s, t, i) ~ Exp(1)

where p_t is the sampling distribution of the target's row for position t (`probabilities`:
temperature, top-k, top-p, a grammar's mask, penalties) and U(s, t, i) in (0, 1) is a fixed
function of (seed, position, token id). argmax p / E is the exponential race, i.e. Gumbel-max
(log p - log E = log p + Gumbel), so x_t ~ p_t exactly; the noise of different positions is
independent, so the sequence is distributed as step-by-step sampling from the target.

For a fixed seed the output is a deterministic function of the prompt: speculation verifies it
like greedy decoding (`verify_seeded`: accept the drafted prefix that equals the seeded picks,
then emit the first pick that differs, or the bonus pick). A draft model drafts under the same
noise (its token is argmax q / E at the same position and token ids), so it agrees with the
target whenever its distribution is close; deterministic proposers (n-gram, suffix) are
verified unchanged. Any proposer, gamma, tree shape, batch or cache therefore gives the same
tokens for the same seed.

U comes from SplitMix64 with random access: U(s, t, i) is element i of the SplitMix64 stream
started at key(s, t) = mix(mix(s) + t), i.e. mix(key + (i + 1) * GOLDEN), top 53 bits, +1/2
ulp so that U lies in (0, 1) and E in (0, +inf). Only tokens with p > 0 are hashed.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import numpy as np

from .errors import InvalidArgument
from .sampling import sample

_MASK = (1 << 64) - 1
_BLOCK = 4096  # token ids raced at once by seeded_pick (temporaries of 32 KB)
_GOLDEN = 0x9E3779B97F4A7C15
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _mix(z: int) -> int:
    """SplitMix64's output function on a Python int in [0, 2^64)."""
    z = ((z ^ (z >> 30)) * _M1) & _MASK
    z = ((z ^ (z >> 27)) * _M2) & _MASK
    return z ^ (z >> 31)


def position_key(seed: int, position: int) -> int:
    """The 64-bit key of one position's noise: mix(mix(seed + GOLDEN) + position + GOLDEN)."""
    return _mix((_mix((seed + _GOLDEN) & _MASK) + position + _GOLDEN) & _MASK)


def uniforms(seed: int, position: int, ids: np.ndarray) -> np.ndarray:
    """U(seed, position, i) for token ids [n] (int, >= 0) -> [n] float64 in (0, 1)."""
    return _uniforms(position_key(seed, position), ids)


def _uniforms(key: int, ids: np.ndarray) -> np.ndarray:
    """Element i of the SplitMix64 stream at `key` for ids [n] -> [n] float64 in (0, 1)."""
    z = np.asarray(ids, dtype=np.uint64) + np.uint64(1)  # [n]
    z *= np.uint64(_GOLDEN)  # wraps mod 2^64 (array arithmetic: no overflow warning)
    z += np.uint64(key)
    t = np.empty_like(z)  # explicit temporaries: numpy's `z ^= z >> k` takes a slow overlap-safe path
    np.bitwise_xor(z, np.right_shift(z, np.uint64(30), out=t), out=z)
    z *= np.uint64(_M1)
    np.bitwise_xor(z, np.right_shift(z, np.uint64(27), out=t), out=z)
    z *= np.uint64(_M2)
    np.bitwise_xor(z, np.right_shift(z, np.uint64(31), out=t), out=z)
    # top 53 bits, through int64 (exact below 2^53), whose float conversion is vectorized
    u = np.right_shift(z, np.uint64(11), out=t).view(np.int64).astype(np.float64)
    u += 0.5
    u *= 1.0 / (1 << 53)
    return u


def seeded_pick(p: np.ndarray, seed: int, position: int) -> int:
    """The seeded token of one position: argmax over {i : p[i] > 0} of p[i] / -log U(seed,
    position, i). p: [V] >= 0 (need not sum to 1). Distributed as p over seeds (or positions).

    A wide support is raced in blocks of _BLOCK token ids (small temporaries, no allocation the
    size of the vocabulary), and a logarithm is taken only where a token can still win: with
    `best` the best race so far (first the most probable token's), token i can beat it only if
    p[i] / -log U > best, which needs p[i] > best (1 - U) since -log U >= 1 - U. The result is
    the exact argmax of the whole race (first index on a tie, which has probability zero)."""
    p = np.asarray(p)
    positive = p > 0  # [V] bool
    n = int(np.count_nonzero(positive))
    if n == 0 or not np.all(np.isfinite(p)):
        raise InvalidArgument("a seeded pick needs a row with positive, finite mass")
    key = position_key(seed, position)
    if n <= _BLOCK:  # a filtered row (top-k, top-p, min-p, a grammar): race its support at once
        ids = np.flatnonzero(positive)  # [n]
        race = p[ids].astype(np.float64) / -np.log(_uniforms(key, ids))
        return int(ids[int(race.argmax())])
    top = int(p.argmax())
    winner = top
    best = float(p[top]) / -math.log(float(_uniforms(key, np.array([top]))[0]))
    for b0 in range(0, p.size, _BLOCK):
        pb = p[b0 : b0 + _BLOCK].astype(np.float64)  # [<= _BLOCK]
        u = _uniforms(key, np.arange(b0, b0 + pb.size))
        cand = np.flatnonzero(pb > best * (1.0 - u))  # [m] the tokens that may still win
        if cand.size:
            race = pb[cand] / -np.log(u[cand])
            j = int(race.argmax())
            if race[j] > best:
                best, winner = float(race[j]), b0 + int(cand[j])
    return winner


class SeededNoise:
    """A request's seed stream: the loop's `rng` when a request samples with a seed. It has no
    `random()`: every draw of a seeded request is a `pick` at a position, so a code path that
    would consume a sequential stream fails loudly instead of depending on speculation."""

    def __init__(self, seed: int):
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
            raise InvalidArgument(f"seed must be an integer >= 0, got {seed!r}")
        self.seed = int(seed)

    def pick(self, p: np.ndarray, position: int) -> int:
        """The token at sequence `position` from distribution p [V] (seeded_pick)."""
        return seeded_pick(p, self.seed, position)

    def __repr__(self) -> str:
        return f"SeededNoise(seed={self.seed})"


def draw(q: np.ndarray, rng, position: int) -> int:
    """A proposer's draft token from q [V] at sequence `position`: under the request's seed noise
    (SeededNoise) or, otherwise, an ordinary sample from rng (a numpy Generator)."""
    return rng.pick(q, position) if isinstance(rng, SeededNoise) else sample(q, rng)


def verify_seeded(p: np.ndarray, draft_tokens: Sequence[int], noise: SeededNoise, start: int) -> tuple[int, int]:
    """Seeded verification of one chain: p [k+1, V] the target's sampling rows of a call on
    [last, d1..dk], whose row j draws the token at position start + j. Accepts the longest
    prefix of d equal to the seeded picks; returns (n accepted, the pick of row n): the first
    pick that differs (a correction), or the bonus pick of row k. Rows after n are not picked."""
    d = [int(t) for t in draft_tokens]
    if np.shape(p)[0] != len(d) + 1:
        raise InvalidArgument(f"p must have gamma+1 = {len(d) + 1} rows, got {np.shape(p)[0]}")
    for j in range(len(d) + 1):
        token = noise.pick(p[j], start + j)
        if j == len(d) or token != d[j]:
            return j, token
    raise AssertionError("unreachable")


def tree_picks(p: np.ndarray, depths: np.ndarray, noise: SeededNoise, start: int) -> np.ndarray:
    """The seeded pick of every row of a tree call: p [R, V] (row 0 the root), depths [R] each
    row's depth (root 0); a row at depth d draws the token at position start + d. -> [R] int64,
    which tree.verify_tree_greedy verifies like an argmax."""
    return np.array([noise.pick(p[r], start + int(depths[r])) for r in range(len(depths))], dtype=np.int64)


def stream_for(seed: int | None, temperature: float, seeded_noise: bool = True):
    """The loop's rng: SeededNoise for a seeded sampled request (seeded_noise), else a numpy
    Generator seeded with `seed` (fresh entropy when None)."""
    if seed is not None and temperature > 0 and seeded_noise:
        return SeededNoise(seed)
    return np.random.default_rng(seed)
