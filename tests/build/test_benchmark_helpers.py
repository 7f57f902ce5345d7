"""Pure helpers of benchmarks/experiments/verify_cost.py and datastore_acceptance.py (no artifact)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2] / "benchmarks" / "experiments"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, _ROOT / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


vc = _module("verify_cost")
da = _module("datastore_acceptance")


def _costs(v: dict[int, float]) -> dict:
    return {"decode_s": 1.0, "target_s": dict(v)}


def test_needed_alpha_with_free_verify_rows():
    # every call costs one step: the best round drafts the most tokens; E = sum alpha^i for
    # i <= 16 reaches 1.3 first at alpha 0.24 (alpha 0.23 gives 1/(1 - 0.23) < 1.3)
    costs = _costs({s: 1.0 for s in range(2, 18)})
    assert vc.needed_alpha(1.3, 0.0, costs) == {"alpha": 0.24, "gamma": 16}


def test_needed_alpha_one_token_round():
    # only gamma 1 is affordable: (1 + alpha) / 1.2 >= 1.46  <=>  alpha >= 0.752 -> 0.76
    costs = _costs({2: 1.2, **{s: 50.0 for s in range(3, 18)}})
    assert vc.needed_alpha(1.46, 0.0, costs) == {"alpha": 0.76, "gamma": 1}
    # a draft step of 0.1 of a target step: (1 + alpha) / 1.3 >= 1.46  <=>  alpha >= 0.898 -> 0.9
    assert vc.needed_alpha(1.46, 0.1, costs) == {"alpha": 0.9, "gamma": 1}


def test_needed_alpha_unreachable_when_rows_cost_full_steps():
    costs = _costs({s: float(s) for s in range(2, 18)})  # E <= S = v(S): never above 1x
    assert vc.needed_alpha(1.3, 0.0, costs) == {"alpha": None, "gamma": None}


def test_matched_counts_the_leading_run():
    assert da.matched([5, 6, 7], [5, 6, 8, 9]) == 2
    assert da.matched([5, 6], [5, 6, 7]) == 2
    assert da.matched([4], [5]) == 0
    assert da.matched([5, 6, 7], [5]) == 1  # the answer ends


def test_summary_of_positions():
    rows = [{"drafted": 4, "accepted": 2}, {"drafted": 2, "accepted": 0}, {"drafted": 3, "accepted": 3}]
    assert da.summary(rows) == {
        "positions": 3,
        "drafted": 9,
        "first_token_right": round(2 / 3, 3),
        "accepted_per_draft": round(5 / 3, 2),
        "token_acceptance": round(5 / 9, 3),
    }
    assert da.summary([])["first_token_right"] is None
