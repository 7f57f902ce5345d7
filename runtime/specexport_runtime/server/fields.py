"""Scalar fields of a request body: booleans, integers and finite numbers read with JSON's types
(True is not 1), text checked for lone surrogates, and a value described in a 400's message.
Every rejection is an ApiError 400 naming the field.
"""

from __future__ import annotations

import math
from typing import Any

from .errors import bad_request


def kind_of(value: Any) -> str:
    names = {
        type(None): "null",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "an object",
    }
    text = repr(value)
    return f"{names.get(type(value), type(value).__name__)} {text if len(text) <= 40 else text[:37] + '...'}"


def read_bool(body: dict, name: str, default: bool, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{param or name} must be a boolean, got {kind_of(value)}", param or name, "invalid_type")
    return value


def read_int(body: dict, name: str, default: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # JSON 4.0: an integer written as a number
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{name} must be an integer, got {kind_of(value)}", name, "invalid_type")
    return value


def read_number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(f"{name} must be a finite number, got {kind_of(value)}", name, "invalid_type")
    return float(value)


def check_utf8(text: str, param: str) -> str:
    """`text` unchanged, or a 400 when it holds a lone surrogate (JSON "\\ud800" decodes to one)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request(f"{param} is not valid Unicode: {exc.reason} at position {exc.start}", param) from None
    return text
