"""specexport calibrate on tiny artifacts: the gamma picked per domain and proposer (the largest for a
self-draft, zero for a draft that never agrees, an EAGLE-3 head's own proposer), the profile
written into the artifact beside others, and the warm-up outside the calibrated prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_support import NEW, PROMPTS, _copy

from specexport.bench.calibrate import calibrate, profile_gamma
from specexport_runtime.api import CALIBRATION_NAME, load
from specexport_runtime.errors import InvalidArgument
from specexport_runtime.manifest import read_manifest, verify_files

CHEAP_DRAFT = {"decode_s": 1.0, "verify_s": {s: 1.0 for s in range(2, 10)}, "draft_step_s": 0.01}


@pytest.fixture(scope="module")
def far_artifact(tmp_path_factory) -> Path:
    """A draft from another random seed: it almost never agrees with the target."""
    from tiny import make_model, save_hf_folder, write_recipe

    from specexport.build.artifact import build_artifact
    from specexport.recipe.load import load_recipe

    work = tmp_path_factory.mktemp("tiny-far")
    target = save_hf_folder(make_model(), work / "target-hf")
    draft = save_hf_folder(make_model(seed=7), work / "draft-hf")
    recipe = write_recipe(work / "recipe.yaml", target, {"model": str(draft), "precision": "fp32"}, name="tiny-far")
    build_artifact(load_recipe(recipe), work / "artifact")
    return work / "artifact"


def test_calibrate_self_picks_largest_gamma(tiny_artifacts, tmp_path):
    art = _copy(tiny_artifacts["self"], tmp_path)
    doc = calibrate(
        art,
        domains=("code", "chat"),
        proposers=["draft"],
        prompts=PROMPTS,
        max_new_tokens=NEW,
        device_name="devA",
        costs=CHEAP_DRAFT,
    )
    prof = doc["profiles"]["devA"]
    assert doc["version"] == 1 and doc["default_profile"] == "devA"
    assert set(prof["domains"]) == {"code", "chat", "default"}
    for entry in (prof["domains"][d]["draft"] for d in ("code", "chat", "default")):
        assert entry["gamma"] == 8 and entry["expected_speedup"] > 1
        assert entry["acceptance_rate"] == 1.0
        assert len(entry["acceptance_by_position"]) == 8 and set(entry["acceptance_by_position"]) <= {1.0, None}
    on_disk = json.loads((art / CALIBRATION_NAME).read_text())
    assert on_disk == json.loads(json.dumps(doc))
    manifest = read_manifest(art)
    assert CALIBRATION_NAME in manifest.files
    verify_files(art, manifest)
    assert not [p for p in art.iterdir() if p.name.endswith(".tmp")]
    assert profile_gamma(on_disk, "code", "draft") == 8 and profile_gamma(on_disk, "unknown", "draft") == 8

    # a second device (measured costs this time) is added beside the first
    doc2 = calibrate(art, domains=("code",), prompts=PROMPTS, max_new_tokens=NEW, device_name="devB", set_default=False)
    assert set(doc2["profiles"]) == {"devA", "devB"} and doc2["default_profile"] == "devA"
    costs = doc2["profiles"]["devB"]["costs"]
    assert costs["decode_s"] > 0 and set(costs["draft_step_s"]) == {"draft", "ngram"}
    assert set(costs["verify_s"]) == {str(s) for s in range(2, 10)}
    assert set(doc2["profiles"]["devB"]["domains"]["code"]) == {"draft", "ngram"}
    verify_files(art, read_manifest(art))
    assert load(art).calibration == json.loads((art / CALIBRATION_NAME).read_text())


def test_calibrate_warms_up_outside_the_calibrated_prompts(tiny_artifacts, monkeypatch):
    """The first generation is the harness's warm-up prompt, in no calibrated domain; the rest are
    the calibrated prompts; the profile names this machine."""
    from specexport.bench import calibrate as calibrate_module
    from specexport.bench.harness import WARMUP_ID, warmup_case
    from specexport.bench.machine import cpu_model

    seen = []
    run_one = calibrate_module.run_one

    def observed(gen, case, config, **kw):
        seen.append(case)
        return run_one(gen, case, config, **kw)

    monkeypatch.setattr(calibrate_module, "run_one", observed)
    doc = calibrate(
        tiny_artifacts["self"],
        domains=("code", "chat"),
        proposers=["draft"],
        prompts=PROMPTS,
        max_new_tokens=NEW,
        device_name="devW",
        costs=CHEAP_DRAFT,
        write=False,
    )
    warm, measured = seen[0], seen[1:]
    assert warm.id == WARMUP_ID and warm.ids == warmup_case(load(tiny_artifacts["self"]).codec).ids
    assert [c.id for c in measured] == ["t-code-1", "t-code-2", "t-chat-1"]
    assert warm.ids not in {c.ids for c in measured}
    device = doc["profiles"]["devW"]["device"]
    assert set(device) == {"platform", "cpu", "cpu_count", "machine", "threads"} and device["cpu"] == cpu_model()


def test_calibrate_disagreeing_draft_picks_zero(far_artifact, tmp_path):
    art = _copy(far_artifact, tmp_path)
    doc = calibrate(
        art,
        domains=("code", "chat", "copy_edit"),
        proposers=["draft"],
        prompts=PROMPTS,
        max_new_tokens=NEW,
        device_name="devA",
        costs=CHEAP_DRAFT,
    )
    for d, per in doc["profiles"]["devA"]["domains"].items():
        entry = per["draft"]
        assert entry["acceptance_rate"] < 0.2, d
        assert entry["gamma"] == 0 and entry["expected_speedup"] == 1.0, d
        assert max(entry["expected_speedup_by_gamma"].values()) < 1.0
    verify_files(art, read_manifest(art))


def test_calibrate_an_eagle_head(tiny_artifacts, tmp_path):
    """An artifact with an EAGLE-3 head calibrates the 'eagle' proposer (its step timed in the
    loop: head calls per drafted token) beside n-gram; 'draft' is not offered."""
    art = _copy(tiny_artifacts["eagle3"], tmp_path)
    doc = calibrate(art, domains=("code",), prompts=PROMPTS, max_new_tokens=NEW, device_name="devE")
    prof = doc["profiles"]["devE"]
    assert set(prof["domains"]["code"]) == {"eagle", "ngram"}
    assert prof["costs"]["draft_step_s"]["eagle"] > 0
    with pytest.raises(InvalidArgument, match="'draft' is not available"):
        calibrate(art, domains=("code",), proposers=["draft"], prompts=PROMPTS, max_new_tokens=NEW)
