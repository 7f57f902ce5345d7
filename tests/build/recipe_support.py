"""Helpers of the recipe tests (no tests here): a minimal valid recipe, a copy of it with one value
set, and `bad`, the check that parsing raises a RecipeError naming the file and what is wrong.
Used by test_recipe.py and test_recipe_errors.py."""

from __future__ import annotations

import copy

import pytest

from specexport.errors import RecipeError
from specexport.recipe.load import parse_recipe

MINIMAL = {
    "name": "tiny",
    "max_context": 256,
    "target": {"model": "builtin:smollm2-135m-instruct"},
    "draft": {"from_target": {"precision": "int8"}},
}


def with_(base: dict, dotted: str, value) -> dict:
    data = copy.deepcopy(base)
    node = data
    *parents, last = dotted.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return data


def bad(data, *needles: str) -> str:
    with pytest.raises(RecipeError) as info:
        parse_recipe(data, "bad.yaml")
    message = str(info.value)
    assert "bad.yaml" in message
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    return message
