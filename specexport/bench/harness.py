"""Measurement harness: how the benchmarks time, repeat, summarise and record a run.

A run measures methods (`Method`: one engine in one configuration; `run(case)` generates once
from a prompt case and returns a result dict) on prompt cases (`Case`: an id and token ids).
It is honest by construction:

warm-up   every method first generates once from WARMUP_MESSAGES, a prompt outside the
          measured set (refused when its ids equal a measured prompt's); nothing of it is timed.
memory    before every generation, warm-up included, each method's `reset` clears what its
          engine keeps across requests (specexport: the suffix store of earlier answers). A
          method that cannot clear it says what it keeps (`memory`), may measure each prompt
          once only (repeats 1), and the run's notes state it.
order     prompts are the outer loop, repeats the inner one; each round runs every method once,
          back to back, in an order rotated by one from the round before, so machine drift
          spreads over all methods instead of landing on whichever ran as a block.
figures   per prompt the median over repeats, then the median over prompts; the ratio of two
          methods is the median over prompts of their per-prompt ratio (both from the same
          rounds), with a seeded 95% percentile-bootstrap interval over prompts.
record    run_metadata() names the machine (machine.describe()), the exact command, the date and
          the measuring libraries' versions; write_json() writes a run's document.

Speed is measured here and in the benchmark scripts, never asserted by tests.

This module holds the methods, samples and runs; the prompt cases are in harness_cases.py, the
statistics in harness_stats.py, the record and the scripts' shared options in harness_scripts.py,
all importable from here.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ..errors import HarnessError
from .harness_cases import (
    WARMUP_ID,
    WARMUP_MESSAGES,
    Case,
    encode_prompt,
    load_prompt_set,
    make_cases,
    tool_plan,
    warmup_case,
)
from .harness_scripts import (
    VERSIONS,
    add_run_options,
    check_run_options,
    cli,
    header,
    int_list,
    parse_args,
    preamble,
    run_metadata,
    script_parser,
    write_json,
)
from .harness_stats import BOOTSTRAP_SAMPLES, bootstrap_ci, by_domain, ci_cell, percentiles, ratio_ci

# pause before each timed call of a run that switches between engine processes, so the previous
# engine's spinning thread pool has gone idle
SETTLE_SECONDS = 0.05


# --------------------------------------------------------------------------- methods and runs


@dataclass
class Method:
    """One engine in one configuration.

    run(case) generates once and returns a dict holding at least "tokens" (the new token ids)
    and any figures of the engine's own. reset() clears what the engine keeps across requests;
    None when it keeps nothing (memory "none") or cannot clear it (then memory says what it
    keeps). info: report columns (engine, mode, precision, ...)."""

    name: str
    run: Callable[[Case], dict]
    reset: Callable[[], None] | None = None
    memory: str = "none"
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def keeps_memory(self) -> bool:
        return self.reset is None and self.memory != "none"


@dataclass
class Sample:
    """One measured generation. seconds: wall seconds of run(), from the harness's side."""

    method: str
    case: str
    repeat: int
    slot: int  # the method's position in its round, 0 = first
    seconds: float
    result: dict

    def value(self, metric: Metric) -> float:
        if callable(metric):
            return float(metric(self))
        return float(self.seconds if metric == "seconds" else self.result[metric])


Metric = str | Callable[[Sample], float]  # a key of Sample.result, "seconds", or a function


def wall_tok_s(sample: Sample) -> float:
    """New tokens per wall second of run() (prefill and any transport included)."""
    return len(sample.result["tokens"]) / sample.seconds if sample.seconds > 0 else 0.0


def rotated(items: Sequence, k: int) -> list:
    """items rotated left by k (mod its length)."""
    k = k % len(items) if items else 0
    return list(items[k:]) + list(items[:k])


def schedule(n_methods: int, n_cases: int, repeats: int) -> list[tuple[int, int, list[int]]]:
    """(case index, repeat, method indices in run order) per round: cases outer, repeats inner;
    round k runs the methods rotated left by k."""
    rounds = [(c, r) for c in range(n_cases) for r in range(repeats)]
    return [(c, r, rotated(range(n_methods), k)) for k, (c, r) in enumerate(rounds)]


@dataclass
class Run:
    """What run_interleaved measured. log: every call in order as (event, method, case id),
    event 'reset', 'warm-up' or 'measure'."""

    methods: list[Method]
    cases: list[Case]
    repeats: int
    samples: list[Sample] = field(default_factory=list)
    log: list[tuple[str, str, str]] = field(default_factory=list)

    def method(self, name: str) -> Method:
        for m in self.methods:
            if m.name == name:
                return m
        raise HarnessError(f"no method {name!r} in this run")

    def samples_of(self, method: str, case: str | None = None) -> list[Sample]:
        self.method(method)
        return [s for s in self.samples if s.method == method and (case is None or s.case == case)]

    def per_case(self, method: str, metric: Metric) -> dict[str, float]:
        """case id -> the median over repeats of the metric, in case order."""
        out = {}
        for c in self.cases:
            values = [s.value(metric) for s in self.samples_of(method, c.id)]
            if values:
                out[c.id] = statistics.median(values)
        return out

    def median(self, method: str, metric: Metric) -> float | None:
        """The median over cases of per_case (None when nothing was measured)."""
        values = list(self.per_case(method, metric).values())
        return statistics.median(values) if values else None

    def ratio(self, method: str, reference: str, metric: Metric, seed: int = 0) -> dict:
        """{"median": median over cases of per-case method / reference, "ci95": its bootstrap
        interval, "per_case": the ratios}; cases where the reference is 0 are left out."""
        num, den = self.per_case(method, metric), self.per_case(reference, metric)
        per = {c: num[c] / den[c] for c in num if den.get(c)}
        vals = list(per.values())
        return {
            "median": statistics.median(vals) if vals else None,
            "ci95": bootstrap_ci(vals, seed, stat=np.median),
            "per_case": per,
        }

    def same_tokens(self, a: str, b: str, eos: Iterable[int] = ()) -> tuple[int, int]:
        """(cases where every sample of `a` equals the first sample of `b` up to the first EOS,
        cases both measured)."""
        eos = set(eos)
        same = total = 0
        for c in self.cases:
            sa, sb = self.samples_of(a, c.id), self.samples_of(b, c.id)
            if sa and sb:
                total += 1
                ref = until_eos(sb[0].result["tokens"], eos)
                same += all(until_eos(s.result["tokens"], eos) == ref for s in sa)
        return same, total

    def memory_notes(self) -> list[str]:
        """One line per statement of what methods keep across requests and whether it is
        cleared: 'method, method: statement' (methods that keep nothing are left out)."""
        by_note: dict[str, list[str]] = {}
        for m in self.methods:
            if m.memory != "none":
                by_note.setdefault(m.memory, []).append(m.name)
        return [f"{', '.join(names)}: {note}" for note, names in by_note.items()]

    def to_dict(self) -> dict:
        """The run as JSON data: methods (name, memory, info), cases, repeats, every sample."""
        return {
            "methods": [
                {"name": m.name, "memory": m.memory, "cleared": m.reset is not None, **m.info} for m in self.methods
            ],
            "cases": [{"id": c.id, "domain": c.domain, "prompt_tokens": len(c.ids)} for c in self.cases],
            "repeats": self.repeats,
            "memory_notes": self.memory_notes(),
            "samples": [
                {
                    "method": s.method,
                    "case": s.case,
                    "repeat": s.repeat,
                    "slot": s.slot,
                    "seconds": s.seconds,
                    **s.result,
                }
                for s in self.samples
            ],
        }


Progress = Callable[[Sample], None]


def _call(run: Run, method: Method, case: Case, event: str) -> tuple[dict, float]:
    if method.reset is not None:
        method.reset()
        run.log.append(("reset", method.name, case.id))
    run.log.append((event, method.name, case.id))
    start = time.perf_counter()
    result = method.run(case)
    seconds = time.perf_counter() - start
    if not isinstance(result, dict) or not isinstance(result.get("tokens"), list):
        raise HarnessError(f"method {method.name!r} returned no 'tokens' list for {case.id!r}")
    return result, seconds


def run_interleaved(
    methods: Sequence[Method],
    cases: Sequence[Case],
    warmup: Case,
    repeats: int = 1,
    settle: float = 0.0,
    progress: Progress | None = None,
) -> Run:
    """Warm every method up on `warmup`, then measure every case `repeats` times in the rounds
    of schedule(); `settle` seconds of sleep precede each measured call (module docstring)."""
    methods, cases = list(methods), list(cases)
    if not methods or not cases:
        raise HarnessError("a run needs at least one method and one prompt")
    for what, names in (("method", [m.name for m in methods]), ("prompt", [c.id for c in cases])):
        if len(set(names)) != len(names):
            raise HarnessError(f"{what} names repeat: {names}")
    if repeats < 1:
        raise HarnessError(f"repeats must be >= 1, got {repeats}")
    inside = [c.id for c in cases if c.ids == warmup.ids or c.id == warmup.id]
    if inside:
        raise HarnessError(f"the warm-up prompt is a measured prompt ({inside[0]!r}); warm up outside the set")
    kept = [m.name for m in methods if m.keeps_memory]
    if kept and repeats > 1:
        raise HarnessError(
            f"{', '.join(kept)} keep(s) answers across requests and cannot clear them: a repeat "
            "would measure a prompt whose answer the engine holds; use repeats 1"
        )
    run = Run(methods, cases, repeats)
    for m in methods:
        _call(run, m, warmup, "warm-up")
    for c, r, order in schedule(len(methods), len(cases), repeats):
        for slot, i in enumerate(order):
            if settle > 0:
                time.sleep(settle)
            result, seconds = _call(run, methods[i], replace(cases[c], repeat=r), "measure")
            run.samples.append(Sample(methods[i].name, cases[c].id, r, slot, seconds, result))
            if progress is not None:
                progress(run.samples[-1])
    return run


def until_eos(tokens: Sequence[int], eos: Iterable[int]) -> list[int]:
    """Tokens up to (not including) the first EOS."""
    eos = set(eos)
    cut = next((i for i, t in enumerate(tokens) if t in eos), len(tokens))
    return [int(t) for t in tokens[:cut]]


def median_seconds(fn: Callable[[], Any], calls: int) -> float:
    """Median wall seconds of `calls` calls of fn()."""
    out = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return statistics.median(out)


def best_medians(
    cells: Sequence[tuple[str, Callable[[], Any]]], rounds: int, calls: int, before: Callable[[], Any] | None = None
) -> dict[str, float]:
    """name -> the best (lowest) over `rounds` rounds of the median wall seconds of `calls` calls
    of that cell's fn(); each round runs the cells rotated by one from the round before, and
    before() (untimed) precedes each cell's calls."""
    best: dict[str, float] = {}
    for k in range(rounds):
        for name, fn in rotated(cells, k):
            if before is not None:
                before()
            t = median_seconds(fn, calls)
            best[name] = min(t, best.get(name, t))
    return best


def interleaved_seconds(calls: Mapping[Hashable, Callable[[], Any]], rounds: int) -> dict[Hashable, float]:
    """Median wall seconds of each of `calls`: one untimed warm-up round, then `rounds` rounds
    that call each once, in an order rotated by one from the round before (machine drift spreads
    over all of them instead of landing on whichever ran first)."""
    keys = list(calls)
    for key in keys:
        calls[key]()
    times: dict[Hashable, list[float]] = {key: [] for key in keys}
    for r in range(rounds):
        for key in rotated(keys, r):
            times[key].append(median_seconds(calls[key], 1))
    return {key: statistics.median(values) for key, values in times.items()}


__all__ = [
    "BOOTSTRAP_SAMPLES",
    "Case",
    "HarnessError",
    "Method",
    "Run",
    "SETTLE_SECONDS",
    "Sample",
    "VERSIONS",
    "WARMUP_ID",
    "WARMUP_MESSAGES",
    "add_run_options",
    "bootstrap_ci",
    "by_domain",
    "check_run_options",
    "ci_cell",
    "cli",
    "encode_prompt",
    "header",
    "int_list",
    "interleaved_seconds",
    "load_prompt_set",
    "make_cases",
    "median_seconds",
    "parse_args",
    "percentiles",
    "preamble",
    "ratio_ci",
    "rotated",
    "run_interleaved",
    "run_metadata",
    "schedule",
    "script_parser",
    "tool_plan",
    "until_eos",
    "wall_tok_s",
    "warmup_case",
    "write_json",
]
