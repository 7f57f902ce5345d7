"""The field readers recipe_reader.py reads a recipe's sections with: a mapping, its known keys
(an unknown one with a did-you-mean), required keys, strings (optionally one of a set), integers
in a range and booleans. Every error is one RecipeError line naming the source, the field path,
the value and what is allowed.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from ..errors import RecipeError

_MISSING = object()


def a_type(value: Any) -> str:
    """The type name of a YAML value with its article: "an integer", "a string"."""
    name = _type_name(value)
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "list"
    if isinstance(value, dict):
        return "mapping"
    return type(value).__name__


class FieldReader:
    """Reads the fields of one recipe dict; every error names the source, the field path and what was
    expected."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, message: str) -> RecipeError:
        return RecipeError(f"{self.source}: {message}")

    def mapping(self, value: Any, path: str) -> dict:
        if not isinstance(value, Mapping):
            where = f"{path!r}" if path else "the recipe"
            raise self.fail(f"{where} must be a mapping of keys to values, got {a_type(value)} {value!r:.80}")
        return dict(value)

    def check_keys(self, data: dict, path: str, allowed: tuple[str, ...]) -> None:
        section = f"in section {path!r}" if path else "at the top level"
        for key in data:
            if key in allowed:
                continue
            hint = ""
            if isinstance(key, str):
                close = difflib.get_close_matches(key, allowed, n=1)
                if close:
                    hint = f" (did you mean {close[0]!r}?)"
            raise self.fail(f"unknown key {key!r} {section}{hint}; allowed keys: {', '.join(allowed)}")

    def require(self, data: dict, key: str, path: str, expected: str) -> Any:
        value = data.get(key)
        if value is None:
            full = f"{path}.{key}" if path else key
            section = f"section {path!r}" if path else "the top level"
            raise self.fail(f"required key {full!r} is missing from {section} (expected {expected})")
        return value

    def string(
        self, data: dict, key: str, path: str, *, default: Any = _MISSING, choices: tuple[str, ...] | None = None
    ) -> Any:
        full = f"{path}.{key}" if path else key
        expected = f"one of {', '.join(choices)}" if choices else "a string"
        value = data.get(key)
        if value is None:
            if default is _MISSING:
                self.require(data, key, path, expected)
            return default
        if choices is not None:
            if not isinstance(value, str) or value not in choices:
                raise self.fail(f"{full} = {value!r} is not allowed; allowed values: {', '.join(choices)}")
            return value
        if not isinstance(value, str):
            quote = f' (quote it in YAML: "{value}")' if isinstance(value, (int, float)) else ""
            raise self.fail(f"{full} = {value!r} is {a_type(value)}; expected a string{quote}")
        if not value.strip():
            raise self.fail(f"{full} is an empty string; expected non-empty text")
        return value

    def integer(self, data: dict, key: str, path: str, *, lo: int, hi: int, default: Any = _MISSING) -> Any:
        full = f"{path}.{key}" if path else key
        value = data.get(key)
        if value is None:
            if default is _MISSING:
                self.require(data, key, path, f"an integer in {lo}..{hi}")
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(f"{full} = {value!r} is {a_type(value)}; expected an integer in {lo}..{hi}")
        if not lo <= value <= hi:
            raise self.fail(f"{full} = {value!r} is out of range; allowed values: integers {lo}..{hi}")
        return value

    def boolean(self, data: dict, key: str, path: str, *, default: bool) -> bool:
        full = f"{path}.{key}" if path else key
        value = data.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.fail(f"{full} = {value!r} is {a_type(value)}; allowed values: true, false")
        return value
