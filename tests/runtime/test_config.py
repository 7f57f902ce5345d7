"""GeneratorConfig: built from manifest defaults plus overrides, validated at construction (one
InvalidArgument naming the field, the value and what was expected), frozen; the gamma policy it
states is the one the generator runs, `speculation.adaptive: false` included; per-call stats come
with the generation."""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import replace

import pytest

from specexport_runtime import config as cfg
from specexport_runtime.api import SpecGenerator, load
from specexport_runtime.config import GeneratorConfig
from specexport_runtime.constants import DEFAULT_HYBRID_RETRIEVAL, DEFAULT_NGRAM_SIZES, MAX_GAMMA
from specexport_runtime.errors import ArtifactError, InvalidArgument
from specexport_runtime.manifest import MANIFEST_NAME, read_manifest
from specexport_runtime.suffix import SuffixConfig, SuffixProposer


@pytest.mark.parametrize(
    "field, value, shown",
    [
        ("proposer", "medusa", "'medusa'"),
        ("speculative", 1, "speculative must be true or false, got 1"),
        ("gamma", 0, "1..32"),
        ("gamma", MAX_GAMMA + 1, str(MAX_GAMMA + 1)),
        ("gamma", 2.0, "2.0"),
        ("max_gamma", 40, "max_gamma must be an integer in 1..32, got 40"),
        ("initial_gamma", 9, "initial_gamma must be an integer in 1..8 (max_gamma), got 9"),
        ("min_draft_prob", 1.0, "min_draft_prob must be a number in [0, 1), got 1.0"),
        ("max_new_tokens", 0, "max_new_tokens must be an integer >= 1, got 0"),
        ("temperature", -1.0, "temperature"),
        ("top_p", 0.0, "top_p"),
        ("seed", -3, "seed"),
        ("stop", ("a", ""), "stop must be non-empty strings, got ('a', '')"),
        ("ngram_sizes", (3, 3), "ngram_sizes must be distinct integers in 1..16"),
        ("ngram_sizes", (), "ngram_sizes"),
        ("hybrid_retrieval", "tree", "hybrid_retrieval must be one of lookup, suffix, got 'tree'"),
        ("suffix", {"max_spec": 3}, "suffix must be a suffix.SuffixConfig"),
        ("domain", 5, "domain must be a calibration domain name or None, got 5"),
        ("controller", {"probe_every": 0}, "probe_every"),
        ("controller", {"speed": 1}, "controller option 'speed' is not one of"),
        ("controller", {"gamma_max": 4}, "controller option 'gamma_max'"),
    ],
)
def test_every_field_is_checked_at_construction(field, value, shown):
    with pytest.raises(InvalidArgument) as info:
        GeneratorConfig(**{field: value})
    assert shown in str(info.value) and "\n" not in str(info.value)


def test_frozen_normalised_and_replace_checks_names():
    c = GeneratorConfig(stop="END", ngram_sizes=[2, 1], controller={"gamma_tolerance": 0.1})
    assert c.stop == ("END",) and c.ngram_sizes == (2, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.gamma = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        c.controller["gamma_tolerance"] = 0.2  # type: ignore[index]
    assert c.replace(proposer=None) is c and c.replace(gamma=3).gamma == 3
    with pytest.raises(InvalidArgument, match="unknown generation setting 'gama'; known: adaptive"):
        c.replace(gama=3)
    with pytest.raises(InvalidArgument, match="gamma"):
        c.replace(gamma=99)


@pytest.mark.parametrize(
    "changes, policy",
    [
        ({}, cfg.ADAPTIVE),
        ({"gamma": 3}, cfg.FIXED),
        ({"temperature": 0.7, "seed": 1}, cfg.ADAPTIVE),  # seeded noise: the output does not depend on gamma
        ({"temperature": 0.7, "seed": 1, "seeded_noise": False}, cfg.SEEDED),
        ({"temperature": 0.0, "seed": 1}, cfg.ADAPTIVE),  # greedy: a seed changes nothing
        ({"adaptive": False}, cfg.ARTIFACT),
        ({"adaptive": False, "gamma": 2}, cfg.FIXED),
        ({"speculative": False}, cfg.OFF),
        ({"proposer": "none"}, cfg.OFF),
    ],
)
def test_gamma_policy(changes, policy):
    c = GeneratorConfig(**changes)
    assert c.gamma_policy == policy and c.speculating == (policy != cfg.OFF)


def test_manifest_defaults(tiny_artifacts):
    m = read_manifest(tiny_artifacts["noisy"])
    c = GeneratorConfig.from_manifest(m)
    assert (c.proposer, c.initial_gamma, c.max_gamma, c.adaptive) == (
        m.speculation.proposer,
        m.speculation.gamma,
        m.max_gamma,
        True,
    )
    assert c.ngram_sizes == DEFAULT_NGRAM_SIZES and c.hybrid_retrieval == DEFAULT_HYBRID_RETRIEVAL
    assert GeneratorConfig.from_manifest(m, gamma=5, proposer="ngram").gamma == 5


def _edited(src, tmp_path, edit):
    root = tmp_path / "art"
    shutil.copytree(src, root)
    data = json.loads((root / MANIFEST_NAME).read_text())
    edit(data)
    (root / MANIFEST_NAME).write_text(json.dumps(data))  # not checksummed itself: the files still verify
    return root


def test_hybrid_retrieval_is_read_from_the_manifest(tiny_artifacts, tmp_path):
    """speculation.hybrid_retrieval: absent (older manifests) = the default (suffix drafts, then
    lookup); "lookup" = prompt lookup only; anything else is refused at load."""
    gen = load(tiny_artifacts["noisy"])
    assert [type(r) for r in gen.build_proposer("hybrid", gen.config).retrievers][0] is SuffixProposer
    root = _edited(tiny_artifacts["noisy"], tmp_path, lambda d: d["speculation"].update(hybrid_retrieval="lookup"))
    lookup = load(root)
    assert lookup.config.hybrid_retrieval == "lookup"
    assert [r.name for r in lookup.build_proposer("hybrid", lookup.config).retrievers] == ["ngram"]
    older = _edited(tiny_artifacts["noisy"], tmp_path / "o", lambda d: d["speculation"].pop("hybrid_retrieval", None))
    assert read_manifest(older).speculation.hybrid_retrieval == DEFAULT_HYBRID_RETRIEVAL
    bad = _edited(tiny_artifacts["noisy"], tmp_path / "b", lambda d: d["speculation"].update(hybrid_retrieval="tree"))
    with pytest.raises(ArtifactError, match="hybrid_retrieval"):
        load(bad)


def test_adaptive_false_keeps_gamma_at_its_start(gens):
    """speculation.adaptive false: no controller; every round drafts the starting gamma (the
    manifest's speculation.gamma without calibration), and greedy output is the target's."""
    gen = gens("noisy")
    fixed = SpecGenerator(
        root=gen.root,
        manifest=gen.manifest,
        codec=gen.codec,
        target=gen.target,
        draft=gen.draft,
        calibration=gen.calibration,
        config=gen.config.replace(adaptive=False, proposer="draft"),
    )
    base = fixed.generate("def add(a, b):", max_new_tokens=40, speculative=False).token_ids
    run = fixed.events("def add(a, b):", max_new_tokens=40)
    assert run.collect().token_ids == base and run.gamma_policy == cfg.ARTIFACT
    start = gen.manifest.speculation.gamma
    assert run.stats.plain_steps == 0 and {k for k, _ in run.stats.round_sizes} == {start}
    assert not fixed.policy.controllers
    assert fixed.events([5, 6], gamma=2).gamma_policy == cfg.FIXED


def test_each_generation_carries_its_own_stats(gens):
    """Each generation's stats are its own (no shared last_stats): a later one leaves them alone."""
    gen = gens("noisy")
    a = gen.events("def add(a, b):", max_new_tokens=12, gamma=2)
    ra = a.collect()
    kept = ra.stats.to_dict()
    b = gen.events([40, 41, 42] * 3, max_new_tokens=5, speculative=False)
    rb = b.collect()
    assert ra.stats is a.stats and rb.stats is b.stats and a.stats.to_dict() == kept
    assert a.stats.new_tokens == len(ra.token_ids) and b.stats.new_tokens == len(rb.token_ids) == 5
    assert a.stats.drafted > 0 and b.stats.drafted == 0 and (a.gamma_policy, b.gamma_policy) == (cfg.FIXED, cfg.OFF)


def test_load_checks_the_config_before_the_sessions(tiny_artifacts):
    with pytest.raises(InvalidArgument, match="'eagle' needs an artifact with an EAGLE-3 draft head"):
        load(tiny_artifacts["noisy"], config={"proposer": "eagle"})
    with pytest.raises(InvalidArgument, match="gamma"):
        load(tiny_artifacts["noisy"], config={"gamma": 0})
    gen = load(tiny_artifacts["ngram"], config={"suffix": SuffixConfig(max_spec=3), "max_new_tokens": 7})
    assert gen.config.suffix.max_spec == 3 and len(gen.generate([5, 6, 7]).token_ids) <= 7
    assert replace(gen.config, gamma=4).gamma == 4
