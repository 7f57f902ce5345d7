"""The ceiling of hybrid_mechanics.py: the real SpeculativeLoop, greedy, with target-only decoding,
a replay proposer (the recorded greedy answer, acceptance 1.0) and an always-wrong proposer under
the adaptive draft-length policy. Not a script.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
from hybrid_timing import Subject, call_ids

from specexport.bench import harness
from specexport_runtime.adaptive import GammaController
from specexport_runtime.config import GeneratorConfig
from specexport_runtime.generator import GenerationStats, LoopSetup, SpeculativeLoop
from specexport_runtime.policy import RoundDraft
from specexport_runtime.proposers import Proposal, Proposer

METHODS = ("target-only", "replay", "always-wrong")

# --------------------------------------------------------------------------- proposers


class ReplayProposer(Proposer):
    """Drafts the recorded greedy answer: acceptance 1.0 while the output follows it."""

    name = "replay"

    def __init__(self, answer: list[int]):
        self.answer = answer

    def start(self, prompt):
        self.prompt_len = len(prompt)

    def propose(self, committed, gamma, params, rng) -> Proposal:
        pos = len(committed) - self.prompt_len
        return Proposal([int(t) for t in self.answer[pos : pos + gamma]], None)

    def commit(self, committed, n_new):
        pass


class WrongProposer(Proposer):
    """Drafts a first token that is never the target's (the recorded answer's token + 1)."""

    name = "always-wrong"

    def __init__(self, answer: list[int], vocab: int):
        self.answer, self.vocab = answer, vocab

    def start(self, prompt):
        self.prompt_len = len(prompt)

    def propose(self, committed, gamma, params, rng) -> Proposal:
        pos = len(committed) - self.prompt_len
        right = self.answer[pos] if pos < len(self.answer) else 0
        wrong = (right + 1) % self.vocab
        return Proposal([wrong] * gamma, None)

    def commit(self, committed, n_new):
        pass


def run_loop(s: Subject, method: str, prompt: list[int], tokens: int, args, until_off: bool = False) -> dict:
    """One generation through SpeculativeLoop; decode figures exclude the prefill. until_off: stop
    once the draft-length policy has switched speculation off (the always-wrong warm-up)."""
    answer = s.answers.get(tuple(prompt), [])
    if method == "target-only":
        config = GeneratorConfig(max_new_tokens=tokens, speculative=False)
        proposer = WrongProposer(answer, s.vocab)  # never asked
    elif method == "replay":
        config = GeneratorConfig(max_new_tokens=tokens, gamma=args.ceiling_gamma)
        proposer = ReplayProposer(answer)
    else:
        config = GeneratorConfig(max_new_tokens=tokens)
        proposer = WrongProposer(answer, s.vocab)
    ctl = s.controller if method == "always-wrong" else None
    policy = RoundDraft.of(config, ctl)
    stats = GenerationStats()
    loop = SpeculativeLoop(LoopSetup(s.model, proposer, config, np.random.default_rng(0), policy=policy, stats=stats))
    policy.start()
    out: list[int] = []
    t_first = run_before = keep_before = None
    switched_off = None
    for new in loop.rounds(prompt, s.model.max_context):
        out += new
        if t_first is None:
            t_first = time.perf_counter()
            run_before = s.model.stats.seconds
            keep_before = s.timed.total() if s.timed is not None else 0.0
        if ctl is not None and switched_off is None and not ctl.speculating:
            switched_off = stats.rounds
        if len(out) >= tokens + 1 or (until_off and switched_off is not None):
            break
    seconds = time.perf_counter() - t_first
    run = s.model.stats.seconds - run_before
    keep = (s.timed.total() if s.timed is not None else 0.0) - keep_before
    return {
        "tokens": out,
        "decode_tokens": len(out) - 1,
        "seconds": seconds,
        "tok_s": (len(out) - 1) / seconds,
        "run_share": run / seconds,
        "bookkeeping_share": keep / seconds,
        "rounds": stats.rounds,
        "plain_steps": stats.plain_steps,
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "switched_off": switched_off,
        "draft_per_round": stats.drafted / stats.rounds if stats.rounds else 0.0,
    }


def controller_state(ctl: GammaController) -> dict:
    """What the adaptive policy believes after the measured runs: on or off, its acceptance, and
    its cost model (ms of each call size it timed, and of the fitted line)."""
    line = {str(r): ctl.cost.seconds(r) * 1e3 for r in (1, 3, 9)} if ctl.cost.timed(1) else {}
    return {
        "speculating": ctl.speculating,
        "alpha": ctl.alpha,
        "gamma": ctl.gamma,
        "timed_ms": {str(r): v * 1e3 for r, v in sorted(ctl.cost.by_rows.items())},
        "line_ms": line,
    }


def ceiling(subjects: list[Subject], args) -> list[dict]:
    rng = np.random.default_rng(args.seed + 2)
    vocab = min(s.vocab for s in subjects)
    warm, prompt = call_ids(rng, vocab, args.prompt_tokens), call_ids(rng, vocab, args.prompt_tokens)
    longest = args.tokens + args.ceiling_gamma + 2
    for s in subjects:
        # recorded greedy answers (untimed), then one warm-up run of every method on the warm-up
        # prompt; the always-wrong warm-up runs until the policy has switched speculation off
        for p in (warm, prompt):
            s.answers[tuple(p)] = run_loop(s, "target-only", p, longest, args)["tokens"]
        run_loop(s, "replay", warm, args.tokens, args)
        room = min(args.warmup_tokens, s.model.max_context - len(warm) - 2)
        react = run_loop(s, "always-wrong", warm, room, args, until_off=True)
        s.react_rounds = react["switched_off"]
    samples = {(s.label, m): [] for s in subjects for m in METHODS}
    for r in range(args.repeats):
        for s in harness.rotated(subjects, r):
            for m in harness.rotated(list(METHODS), r):
                samples[s.label, m].append(run_loop(s, m, prompt, args.tokens, args))
    rows = []
    for s in subjects:
        answer = s.answers[tuple(prompt)]
        row = {"model": s.label, "kind": s.graph.kind, "precision": s.graph.precision, "form": s.graph.form}
        row["tokens"] = args.tokens
        row["gamma"] = args.ceiling_gamma
        for m in METHODS:
            runs = samples[s.label, m]
            row[m] = {
                "tok_s": statistics.median(x["tok_s"] for x in runs),
                "run_share": statistics.median(x["run_share"] for x in runs),
                "bookkeeping_share": statistics.median(x["bookkeeping_share"] for x in runs),
                "rounds": statistics.median(x["rounds"] for x in runs),
                "plain_steps": statistics.median(x["plain_steps"] for x in runs),
                "drafted": sum(x["drafted"] for x in runs),
                "accepted": sum(x["accepted"] for x in runs),
                "draft_per_round": statistics.median(x["draft_per_round"] for x in runs),
                "equal_to_target_only": all(x["tokens"][: args.tokens + 1] == answer[: args.tokens + 1] for x in runs),
            }
        base = samples[s.label, "target-only"]
        for m in ("replay", "always-wrong"):
            ratios = [x["tok_s"] / b["tok_s"] for x, b in zip(samples[s.label, m], base)]
            row[m]["vs_target_only"] = statistics.median(ratios)
        rep = row["replay"]
        rep["acceptance"] = rep["accepted"] / rep["drafted"] if rep["drafted"] else 0.0
        row["always-wrong"]["policy_reacted_after_rounds"] = s.react_rounds
        row["always-wrong"]["controller_after"] = controller_state(s.controller)
        rows.append(row)
    return rows
