"""Retry-After of a full queue: the expected wait until a new request would find room.

A server with S slots (1 for the batch-1 worker, --max-batch for the batching one) starts queued
requests at S / T per second when every slot is busy, T the mean seconds a request runs (under
the same load: a batch's rounds are slower than a lone request's, and T is measured there). With
`waiting` requests queued and `free` slots idle, the requests ahead of a new one that must start
before it can are waiting + 1 - free, so the expected wait is

    T * max(0, waiting + 1 - free) / S

which is the time the queue takes to drain into the slots. (A batch-1 server: T * (waiting + 1).)
"""

from __future__ import annotations

import math

MEAN_WEIGHT = 0.2  # weight of the newest run in the running mean of T
DEFAULT_SECONDS = 1.0  # T before any request has run


def expected_wait(mean_seconds: float, waiting: int, slots: int, running: int) -> float:
    """Seconds until the queue ahead of a new request has drained into `slots` slots (module
    docstring); mean_seconds T > 0, waiting >= 0 queued, running <= slots busy."""
    free = max(0, slots - running)
    return mean_seconds * max(0, waiting + 1 - free) / max(1, slots)


def retry_headers(wait: float) -> dict[str, str]:
    """Retry-After (whole seconds, at least 1: the header has no fractions) and retry-after-ms
    (what the openai clients read first)."""
    return {"Retry-After": str(max(1, math.ceil(wait))), "retry-after-ms": str(max(1, round(wait * 1000)))}


def update_mean(mean: float | None, seconds: float) -> float:
    """The running mean of a request's run time after one more run (the first run sets it)."""
    return seconds if mean is None else (1 - MEAN_WEIGHT) * mean + MEAN_WEIGHT * seconds
