"""Recipes: every bundled recipe loads and round-trips; valid variations parse (defaults, every
draft form, overrides, frozen); recipe files (YAML errors name the file and line); a property-based
round trip. Bad input is in test_recipe_errors.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from recipe_support import MINIMAL, bad, with_

from specexport.errors import RecipeError
from specexport.recipe.load import (
    DEFAULT_RECIPE,
    RECIPES_DIR,
    DraftSpec,
    Recipe,
    bundled_recipes,
    dump_recipe,
    load_recipe,
    parse_recipe,
    resolve_recipe,
)
from specexport.recipe.reader import with_overrides

RECIPE_FILES = sorted(RECIPES_DIR.glob("*.yaml"))


# --------------------------------------------------------------------------- bundled recipes


def test_recipes_folder_is_not_empty():
    assert RECIPE_FILES, f"no recipes in {RECIPES_DIR}"
    assert bundled_recipes() == RECIPE_FILES


@pytest.mark.parametrize("path", RECIPE_FILES, ids=lambda p: p.name)
def test_bundled_recipe_loads_and_round_trips(path: Path):
    recipe = load_recipe(path)
    assert recipe.name == path.stem, "a recipe's name is its file name, so `--recipe NAME` finds it"
    assert recipe.source == str(path)
    assert parse_recipe(recipe.to_dict(), "again") == recipe
    assert yaml.safe_load(dump_recipe(recipe)) == recipe.to_dict()
    if not recipe.tested_here:
        assert recipe.notes, "a recipe the project does not run says which device it targets in notes"


def test_default_recipe():
    recipe = load_recipe(resolve_recipe(DEFAULT_RECIPE))
    assert recipe.target.model == "builtin:smollm2-135m-instruct"
    assert recipe.target.builtin_name == "smollm2-135m-instruct"
    assert recipe.target.precision == "fp32"
    assert recipe.draft.kind == "from_target" and recipe.draft.precision == "int8"
    assert recipe.speculation.gamma == 8 and recipe.graph == "fused"
    assert recipe.proposer == recipe.speculation.proposer == "hybrid"
    assert recipe.max_context == 2048
    assert recipe.tested_here is True


def test_bundled_kinds():
    kinds = {load_recipe(p).name: load_recipe(p).draft for p in RECIPE_FILES}
    assert kinds["smollm2-135m-ngram"].kind == "ngram"
    assert kinds["smollm2-135m-ngram"].ngram_sizes == (3, 2, 1)
    assert not kinds["smollm2-135m-ngram"].has_graph
    assert kinds["smollm2-135m-int4-draft"].precision == "int4"
    assert any(d.kind == "model" for d in kinds.values())


def test_resolve_recipe(tmp_path):
    assert resolve_recipe("smollm2-135m") == RECIPES_DIR / "smollm2-135m.yaml"
    assert resolve_recipe("smollm2-135m.yaml") == RECIPES_DIR / "smollm2-135m.yaml"
    own = tmp_path / "mine.yaml"
    own.write_text(yaml.safe_dump(MINIMAL))
    assert resolve_recipe(own) == own
    with pytest.raises(RecipeError, match="smollm2-135m"):  # lists the bundled names
        resolve_recipe("no-such-recipe")


# --------------------------------------------------------------------------- valid variations


def test_minimal_recipe_defaults():
    recipe = parse_recipe(MINIMAL)
    assert recipe.target.precision == "fp32"
    assert recipe.target.gguf_file is None and recipe.target.revision is None
    assert recipe.target.trust_remote_code is False
    assert recipe.speculation.gamma == 4 and recipe.speculation.max_gamma == 8 and recipe.speculation.adaptive
    assert recipe.validation.enabled is True and recipe.validation.prompt is None
    assert recipe.tested_here is False
    assert recipe.description is None and recipe.notes is None


def test_from_target_defaults_to_int8():
    assert parse_recipe(with_(MINIMAL, "draft", {"from_target": None})).draft.precision == "int8"
    assert parse_recipe(with_(MINIMAL, "draft", {"from_target": {}})).draft.precision == "int8"


def test_model_draft_form():
    data = with_(
        MINIMAL, "draft", {"model": "Qwen/Qwen2.5-0.5B-Instruct", "precision": "dynamic-int8", "revision": "main"}
    )
    draft = parse_recipe(data).draft
    assert draft.kind == "model" and draft.precision == "dynamic-int8"
    assert draft.model.model == "Qwen/Qwen2.5-0.5B-Instruct" and draft.model.revision == "main"


def test_gguf_target():
    data = with_(MINIMAL, "target", {"model": "/models/wheels", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"})
    assert parse_recipe(data).target.is_gguf
    assert parse_recipe(with_(MINIMAL, "target.model", "/m/x.Q8_0.gguf")).target.is_gguf
    bad(with_(MINIMAL, "target", {"model": "/m/x.gguf", "gguf_file": "y.gguf"}), "target.gguf_file", "'y.gguf'")
    bad(with_(MINIMAL, "target.gguf_file", "model.bin"), "target.gguf_file", "'model.bin'", ".gguf")


def test_max_gamma_defaults_to_at_least_gamma():
    recipe = parse_recipe(with_(MINIMAL, "speculation", {"gamma": 12}))
    assert recipe.speculation.max_gamma == 12


def test_paths_are_not_checked_here():
    recipe = parse_recipe(with_(MINIMAL, "target.model", "/does/not/exist"))
    assert recipe.target.model == "/does/not/exist"


def test_to_dict_round_trip_every_form():
    forms = [
        {"from_target": {"precision": "int4"}},
        {"model": "org/draft", "precision": "fp16", "gguf_file": "d.gguf", "trust_remote_code": True},
        {"proposer": "ngram", "ngram_sizes": [4, 2]},
    ]
    for form in forms:
        data = with_(MINIMAL, "draft", form)
        data["validation"] = {"enabled": False, "prompt": "Hello"}
        data["notes"] = "n"
        recipe = parse_recipe(data)
        again = parse_recipe(recipe.to_dict())
        assert again == recipe
        assert again.to_dict() == recipe.to_dict()


def test_speculation_proposer_follows_the_draft_form():
    minimal = parse_recipe(MINIMAL)
    assert minimal.proposer == "draft" and minimal.speculation.proposer is None  # follows the draft form
    assert with_overrides(minimal, {"draft": {"proposer": "ngram"}}).proposer == "ngram"
    hybrid = parse_recipe({**MINIMAL, "speculation": {"proposer": "hybrid"}})
    assert hybrid.proposer == "hybrid" and parse_recipe(hybrid.to_dict()) == hybrid
    ngram = {**MINIMAL, "draft": {"proposer": "ngram"}}
    assert parse_recipe(ngram).proposer == "ngram"
    with pytest.raises(RecipeError, match="speculation.proposer = 'hybrid' is not allowed with the n-gram proposer"):
        parse_recipe({**ngram, "speculation": {"proposer": "hybrid"}})
    with pytest.raises(RecipeError, match="speculation.proposer = 'ngram' is not allowed with a draft model"):
        parse_recipe({**MINIMAL, "speculation": {"proposer": "ngram"}})
    with pytest.raises(RecipeError, match="speculation.proposer = 'medusa'"):
        parse_recipe({**MINIMAL, "speculation": {"proposer": "medusa"}})


def test_with_overrides():
    recipe = parse_recipe(MINIMAL)
    changed = with_overrides(recipe, {"speculation.gamma": 6, "max_context": 4096})
    assert changed.speculation.gamma == 6 and changed.max_context == 4096
    assert recipe.speculation.gamma == 4  # frozen original untouched
    with pytest.raises(RecipeError, match="speculation.gamma"):
        with_overrides(recipe, {"speculation.gamma": 0})
    with pytest.raises(RecipeError, match="gama"):
        with_overrides(recipe, {"speculation.gama": 6})


def test_frozen():
    recipe = parse_recipe(MINIMAL)
    with pytest.raises(AttributeError):
        recipe.name = "other"  # type: ignore[misc]


def test_draftspec_rejects_inconsistent_construction():
    with pytest.raises(RecipeError):
        DraftSpec(kind="telepathy")
    with pytest.raises(RecipeError):
        DraftSpec(kind="model", precision="fp16")


# --------------------------------------------------------------------------- files


def test_load_from_file(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(MINIMAL))
    recipe = load_recipe(path)
    assert isinstance(recipe, Recipe) and recipe.source == str(path)
    assert recipe == parse_recipe(MINIMAL)


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("name: x\nmax_context: 256\ntarget:\n  model: [unclosed\ndraft: {}\n")
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    message = str(info.value)
    assert str(path) in message and "YAML syntax error" in message
    assert "line 5" in message, message


def test_yaml_bad_indentation(tmp_path):
    path = tmp_path / "indent.yaml"
    path.write_text("name: x\n  max_context: 256\n")
    with pytest.raises(RecipeError, match=r"indent\.yaml: YAML syntax error at line 2"):
        load_recipe(path)


def test_duplicate_key_is_an_error(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text(yaml.safe_dump(MINIMAL) + "max_context: 512\n")
    with pytest.raises(RecipeError, match=r"duplicate key 'max_context'"):
        load_recipe(path)


def test_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(RecipeError, match="does not exist") as info:
        load_recipe(path)
    assert str(path) in str(info.value)


def test_directory_instead_of_file(tmp_path):
    with pytest.raises(RecipeError, match="not a file"):
        load_recipe(tmp_path)


def test_empty_file(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing\n")
    with pytest.raises(RecipeError, match="empty"):
        load_recipe(path)


def test_semantic_error_names_file(tmp_path):
    path = tmp_path / "gamma.yaml"
    path.write_text(yaml.safe_dump(with_(MINIMAL, "speculation.gamma", 0)))
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert str(path) in str(info.value) and "speculation.gamma" in str(info.value)


# --------------------------------------------------------------------------- property: round trip

_text = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=20).filter(str.strip)
_model = st.fixed_dictionaries(
    {"model": _text},
    optional={
        "revision": st.none() | _text,
        "trust_remote_code": st.booleans(),
        "gguf_file": st.none() | st.just("w.Q8_0.gguf"),
    },
).filter(lambda m: not m["model"].lower().endswith(".gguf") and not m["model"].startswith("builtin:"))
_draft = st.one_of(
    st.builds(lambda p: {"from_target": {"precision": p}}, st.sampled_from(["int8", "int4", "dynamic-int8", "fp16"])),
    st.builds(
        lambda p, b: {"from_target": {"precision": p, "block_size": b}},
        st.sampled_from(["int8", "int4"]),
        st.sampled_from([16, 32, 64, 128, 256]),
    ),
    st.builds(
        lambda m, p: {**m, "precision": p}, _model, st.sampled_from(["fp32", "fp16", "int8", "int4", "dynamic-int8"])
    ),
    st.builds(
        lambda s: {"proposer": "ngram", "ngram_sizes": s},
        st.lists(st.integers(1, 16), min_size=1, max_size=4, unique=True),
    ),
)


@settings(max_examples=60, deadline=None)
@given(
    name=st.from_regex(r"[a-z0-9][a-z0-9._-]{0,19}", fullmatch=True),
    max_context=st.integers(16, 131072),
    target=st.builds(lambda m, p: {**m, "precision": p}, _model, st.sampled_from(["fp32", "fp16"])),
    draft=_draft,
    gamma=st.integers(1, 16),
    extra=st.integers(0, 15),
    adaptive=st.booleans(),
    validation=st.fixed_dictionaries({"enabled": st.booleans(), "prompt": st.none() | _text}),
    tested_here=st.booleans(),
)
def test_round_trip_property(name, max_context, target, draft, gamma, extra, adaptive, validation, tested_here):
    data = {
        "name": name,
        "max_context": max_context,
        "target": target,
        "draft": draft,
        "speculation": {"gamma": gamma, "max_gamma": min(16, gamma + extra), "adaptive": adaptive},
        "validation": validation,
        "tested_here": tested_here,
    }
    recipe = parse_recipe(data)
    assert parse_recipe(recipe.to_dict()) == recipe
    assert parse_recipe(yaml.safe_load(dump_recipe(recipe))) == recipe
    assert recipe.draft.kind in ("from_target", "model", "ngram")


def test_speculation_hybrid_retrieval():
    assert parse_recipe(MINIMAL).speculation.hybrid_retrieval == "suffix"  # the default
    lookup = parse_recipe(with_(MINIMAL, "speculation", {"hybrid_retrieval": "lookup"}))
    assert lookup.speculation.hybrid_retrieval == "lookup" and parse_recipe(lookup.to_dict()) == lookup
    bad(
        with_(MINIMAL, "speculation", {"hybrid_retrieval": "tree"}),
        "speculation.hybrid_retrieval",
        "'tree'",
        "lookup, suffix",
    )
