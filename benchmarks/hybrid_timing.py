"""The call-level figures of hybrid_mechanics.py: the models loaded as subjects (their state
bookkeeping timed in place), the verify cost (a 1 + gamma-row call against a 1-row call) and the
rollback rounds (a round with the bookkeeping against the same round without it). Not a script.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import numpy as np
from hybrid_graphs import Graph

from specexport.bench import harness
from specexport_runtime import contract
from specexport_runtime.adaptive import GammaController
from specexport_runtime.engine import OrtModel, SessionConfig

# --------------------------------------------------------------------------- state bookkeeping


class TimedStates:
    """A StateHistory whose calls from OrtModel are timed: bind (rows + bind), store, truncate
    (rollback: the kept-state check and forget_after)."""

    def __init__(self, inner):
        self.inner = inner
        self.seconds = {"bind": 0.0, "store": 0.0, "truncate": 0.0}
        self.calls = {"bind": 0, "store": 0, "truncate": 0}

    def _timed(self, key: str, fn, *a):
        start = time.perf_counter()
        out = fn(*a)
        self.seconds[key] += time.perf_counter() - start
        self.calls[key] += 1
        return out

    def rows(self, *a):
        return self._timed("bind", self.inner.rows, *a)

    def bind(self, *a):
        return self._timed("bind", self.inner.bind, *a)

    def store(self, *a):
        return self._timed("store", self.inner.store, *a)

    def rollback(self, *a):
        return self._timed("truncate", self.inner.rollback, *a)

    def total(self) -> float:
        return sum(self.seconds.values())

    def __getattr__(self, name):
        return getattr(self.inner, name)


class NoRollbackStates:
    """The same graph inputs and outputs bound (the zero state in, the call's states out), nothing
    kept: what a decoder that never rolls back pays. Its logits are not the model's (the state
    never advances); only its time is used."""

    def __init__(self, inner):
        self.inner = inner

    def rows(self, S, last_rows):
        return self.inner.rows(S, last_rows)

    def bind(self, io, P, rows):
        io.bind_cpu_input(contract.STATE_INDEX, rows)
        for j, (past, out) in enumerate(zip(self.inner.zeros, self.inner.ring)):  # the outputs land in slots 0..
            io.bind_input(contract.past_state(j), "cpu", 0, past.dtype, list(past.shape), past.ctypes.data)
            shape = [1, rows.size, *self.inner.shapes[j]]
            io.bind_output(contract.new_state(j), "cpu", 0, out.dtype, shape, out.ctypes.data)

    def store(self, P, rows, S):
        pass

    def rollback(self, length):
        pass

    def reset(self):
        pass

    def __getattr__(self, name):
        return getattr(self.inner, name)


# --------------------------------------------------------------------------- subjects


@dataclass
class Subject:
    graph: Graph
    model: OrtModel
    timed: TimedStates | None
    vocab: int
    controller: GammaController = field(default_factory=GammaController)
    answers: dict = field(default_factory=dict)  # prompt key -> recorded greedy answer
    react_rounds: int | None = None  # drafted rounds the policy took to switch speculation off

    @property
    def label(self) -> str:
        return self.graph.label


def load_subject(graph: Graph, max_context: int, args) -> Subject:
    config = SessionConfig(threads=args.threads, shared_pool=args.pool == "shared")
    model = OrtModel(
        graph.path,
        graph.spec,
        max_context,
        config,
        max_rows=args.max_rows,
        min_rows=graph.min_rows,
        cache_pad=graph.cache_pad,
    )
    timed = None
    if model.states is not None:
        timed = TimedStates(model.states)
        model.states = timed
    return Subject(graph, model, timed, graph.spec.embedding_rows)


def call_ids(rng: np.random.Generator, vocab: int, n: int) -> list[int]:
    return rng.integers(3, vocab, size=n).tolist()


def timed_call(model: OrtModel, ids: list[int]) -> tuple[float, float]:
    """(wall seconds of forward, seconds inside ONNX Runtime's run) of one call."""
    before = model.stats.seconds
    start = time.perf_counter()
    model.forward(ids, last_rows=len(ids))
    return time.perf_counter() - start, model.stats.seconds - before


def verify_cost(subjects: list[Subject], args) -> list[dict]:
    sizes = [1] + [1 + g for g in args.gammas]
    rng = np.random.default_rng(args.seed)
    prompt = call_ids(rng, min(s.vocab for s in subjects), args.past)
    calls = {s.label: call_ids(rng, s.vocab, max(sizes)) for s in subjects}
    for s in subjects:
        s.model.reset()
        s.model.forward(prompt)
        for size in sizes:  # warm-up: every size once, untimed
            s.model.forward(calls[s.label][:size], last_rows=size)
            s.model.truncate(args.past)
    wall = {(s.label, n): [] for s in subjects for n in sizes}
    run = {(s.label, n): [] for s in subjects for n in sizes}
    for r in range(args.repeats):
        for s in harness.rotated(subjects, r):
            for size in harness.rotated(sizes, r):
                w, t = timed_call(s.model, calls[s.label][:size])
                s.model.truncate(args.past)
                wall[s.label, size].append(w)
                run[s.label, size].append(t)
    rows = []
    for s in subjects:
        one = statistics.median(wall[s.label, 1])
        row = {"model": s.label, "kind": s.graph.kind, "precision": s.graph.precision, "form": s.graph.form}
        row["past"] = args.past
        row["calls"] = {}
        for size in sizes:
            w, t = statistics.median(wall[s.label, size]), statistics.median(run[s.label, size])
            row["calls"][str(size)] = {"ms": w * 1e3, "run_ms": t * 1e3, "vs_1_row": w / one, "host_share": 1 - t / w}
        rows.append(row)
    return rows


def timed_round(model: OrtModel, real: TimedStates, states, ids: list[int], keep: int, P: int):
    """Seconds of one round at cursor P with `states` bound (a call on ids, then the rollback to
    `keep`) and the bookkeeping timed in it (bind, store, truncate); then back to P, untimed."""
    model.states = states
    before = dict(real.seconds)
    start = time.perf_counter()
    model.forward(ids, last_rows=len(ids))
    model.truncate(keep)
    seconds = time.perf_counter() - start
    spent = {k: real.seconds[k] - before[k] for k in before}
    model.states = real
    model.truncate(P)  # the next round starts at P again (state P is kept)
    return seconds, spent


def rollback_rounds(subjects: list[Subject], args) -> list[dict]:
    """A round (1 + gamma rows at cursor P, then the rollback to half the draft accepted) with the
    state bookkeeping and without it, interleaved."""
    rows = []
    rng = np.random.default_rng(args.seed + 1)
    for s in subjects:
        if s.timed is None:
            continue
        model, real = s.model, s.timed
        without = NoRollbackStates(real.inner)
        model.reset()
        model.forward(call_ids(rng, s.vocab, args.past))
        P = args.past
        for gamma in args.gammas:
            ids = call_ids(rng, s.vocab, 1 + gamma)
            keep = P + 1 + gamma // 2

            timed_round(model, real, real, ids, keep, P), timed_round(model, real, without, ids, keep, P)  # warm-up
            times, spent = {"with": [], "without": []}, []
            for r in range(args.repeats):
                for name in harness.rotated(["with", "without"], r):
                    seconds, parts = timed_round(model, real, real if name == "with" else without, ids, keep, P)
                    times[name].append(seconds)
                    if name == "with":
                        spent.append(parts)
            w, wo = statistics.median(times["with"]), statistics.median(times["without"])
            per = {k: statistics.median(p[k] for p in spent) for k in real.seconds}
            share = statistics.median(sum(p.values()) / t for p, t in zip(spent, times["with"]))
            rows.append(
                {
                    "model": s.label,
                    "gamma": gamma,
                    "round_ms_with": w * 1e3,
                    "round_ms_without": wo * 1e3,
                    "overhead_ab": (w - wo) / w,
                    "bind_us": per["bind"] * 1e6,
                    "store_us": per["store"] * 1e6,
                    "truncate_us": per["truncate"] * 1e6,
                    "direct_share": share,
                }
            )
    return rows
