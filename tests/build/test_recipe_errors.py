"""Recipes: every kind of bad input raises RecipeError naming the problem (the key and where it
is, the value, what is allowed)."""

from __future__ import annotations

import copy

import pytest
from recipe_support import MINIMAL, bad, with_

from specexport.errors import RecipeError, SpecExportError
from specexport.recipe.load import parse_recipe


def without(base: dict, dotted: str) -> dict:
    data = copy.deepcopy(base)
    node = data
    *parents, last = dotted.split(".")
    for part in parents:
        node = node[part]
    del node[last]
    return data


def test_error_is_a_specexport_error():
    assert issubclass(RecipeError, SpecExportError)


def test_unknown_top_level_key():
    msg = bad(with_(MINIMAL, "max_contxt", 4096), "'max_contxt'", "top level", "max_context", "did you mean")
    assert "allowed keys" in msg


@pytest.mark.parametrize(
    "dotted, section",
    [
        ("target.precison", "'target'"),
        ("speculation.gama", "'speculation'"),
        ("validation.promt", "'validation'"),
        ("draft.from_target.bits", "'draft.from_target'"),
    ],
)
def test_unknown_nested_key(dotted, section):
    key = dotted.rsplit(".", 1)[1]
    bad(with_(MINIMAL, dotted, 1), f"{key!r}", section, "allowed keys")


def test_unknown_draft_key():
    bad(with_(MINIMAL, "draft.bits", 4), "'bits'", "'draft'", "from_target", "proposer")


def test_draft_key_of_another_form():
    bad(with_(MINIMAL, "draft.precision", "int8"), "'precision'", "put it inside from_target", "draft.model form")


@pytest.mark.parametrize(
    "dotted, value, allowed",
    [
        ("draft.from_target.precision", "int3", "int8, int4, dynamic-int8, fp16"),
        ("draft.from_target.precision", "fp32", "int8, int4, dynamic-int8, fp16"),
        ("target.precision", "int2", "fp32, fp16, int8, int4, gguf, gptq, awq"),
        ("target.precision", "bf16", "fp32, fp16, int8, int4, gguf, gptq, awq"),
    ],
)
def test_bad_precision(dotted, value, allowed):
    bad(with_(MINIMAL, dotted, value), dotted, repr(value), allowed)


def test_from_target_block_size():
    recipe = parse_recipe(with_(MINIMAL, "draft", {"from_target": {"precision": "int4", "block_size": 128}}))
    assert recipe.draft.block_size == 128
    assert recipe.draft.to_dict() == {"from_target": {"precision": "int4", "block_size": 128}}
    assert parse_recipe(MINIMAL).draft.block_size is None  # the quantizer's default (32)
    assert "block_size" not in parse_recipe(MINIMAL).draft.to_dict()["from_target"]


@pytest.mark.parametrize("value", [100, 8, 512, "128", True, 0])
def test_bad_block_size(value):
    bad(
        with_(MINIMAL, "draft", {"from_target": {"precision": "int8", "block_size": value}}),
        "draft.from_target.block_size",
        repr(value),
        "16, 32, 64, 128, 256",
    )


@pytest.mark.parametrize("precision", ["fp16", "dynamic-int8"])
def test_block_size_needs_a_blocked_precision(precision):
    bad(
        with_(MINIMAL, "draft", {"from_target": {"precision": precision, "block_size": 64}}),
        "block_size",
        repr(precision),
        "int8 or int4",
    )


def test_bad_draft_model_precision():
    data = with_(MINIMAL, "draft", {"model": "org/d", "precision": "int2"})
    bad(data, "draft.precision", "'int2'", "fp32, fp16, int8, int4, dynamic-int8")


@pytest.mark.parametrize("gamma", [0, -1, 33])
def test_gamma_out_of_range(gamma):
    bad(with_(MINIMAL, "speculation.gamma", gamma), "speculation.gamma", str(gamma), "1..32")


def test_max_gamma_below_gamma():
    bad(with_(MINIMAL, "speculation", {"gamma": 6, "max_gamma": 4}), "speculation.max_gamma", "4", "gamma = 6")


@pytest.mark.parametrize(
    "dotted, value, needle",
    [
        ("max_context", 8, "16..131072"),
        ("max_context", "2048", "expected an integer"),
        ("max_context", 2048.0, "expected an integer"),
        ("max_context", True, "expected an integer"),
        ("speculation.gamma", 2.5, "expected an integer"),
        ("speculation.adaptive", "yes please", "true, false"),
        ("target.trust_remote_code", 1, "true, false"),
        ("validation.enabled", "no", "true, false"),
        ("target.revision", 2024, "expected a string"),
        ("target.model", "", "empty"),
        ("target.model", "builtin:", "builtin:NAME"),
        ("name", "SmolLM2 135M", "[a-z0-9][a-z0-9._-]{0,127}"),
        ("name", "..", "[a-z0-9][a-z0-9._-]{0,127}"),
        ("description", ["a"], "expected a string"),
        ("tested_here", "yes", "true, false"),
    ],
)
def test_wrong_type_or_range(dotted, value, needle):
    bad(with_(MINIMAL, dotted, value), dotted, repr(value) if value != "" else "", needle)


@pytest.mark.parametrize("value", [[], [3, 0], [3, 3], "3,2,1", [2, True]])
def test_bad_ngram_sizes(value):
    bad(with_(MINIMAL, "draft", {"proposer": "ngram", "ngram_sizes": value}), "draft.ngram_sizes")


def test_bad_proposer():
    bad(with_(MINIMAL, "draft", {"proposer": "medusa"}), "draft.proposer", "'medusa'", "ngram")


def test_two_draft_forms():
    data = with_(MINIMAL, "draft", {"from_target": {"precision": "int8"}, "proposer": "ngram"})
    bad(data, "several draft forms", "draft.from_target", "draft.proposer")
    data = with_(MINIMAL, "draft", {"model": "org/d", "from_target": {"precision": "int8"}})
    bad(data, "several draft forms", "draft.model", "draft.from_target")


def test_no_draft_form():
    bad(with_(MINIMAL, "draft", {}), "'draft'", "no draft form", "exactly one")
    bad(with_(MINIMAL, "draft", {"ngram_sizes": [3]}), "no draft form", "'ngram_sizes'")


@pytest.mark.parametrize("key", ["name", "max_context", "target", "draft"])
def test_missing_required_top_level_key(key):
    bad(without(MINIMAL, key), f"{key!r}", "required", "missing")


def test_missing_target_model():
    bad(with_(MINIMAL, "target", {"precision": "fp16"}), "'target.model'", "missing")


@pytest.mark.parametrize(
    "dotted, value",
    [
        ("target", "builtin:smollm2-135m-instruct"),
        ("draft", "int8"),
        ("speculation", [4]),
        ("draft.from_target", "int8"),
    ],
)
def test_section_not_a_mapping(dotted, value):
    bad(with_(MINIMAL, dotted, value), f"{dotted!r}", "mapping")


def test_top_level_not_a_mapping():
    bad(["name", "x"], "mapping")


def test_max_batch_range_and_forms():
    bad(with_(MINIMAL, "max_batch", 0), "max_batch = 0", "1..64")
    bad(with_(MINIMAL, "max_batch", "8"), "max_batch", "a string")
    assert parse_recipe(with_(MINIMAL, "max_batch", 4), "ok.yaml").max_batch == 4  # portable (contract 1.10)
    fused = with_(with_(MINIMAL, "graph", "fused"), "max_batch", 4)
    assert parse_recipe(fused, "ok.yaml").max_batch == 4
    eagle = with_(with_(fused, "draft", {"eagle3": {"model": "some/head"}}), "speculation", {})
    bad(eagle, "max_batch = 4 with an EAGLE-3 head")


@pytest.mark.parametrize("precision", ["int4", "gguf"])
def test_tree_verify_refuses_int8_activations(precision):
    """A quantized target whose MatMulNBits quantize activations to int8 (accuracy_level 4, the
    default) has tree rows that differ from its chain rows by about a logit: refused in one line;
    accuracy_level 0 (fp32 activations) takes trees."""
    data = with_(with_(MINIMAL, "target.precision", precision), "graph", "fused")
    data = with_(data, "tree_verify", True)
    msg = bad(data, "tree_verify", "accuracy_level = 4", "accuracy_level 0")
    assert "\n" not in msg
    assert parse_recipe(with_(data, "target.quantization.accuracy_level", 0), "ok.yaml").tree_verify
