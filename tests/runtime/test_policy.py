"""The draft-length policy: the probe clock every strategy times its probes with, the order in
which a generation's RoundDraft answers, and DraftPolicy's one cost model and its controllers."""

from __future__ import annotations

import pytest

from specexport_runtime import registry
from specexport_runtime.adaptive import GammaController
from specexport_runtime.config import GeneratorConfig
from specexport_runtime.errors import InvalidArgument
from specexport_runtime.generator import SpeculativeLoop
from specexport_runtime.pacing import ProbeClock
from specexport_runtime.policy import DraftPolicy, RoundDraft


def test_probe_clock_waits_backs_off_to_its_cap_and_resets():
    clock = ProbeClock(4, 16)
    assert (clock.every, clock.due) == (4, 4)
    due = []
    for _ in range(6):
        clock.tick()
        due.append(clock.is_due)
    assert due == [False, False, False, True, True, True]  # due from the 4th decision on
    for want in (8, 16, 16):  # doubles, then stays at the cap
        clock.back_off()
        assert clock.every == want
    clock.wait()
    assert clock.due == 6 + 16 and not clock.is_due
    clock.due_within(3)
    assert clock.due == 9
    clock.reset()
    assert clock.every == 4
    clock.due_now()
    assert clock.is_due


def test_probe_clock_aligned_probes_fall_on_multiples():
    clock = ProbeClock(8, 32)
    hits = []
    for n in range(1, 70):
        clock.tick()
        clock.align(32 if n > 40 else 8)
        if clock.is_due:
            hits.append(n)
    assert hits == [8, 16, 24, 32, 40, 64]


def test_probe_clock_counts_off_a_probe_of_several_rounds():
    clock = ProbeClock(64, 1024)
    clock.begin(3, drafting=False)
    assert [clock.in_probe() for _ in range(4)] == [True, True, True, False]
    assert clock.drafting is False


def test_round_draft_answers_in_order():
    ctl = GammaController(cost_decode=0.01)  # a plain step is timed: it asks for its initial gamma
    assert RoundDraft(False, fixed=3, controller=ctl).gamma() == 0  # not speculating beats all
    assert RoundDraft(True, fixed=3, controller=ctl, assigned=5).gamma() == 3  # a fixed gamma beats the batch
    batch = RoundDraft(True, controller=ctl, batched=True)
    assert batch.assign(5, 7) is None and batch.gamma() == 5 and batch.free_cap() == 7
    assert batch.assign(0, 2) == 5  # returns the last round's
    assert RoundDraft(True, controller=ctl).gamma() == ctl.gamma  # else the controller's choice
    assert RoundDraft(True).gamma() == 0  # nothing to ask: plain steps
    assert RoundDraft(True, fixed=3, assigned=5, free_limit=7).free_cap() == 0  # a fixed gamma caps free drafts


def test_round_draft_times_solo_calls_only():
    solo, batched = RoundDraft(True), RoundDraft(True, batched=True)
    for draft in (solo, batched):
        draft.timed(3, 0.02)
        draft.timed(1, 0.0)  # no time: not a timing
    assert solo.cost.by_rows == {3: 0.02} and batched.cost.by_rows == {}
    ctl = GammaController()
    assert RoundDraft(True, controller=ctl).cost is ctl.cost  # no cost given: the controller's


def test_draft_policy_has_one_cost_model_and_keeps_its_controllers():
    spec = registry.get("ngram")
    policy = DraftPolicy()
    config = GeneratorConfig(proposer="ngram")
    first = policy.for_generation(spec, config)
    assert first.controller is policy.for_generation(spec, config).controller  # kept across calls
    assert first.controller.cost is policy.cost and first.cost is policy.cost
    assert policy.batch(8).cost is policy.cost.batch and policy.batch(4) is policy.batch(8)
    assert policy.for_generation(spec, config, batched=True).controller is None  # the batch decides
    assert policy.for_generation(spec, config.replace(gamma=3)).fixed == 3
    off = policy.for_generation(registry.get("none"), GeneratorConfig(proposer="none"))
    assert not off.speculating and off.gamma() == 0


def test_draft_policy_starts_from_calibration():
    calibration = {"domains": {"default": {"ngram": {"gamma": 6, "alpha": 0.9}, "draft": {"gamma": 0}}}}
    policy = DraftPolicy(calibration, draft_kind="decoder")
    ngram = policy.controller(registry.get("ngram"), GeneratorConfig(proposer="ngram"))
    assert (ngram.gamma, ngram.alpha, ngram.speculating) == (6, 0.9, True)
    draft = policy.controller(registry.get("draft"), GeneratorConfig(proposer="draft"))
    assert not draft.speculating  # a calibrated 0 starts it off
    fixed = policy.for_generation(registry.get("ngram"), GeneratorConfig(proposer="ngram", adaptive=False))
    assert fixed.fixed == 6 and fixed.controller is None  # a non-adaptive artifact: the start, fixed
    none = policy.for_generation(registry.get("draft"), GeneratorConfig(proposer="draft", adaptive=False))
    assert none.fixed is None and none.gamma() == 0  # calibrated off, fixed: plain steps


def test_bad_setups_are_typed_errors():
    with pytest.raises(InvalidArgument, match="first <= cap"):
        ProbeClock(8, 4)
    with pytest.raises(InvalidArgument, match="first <= cap"):
        ProbeClock(0, 4)
    with pytest.raises(TypeError, match="LoopSetup"):
        SpeculativeLoop(None)


def test_the_policy_replay_experiment_runs_every_strategy():
    """benchmarks/experiments/policy_replay.py (the before/after check of a policy refactor)
    drives each strategy through its public interface: the decisions come out, of both kinds."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "experiments" / "policy_replay.py"
    spec = importlib.util.spec_from_file_location("policy_replay", path)
    replay = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = replay  # its dataclass looks its module up
    spec.loader.exec_module(replay)
    gammas = replay.controller(2)
    assert len(gammas) == 1200 and 0 in gammas and any(g > 0 for g in gammas)
    assert len(replay.batch(1)) == 1600
    assert set(replay.suffix_limit(1)) == {0.5, 1.0, 2.0}
