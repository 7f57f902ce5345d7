"""Token sampling and the verification step of exact speculative decoding.

Notation follows Leviathan et al. (2023) and Chen et al. (2023):
    p         target distribution, one row per verified position   [gamma+1, V] float64
    q         draft distribution, one row per drafted token        [gamma, V]   float64
    d         drafted tokens, d_i ~ q_i                            [gamma]      int
    residual  norm(max(0, p - q)), sampled from on a rejection

A round drafts gamma tokens, runs the target once over them (gamma+1 logits rows) and emits
n_accepted + 1 tokens: the accepted prefix of d plus either a correction (first rejection)
or a bonus token (all accepted). The emitted tokens are distributed exactly as if they had
been sampled one by one from the target with the same SamplingParams.

Exactness needs p and q to be the distributions the tokens are actually sampled from, so
`probabilities` (temperature, top-k, top-p) must be applied identically to target and draft
rows. A deterministic draft (q None: lookup, suffix, a grammar's forced run) is q one-hot at
each token, and is verified by index (verify_deterministic) without building those rows.

Everything here is on the hot path of the decoding loop (V ~ 49k-152k): no Python loops over
the vocabulary; the only Python loop is over the gamma drafted positions.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from .errors import InvalidArgument

# Nucleus candidates sorted when top_k is off: the top-p threshold is searched among the
# largest _NUCLEUS_CANDIDATES probabilities first (argpartition, O(V)); the candidates are
# widened x8 while their mass does not reach top_p (flat distributions), up to the full row.
_NUCLEUS_CANDIDATES = 1024


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are drawn. temperature 0 is greedy (top_k/top_p/min_p are then ignored).

    top_k = 0 disables top-k; top_p = 1.0 disables top-p; min_p = 0 disables min-p (keep the
    tokens with at least min_p times the top token's probability). seed None draws fresh entropy.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    min_p: float = 0.0

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not math.isfinite(t) or t < 0:
            raise InvalidArgument(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0:
            raise InvalidArgument(f"top_k must be an integer >= 0 (0 = off), got {k!r}")
        tp = self.top_p
        if isinstance(tp, bool) or not isinstance(tp, numbers.Real) or not (0.0 < tp <= 1.0):
            raise InvalidArgument(f"top_p must be a number in (0, 1] (1 = off), got {tp!r}")
        mp = self.min_p
        if isinstance(mp, bool) or not isinstance(mp, numbers.Real) or not (0.0 <= mp < 1.0):
            raise InvalidArgument(f"min_p must be a number in [0, 1) (0 = off), got {mp!r}")
        s = self.seed
        if s is not None and (isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 0):
            raise InvalidArgument(f"seed must be None or an integer >= 0, got {s!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def rng(self) -> np.random.Generator:
        """A fresh generator seeded with `seed` (fresh entropy when seed is None)."""
        return np.random.default_rng(self.seed)


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Sampling distribution of each logits row: temperature, then top-k, then top-p, then min-p.

    logits: [R, V] (float32 from the graph) -> probs [R, V] float64, rows sum to 1.
    top-k keeps every token whose logit is >= the k-th largest (ties at the boundary are
    all kept, so the result does not depend on token order). top-p keeps the smallest set of
    most probable tokens whose mass reaches top_p (always at least the top token), again
    keeping every token tied with the last one kept. min-p then keeps the tokens whose probability
    is at least min_p times the top token's (the top token always stays). Raises InvalidArgument for greedy
    params (use argmax) and for rows with no finite logit (or NaN / +inf).
    """
    if params.greedy:
        raise InvalidArgument("probabilities() needs temperature > 0; greedy decoding uses argmax")
    logits = np.asarray(logits)
    if logits.ndim != 2 or logits.shape[1] == 0:
        raise InvalidArgument(f"logits must have shape [R, V] with V > 0, got {logits.shape}")
    R, V = logits.shape
    t = float(params.temperature)
    top_p = float(params.top_p)
    k = params.top_k if 0 < params.top_k < V else 0

    if k:
        # Dividing by t > 0 in float64 keeps the order and the ties of the logits, so the
        # cut is found on the raw logits. Fast path: exp and sort only the k candidates.
        top = np.argpartition(logits, V - k, axis=1)[:, V - k :]  # [R, k] unordered
        top_logits = np.take_along_axis(logits, top, axis=1)  # [R, k]
        kth = top_logits.min(axis=1, keepdims=True)  # [R, 1]
        # no other token ties the k-th (NaN rows fail this too and take the checked path)
        if np.count_nonzero(logits >= kth) == R * k:
            z = top_logits.astype(np.float64)  # [R, k]
            z /= t
            _softmax_numerator(z)
            if top_p < 1.0:
                _apply_nucleus(z, z, top_p)
            if params.min_p > 0:  # rows have max 1 (_softmax_numerator), which every filter keeps
                np.putmask(z, z < params.min_p, 0.0)
            z /= z.sum(axis=1, keepdims=True)
            out = np.zeros((R, V), dtype=np.float64)  # [R, V]
            np.put_along_axis(out, top, z, axis=1)
            return out

    x = logits.astype(np.float64)  # [R, V] float64, the only full-size allocation
    x /= t
    if k:  # ties at the top-k cut: keep all of them
        np.putmask(x, x < (kth.astype(np.float64) / t), -np.inf)  # exp(-inf) = 0 below
    _softmax_numerator(x)
    if top_p < 1.0:
        target_mass = top_p * x.sum(axis=1)  # [R]
        m = _NUCLEUS_CANDIDATES
        while True:  # widen the candidates (x8) until they hold the nucleus of every row
            if m >= V:
                cand = x  # sort the full rows
                break
            idx = np.argpartition(x, V - m, axis=1)[:, V - m :]  # [R, m]
            cand = np.take_along_axis(x, idx, axis=1)  # [R, m]
            if np.all(cand.sum(axis=1) >= target_mass):
                break
            m *= 8
        _apply_nucleus(x, cand, top_p)
    if params.min_p > 0:
        np.putmask(x, x < params.min_p, 0.0)
    x /= x.sum(axis=1, keepdims=True)
    return x


def softmax(logits: np.ndarray) -> np.ndarray:
    """[R, V] logits -> float64 probabilities at temperature 1 (a draft's own law); InvalidArgument
    for a row without a finite maximum."""
    x = np.array(logits, dtype=np.float64)  # [R, V] a copy
    _softmax_numerator(x)
    x /= x.sum(axis=1, keepdims=True)
    return x


def _softmax_numerator(z: np.ndarray) -> None:
    """In place z := exp(z - rowmax(z)) for z [R, n] float64; every row then has max 1.

    Raises InvalidArgument for rows whose maximum is not finite (NaN, +inf or all -inf).
    """
    row_max = z.max(axis=1, keepdims=True)  # [R, 1], NaN if the row holds a NaN
    if not np.all(np.isfinite(row_max)):
        raise InvalidArgument("every logits row needs a finite maximum (got NaN, +inf or all -inf)")
    z -= row_max
    np.exp(z, out=z)


def _apply_nucleus(x: np.ndarray, cand: np.ndarray, top_p: float) -> None:
    """In place top-p on unnormalised probabilities x [R, n]: zero every entry below the
    threshold, the smallest kept probability.

    cand [R, m] holds the largest entries of each row of x (cand may be x itself), enough of
    them to reach top_p of the row's mass, or all of the row's nonzero entries. Ties with
    the threshold are kept.
    """
    target_mass = top_p * x.sum(axis=1, keepdims=True)  # [R, 1]
    desc = np.sort(cand, axis=1)[:, ::-1]  # [R, m] descending (a view of the sorted copy)
    csum = np.cumsum(desc, axis=1)  # [R, m] non-decreasing
    # first sorted position whose cumulative mass reaches top_p; rounding may leave the
    # whole row short of it, then the last candidate is the threshold (keep everything).
    j = np.minimum((csum < target_mass).sum(axis=1), desc.shape[1] - 1)  # [R]
    threshold = desc[np.arange(desc.shape[0]), j][:, None]  # [R, 1]
    np.putmask(x, x < threshold, 0.0)


def pad_vocab(q: np.ndarray, rows: int) -> np.ndarray:
    """Append zero columns so a draft with fewer embedding rows lines up with the target.

    q: [..., Vq] -> [..., rows]; returned unchanged (no copy) when Vq == rows.
    """
    q = np.asarray(q)
    vq = q.shape[-1]
    if vq > rows:
        raise InvalidArgument(f"draft vocabulary ({vq} rows) is larger than the target's ({rows} rows)")
    if vq == rows:
        return q
    out = np.zeros(q.shape[:-1] + (rows,), dtype=q.dtype)
    out[..., :vq] = q
    return out


def one_hot(tokens, rows: int) -> np.ndarray:
    """tokens [n] -> [n, rows] float64, 1 at each token: the q rows a deterministic draft stands
    for (a reference for tests; the loop verifies such drafts by index, verify_deterministic)."""
    t = np.asarray(tokens, dtype=np.int64).reshape(-1)  # [n]
    if t.size and (t.min() < 0 or t.max() >= rows):
        raise InvalidArgument(f"token ids must lie in [0, {rows}), got {t.tolist()}")
    out = np.zeros((t.size, rows), dtype=np.float64)
    out[np.arange(t.size), t] = 1.0
    return out


def accept_probability(p_x: float, q_x: float) -> float:
    """min(1, p(x) / q(x)): probability of keeping a drafted token x.

    Guard q(x) == 0: returns 1.0 when p(x) > 0 and 0.0 when p(x) == 0. A token with q(x) == 0
    is proposed with probability zero, so this value carries no mass in the analytic output
    distribution q(x)·min(1, p(x)/q(x)) + ... = p(x) and any choice keeps the step exact.
    1.0 is the limit of min(1, p/q) as q -> 0+, which is the right answer when q(x) is
    zero only through rounding (underflow in float64) while the draft did propose x; 0.0 for
    p(x) == 0 means a token the target can never emit is never accepted.
    """
    if q_x <= 0.0:
        return 1.0 if p_x > 0.0 else 0.0
    return min(1.0, float(p_x) / float(q_x))


def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """norm(max(0, p - q)): where to sample the correction after a rejection.

    p, q: [V] float64 -> [V] float64 summing to 1. Guard: when the positive part sums to 0
    (p == q, so a rejection has probability 0 and never happens in exact arithmetic) p is
    returned. A positive part made of rounding noise is still supported only where p > q >= 0.
    """
    r = np.subtract(p, q)  # [V]
    np.maximum(r, 0.0, out=r)
    s = r.sum()
    if not s > 0.0:  # also catches NaN
        return np.asarray(p, dtype=np.float64)
    r /= s
    return r


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one token from probs [V] (>= 0, need not sum exactly to 1) by inverse CDF.

    Zero-probability tokens are never returned, even when the uniform draw rounds up to the
    total mass.
    """
    cdf = np.cumsum(probs)  # [V] non-decreasing
    total = cdf[-1] if cdf.size else 0.0
    if not (total > 0.0 and math.isfinite(total)):
        raise InvalidArgument(f"probabilities must have a positive finite sum, got {total!r}")
    u = rng.random() * total  # in [0, total]
    i = int(np.searchsorted(cdf, u, side="right"))  # first index with cdf > u
    if i >= cdf.size:  # u rounded up to total: take the last token with positive mass
        i = int(np.searchsorted(cdf, total, side="left"))
    return i


def verify_greedy(target_argmax, draft_tokens) -> tuple[int, int]:
    """Greedy verification: accept the longest prefix where draft == target argmax.

    target_argmax: [gamma+1] int, argmax of each target row; draft_tokens: [gamma] int.
    Returns (n_accepted, next_token): next is the argmax at the first mismatch, or the bonus
    target_argmax[gamma] when all gamma tokens are accepted.
    """
    a = np.asarray(target_argmax).reshape(-1)  # [gamma+1]
    d = np.asarray(draft_tokens).reshape(-1)  # [gamma]
    gamma = d.size
    if a.size != gamma + 1:
        raise InvalidArgument(f"target_argmax must have gamma+1 = {gamma + 1} entries, got {a.size}")
    mismatch = a[:gamma] != d  # [gamma] bool
    n = int(mismatch.argmax()) if mismatch.any() else gamma
    return n, int(a[n])


def _round_inputs(p, draft_tokens, cut_q) -> tuple[np.ndarray, np.ndarray]:
    """(p [gamma+1, V], draft tokens [gamma] int64) of a round, checked: shapes, cut_q [V], ids in [0, V)."""
    p = np.asarray(p)
    d = np.asarray(draft_tokens, dtype=np.int64).reshape(-1)  # [gamma]
    gamma = d.size
    if p.ndim != 2 or p.shape[0] != gamma + 1:
        raise InvalidArgument(f"p must have shape [gamma+1 = {gamma + 1}, V], got {p.shape}")
    V = p.shape[1]
    if cut_q is not None and np.shape(cut_q) != (V,):
        raise InvalidArgument(f"cut_q must have shape [V] = {(V,)}, got {np.shape(cut_q)}")
    if gamma and (d.min() < 0 or d.max() >= V):
        raise InvalidArgument(f"draft tokens must lie in [0, {V}), got {d.tolist()}")
    return p, d


def verify_sampled(
    p: np.ndarray, q: np.ndarray, draft_tokens, rng: np.random.Generator, cut_q: np.ndarray | None = None
) -> tuple[int, int]:
    """Exact rejection sampling of one speculative round.

    p: [gamma+1, V] target probabilities (the rows `probabilities` returns);
    q: [gamma, V] draft probabilities the tokens were drawn from (pad_vocab'ed, or one_hot
       for deterministic proposers, for which this is still exact);
    draft_tokens: [gamma] int, d_i ~ q_i.
    Accepts d_i with probability min(1, p_i(d_i) / q_i(d_i)) (one uniform per examined
    token); on the first rejection returns a correction sampled from residual(p_i, q_i);
    when all gamma are accepted returns a bonus token sampled from p[gamma].
    cut_q: [V] the distribution of a draft token d_gamma that was drawn but cut before
    verification (a grammar forbids it, so p_gamma(d_gamma) = 0 and it is rejected with
    certainty): the token after the gamma accepted ones is then the correction
    residual(p[gamma], cut_q), exactly what verifying d_gamma would have given.
    Returns (n_accepted, next_token).
    """
    p, d = _round_inputs(p, draft_tokens, cut_q)  # [gamma+1, V], [gamma]
    gamma, V = d.size, p.shape[1]
    q = np.asarray(q)
    if q.shape != (gamma, V):
        raise InvalidArgument(f"q must have shape [gamma, V] = {(gamma, V)}, got {q.shape}")
    for i in range(gamma):
        x = int(d[i])
        if rng.random() >= accept_probability(p[i, x], q[i, x]):
            return i, sample(residual(p[i], q[i]), rng)
    return gamma, sample(p[gamma] if cut_q is None else residual(p[gamma], cut_q), rng)


def residual_without(p: np.ndarray, x: int) -> np.ndarray:
    """p with token x zeroed, renormalised: residual(p, one_hot(x)) without building the
    one-hot row (the working distribution after a deterministic draft x is rejected).

    p: [V] float64 -> [V] float64, a new array. Guard as in `residual`: when nothing is left
    (p is one-hot at x, so x is accepted with probability 1 and never rejected) p is returned.
    """
    r = np.array(p, dtype=np.float64)  # [V] copy
    r[x] = 0.0
    s = r.sum()
    if not s > 0.0:  # also catches NaN
        return np.asarray(p, dtype=np.float64)
    r /= s
    return r


def verify_deterministic(
    p: np.ndarray, draft_tokens, rng: np.random.Generator, cut_q: np.ndarray | None = None
) -> tuple[int, int]:
    """verify_sampled for a deterministic draft (q one-hot at each drafted token), by index:
    d_i is kept with probability min(1, p_i(d_i) / 1) = p_i(d_i), and a rejection's correction
    is drawn from residual_without(p_i, d_i), which equals residual(p_i, one_hot(d_i)) bit for
    bit. The same random numbers are drawn as by verify_sampled with one-hot rows, so the two
    return the same (n_accepted, next_token) for the same generator state, without the [gamma, V]
    float64 rows (2 MB a row at a 262,144-token vocabulary).

    p: [gamma+1, V] target probabilities; draft_tokens: [gamma] int; cut_q: as verify_sampled."""
    p, d = _round_inputs(p, draft_tokens, cut_q)  # [gamma+1, V], [gamma]
    gamma = d.size
    for i in range(gamma):
        x = int(d[i])
        if rng.random() >= accept_probability(p[i, x], 1.0):
            return i, sample(residual_without(p[i], x), rng)
    return gamma, sample(p[gamma] if cut_q is None else residual(p[gamma], cut_q), rng)


MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs


def token_logprobs(logits: np.ndarray, tokens, top: int) -> list[dict]:
    """Log-probabilities of emitted tokens under the target's distribution (softmax of the rows
    as decoding saw them: masked by a grammar, no temperature, top-k or top-p).

    logits: [R, V]; tokens: [R] the token emitted from each row; top: how many alternatives
    per row (0..MAX_TOP_LOGPROBS), most probable first (ties: the smaller id).
    -> [{"token": id, "logprob": float, "top": [(id, logprob), ...]}] per row."""
    x = np.asarray(logits, dtype=np.float64)  # [R, V]
    m = x.max(axis=1, keepdims=True)  # [R, 1]
    lp = x - (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))  # [R, V] log-softmax; -inf stays -inf
    out = []
    for r, token in enumerate(tokens):
        entry = {"token": int(token), "logprob": float(lp[r, token]), "top": []}
        if top:
            idx = np.argpartition(-lp[r], top - 1)[:top] if top < lp.shape[1] else np.arange(lp.shape[1])
            order = sorted(idx.tolist(), key=lambda i: (-lp[r, i], i))
            entry["top"] = [(int(i), float(lp[r, i])) for i in order]
        out.append(entry)
    return out
