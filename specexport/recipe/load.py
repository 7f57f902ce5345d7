"""Typed, validated build recipes (docs/recipes.md).

A recipe is a YAML file naming a target model, how its draft is obtained, and the speculation and
validation defaults baked into the artifact. This module reads recipe files and finds the bundled
ones; the typed recipe is recipe_spec.py and the checks of shape, types and ranges recipe_reader.py.
Whether a model path or hub id exists is resolved at build time.

    recipe = load_recipe("recipes/smollm2-135m.yaml")
    recipe.draft.kind            # "from_target" | "model" | "ngram" | "eagle3"
    recipe.to_dict()             # plain dict, recorded in the artifact manifest; parse_recipe() reads it back
"""

from __future__ import annotations

from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml

from ..errors import RecipeError
from .reader import parse_recipe
from .spec import (
    DRAFT_KINDS,
    DRAFT_MODEL_PRECISIONS,
    GRAPH_KINDS,
    SELF_DRAFT_PRECISIONS,
    TARGET_PRECISIONS,
    DraftSpec,
    ModelSpec,
    QuantizationSpec,
    Recipe,
    SpeculationSpec,
    ValidationSpec,
)

__all__ = [
    "DEFAULT_RECIPE",
    "DRAFT_KINDS",
    "DRAFT_MODEL_PRECISIONS",
    "GRAPH_KINDS",
    "RECIPES_DIR",
    "SELF_DRAFT_PRECISIONS",
    "TARGET_PRECISIONS",
    "DraftSpec",
    "ModelSpec",
    "QuantizationSpec",
    "Recipe",
    "SpeculationSpec",
    "ValidationSpec",
    "bundled_recipes",
    "dump_recipe",
    "load_recipe",
    "parse_recipe",
    "resolve_recipe",
]

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"
DEFAULT_RECIPE = "smollm2-135m"


# --------------------------------------------------------------------------- YAML


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys (PyYAML silently keeps the last one)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    loader.flatten_mapping(node)
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if isinstance(key, Hashable):
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping",
                    node.start_mark,
                    f"duplicate key {key!r} (first given on line {seen[key] + 1})",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _yaml_error(source: str, exc: yaml.YAMLError) -> RecipeError:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    context = getattr(exc, "context", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    detail = f"{problem} ({context})" if context else problem
    return RecipeError(f"{source}: YAML syntax error{where}: {detail}")


# --------------------------------------------------------------------------- public functions


def load_recipe(path: str | Path) -> Recipe:
    """Read and validate a recipe YAML file; every problem raises RecipeError naming the file."""
    path = Path(path)
    source = str(path)
    if not path.exists():
        raise RecipeError(f"recipe file {source!r} does not exist")
    if not path.is_file():
        raise RecipeError(f"recipe path {source!r} is not a file (expected a .yaml recipe)")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise RecipeError(f"{source}: not valid UTF-8 text ({exc})") from exc
    except OSError as exc:
        raise RecipeError(f"recipe file {source!r} cannot be read: {exc}") from exc
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as exc:
        raise _yaml_error(source, exc) from exc
    if data is None:
        raise RecipeError(f"{source}: the file is empty (expected a recipe mapping, see docs/recipes.md)")
    return parse_recipe(data, source)


def dump_recipe(recipe: Recipe) -> str:
    """The recipe as YAML text (fully explicit); load_recipe reads it back to an equal Recipe."""
    data = recipe.to_dict()
    text = yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
    if yaml.safe_load(text) != data:  # PyYAML mangles a few line-break characters (U+0085) when unescaped
        text = yaml.safe_dump(data, sort_keys=False, allow_unicode=False)
    return text


def bundled_recipes() -> list[Path]:
    """The recipe files shipped in the repository's recipes/ folder, sorted by name."""
    return sorted(RECIPES_DIR.glob("*.yaml"))


def resolve_recipe(name_or_path: str | Path) -> Path:
    """A recipe file path: an existing file as given, else a bundled recipe by name (with or without .yaml)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    text = str(name_or_path)
    if "/" not in text and "\\" not in text:
        stem = text[:-5] if text.endswith(".yaml") else text
        candidate = RECIPES_DIR / f"{stem}.yaml"
        if candidate.is_file():
            return candidate
    names = ", ".join(p.stem for p in bundled_recipes()) or "none"
    raise RecipeError(f"recipe {text!r} is neither a file nor a bundled recipe; bundled recipes: {names}")
