"""The harness's statistics: percentiles and seeded percentile-bootstrap intervals (of a statistic
over values, and of a ratio of summed tokens over summed seconds)."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Sequence

import numpy as np

BOOTSTRAP_SAMPLES = 2000


def percentiles(values: Iterable[float]) -> dict[str, float | None]:
    """{"p50", "p90", "p99"} of the values (None each when there are none)."""
    vals = np.asarray(list(values), dtype=np.float64)
    if vals.size == 0:
        return {"p50": None, "p90": None, "p99": None}
    p50, p90, p99 = np.percentile(vals, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99)}


def bootstrap_ci(
    values: Sequence[float], seed: int, samples: int = BOOTSTRAP_SAMPLES, stat: Callable = np.mean
) -> tuple[float, float] | None:
    """95 % percentile-bootstrap interval of stat (default the mean) over the values (seeded)."""
    vals = np.asarray(values, dtype=np.float64)
    if vals.size == 0:
        return None
    if vals.size == 1:
        return float(vals[0]), float(vals[0])
    rng = np.random.default_rng(seed)
    stats = stat(vals[rng.integers(0, vals.size, size=(samples, vals.size))], axis=1)
    lo, hi = np.percentile(stats, [2.5, 97.5])
    return float(lo), float(hi)


def by_domain(per_case: dict[str, float], domain_of: dict[str, str]) -> dict[str, float]:
    """The median of per-case values within each domain, domains in the order domain_of lists them."""
    domains = dict.fromkeys(domain_of.values())
    return {d: statistics.median(v for c, v in per_case.items() if domain_of[c] == d) for d in domains}


def ratio_ci(
    num_tok, num_sec, den_tok, den_sec, seed: int, samples: int = BOOTSTRAP_SAMPLES
) -> tuple[float, float] | None:
    """95 % bootstrap interval over prompts of (sum num_tok / sum num_sec) / (sum den_tok / sum den_sec)."""
    arrays = [np.asarray(a, dtype=np.float64) for a in (num_tok, num_sec, den_tok, den_sec)]
    n = arrays[0].size
    if n == 0:
        return None
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(samples, n)) if n > 1 else np.zeros((1, 1), dtype=np.int64)
    nt, ns, dt, ds = (a[idx].sum(axis=1) for a in arrays)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = (nt / ns) / (dt / ds)
    ratio = ratio[np.isfinite(ratio)]
    if ratio.size == 0:
        return None
    lo, hi = np.percentile(ratio, [2.5, 97.5])
    return float(lo), float(hi)


def ci_cell(ci: Sequence[float] | None, empty: str = "-") -> str:
    """A report table's cell for a 95 % interval: "[lo-hi]" to two decimals, `empty` without one."""
    return "[{:.2f}-{:.2f}]".format(*ci) if ci else empty
