"""Replay the draft-length policy's strategies on one seeded stream of made-up timings and
acceptances, and print a digest of every decision, one per strategy; run it under two checkouts
(PYTHONPATH=CHECKOUT/runtime) and compare the lines to show a refactor kept the decisions:

    PYTHONPATH=runtime python benchmarks/experiments/policy_replay.py
    PYTHONPATH=/tmp/base/runtime python benchmarks/experiments/policy_replay.py

    gamma controller  adaptive.GammaController: choose / record_round / start_sequence, its
                      probe settings drawn per seed, speculation starting off in some
    batch gamma       batch_gamma.BatchGamma: record / record_draft / learn / observe, then
                      choose and free_limit over made-up running sequences
    suffix limit      suffix.LimitTuner: choose / record over the three default scales

Only the public interface of each is used (the one both checkouts share).
"""

from __future__ import annotations

import argparse
import hashlib
import random
from dataclasses import dataclass

from specexport_runtime.adaptive import GammaController
from specexport_runtime.batch_gamma import FREE, BatchGamma
from specexport_runtime.costs import VerifyCost
from specexport_runtime.suffix import LimitTuner, SuffixConfig


@dataclass
class Seq:
    """What BatchGamma.choose reads of a running sequence (batch.BatchSequence's fields)."""

    _alpha: float
    _proposed: float
    drafts_with_model: bool
    draft_unread: int
    tokens_left: int
    proposer: str


def controller(seeds: int) -> list:
    out = []
    for seed in range(seeds):
        r = random.Random(seed)
        ctl = GammaController(gamma_max=8, gamma=4, probe_every=r.choice([2, 4, 16]), probe_max=r.choice([16, 256]))
        ctl.speculating = r.random() >= 0.3
        per_draft = r.choice([0.0001, 0.002, 0.02])
        for step in range(600):
            if step % 150 == 149:
                per_draft = r.choice([0.0001, 0.002, 0.02, 0.05])
            if r.random() < 0.02:
                ctl.start_sequence()
            g = ctl.choose()
            out.append(g)
            if g == 0:
                ctl.cost.record(1, 0.01 * r.uniform(0.9, 1.1))
                continue
            d = r.randint(1, g)
            ctl.cost.record(d + 1, (0.01 + 0.001 * (d + 1)) * r.uniform(0.9, 1.1))
            ctl.record_round(d, r.randint(0, d), d * per_draft * r.uniform(0.8, 1.2))
    return out


def batch(seeds: int) -> list:
    out = []
    for seed in range(seeds):
        r = random.Random(1000 + seed)
        g = BatchGamma(gamma_max=8)
        for _ in range(800):
            running = r.choice([1, 2, 3, 4, 8])
            rows = running + r.randint(0, 3) * running
            g.record(running, rows, 0.01 + 0.001 * rows * r.uniform(0.5, 3) + 0.002 * running)
            if r.random() < 0.5:
                g.record_draft(running, running * r.choice([1, 2, 40]), 0.001 * running * r.uniform(0.5, 2))
            alpha = r.random() if r.random() < 0.8 else None
            proposed = r.random() if r.random() < 0.8 else None
            g.learn(r.choice(["ngram", "draft", FREE]), alpha, proposed, r.randint(0, 99))
            drafted = r.random() < 0.5
            seconds = 0.02 * r.uniform(0.5, 2) * (1.5 if drafted else 1)
            g.observe(running, drafted, r.randint(running, 4 * running), seconds, r.randint(0, 4))
            seqs = [
                Seq(
                    r.random(),
                    r.random(),
                    r.random() < 0.5,
                    r.randint(0, 50),
                    r.randint(1, 200),
                    r.choice(["ngram", "draft", "none"]),
                )
                for _ in range(running)
            ]
            out += [g.choose(seqs), g.free_limit(running)]
    return out


def suffix_limit(seeds: int) -> list:
    scales = (0.5, 1.0, 2.0)
    configs = {x: SuffixConfig().scaled(x) for x in scales}
    out = []
    for seed in range(seeds):
        r = random.Random(5000 + seed)
        tuner, cost = LimitTuner(), VerifyCost()
        row = r.choice([0.00001, 0.001, 0.01])
        for step in range(400):
            if step % 100 == 99:
                row = r.choice([0.00001, 0.001, 0.01, 0.05])
            x = tuner.choose(scales, cost.line())
            out.append(x)
            match = r.randint(1, 12)
            j = configs[x].limit(match)
            cost.record(j + 1, 0.001 + row * (j + 1))
            tuner.record(x, j, r.randint(0, j), match, configs)
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=40, help="random streams per strategy (default 40)")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    for name, run in (("gamma controller", controller), ("batch gamma", batch), ("suffix limit", suffix_limit)):
        decisions = run(args.seeds)
        digest = hashlib.sha256(repr(decisions).encode()).hexdigest()[:16]
        print(f"{name:<17} {len(decisions):>6} decisions  sha256 {digest}  zeros {decisions.count(0)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
