"""How large a regex grows when its counted repetitions are expanded, checked before any token is
generated: llguidance expands `x{m,n}` into up to n copies of x, so nested counts multiply
(`^a{1000}{1000}$` is a million positions) and its lexer gives up after the prefill, or takes
seconds a token. A pattern whose expansion exceeds MAX_EXPANSION is refused up front.

The estimate: an atom (a character, an escape, a class) counts 1; a sequence the sum of its items;
alternatives the sum of their branches; a group its content; a quantifier multiplies what it
applies to by its largest count (`{m}`, `{m,n}`: n; `{m,}`: m; `*`, `+`, `?`: 1, loops do not
expand), and quantifiers applied in a row multiply again.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

MAX_EXPANSION = 20_000
_COUNT = re.compile(r"\{(\d+)(,(\d*))?\}")


def expansion(pattern: str) -> int:
    """The expanded size of `pattern` (module docstring); tolerant of syntax it does not know."""
    size, _ = _alternation(pattern, 0)
    return size


def _alternation(p: str, i: int) -> tuple[int, int]:
    total = 0
    while True:
        size, i = _sequence(p, i)
        total += size
        if i < len(p) and p[i] == "|":
            i += 1
            continue
        return total, i


def _sequence(p: str, i: int) -> tuple[int, int]:
    total = 0
    while i < len(p) and p[i] not in "|)":
        size, i = _atom(p, i)
        while i < len(p):  # quantifiers, possibly several in a row
            m = _COUNT.match(p, i)
            if m:
                low, comma, high = int(m.group(1)), m.group(2), m.group(3)
                size *= max(1, int(high) if high else low) if comma else max(1, low)
                i = m.end()
            elif p[i] in "*+?":
                i += 1
            else:
                break
            if i < len(p) and p[i] in "?+":  # lazy / possessive suffix
                i += 1
        total += size
    return total, i


def _atom(p: str, i: int) -> tuple[int, int]:
    c = p[i]
    if c == "\\":
        return 1, min(len(p), i + 2)
    if c == "[":
        j = i + 1
        if j < len(p) and p[j] == "^":
            j += 1
        if j < len(p) and p[j] == "]":
            j += 1
        while j < len(p) and p[j] != "]":
            j += 2 if p[j] == "\\" else 1
        return 1, min(len(p), j + 1)
    if c == "(":
        j = i + 1
        if p.startswith("?", j):  # (?:...), (?P<name>...), (?=...), flags
            m = re.compile(r"\?(P?<[^>]*>|[:=!]|<[=!]|[a-zA-Z-]*:?)").match(p, j)
            j = m.end() if m else j + 1
        size, j = _alternation(p, j)
        return size, min(len(p), j + 1)  # past ')'
    if c in "^$":
        return 0, i + 1
    return 1, i + 1


def schema_patterns(schema: Any) -> list[str]:
    """Every regex a JSON Schema holds: `pattern` values and `patternProperties` keys, nested."""
    out: list[str] = []
    if isinstance(schema, Mapping):
        for key, value in schema.items():
            if key == "pattern" and isinstance(value, str):
                out.append(value)
            elif key == "patternProperties" and isinstance(value, Mapping):
                out += [k for k in value if isinstance(k, str)]
                out += [p for v in value.values() for p in schema_patterns(v)]
            else:
                out += schema_patterns(value)
    elif isinstance(schema, list):
        out += [p for v in schema for p in schema_patterns(v)]
    return out


def too_large(pattern: str) -> str | None:
    """None, or the one-line reason `pattern` is refused."""
    size = expansion(pattern)
    if size <= MAX_EXPANSION:
        return None
    shown = pattern if len(pattern) <= 60 else pattern[:57] + "..."
    return (
        f"regex {shown!r} expands to about {size:,} positions (its counted repetitions multiply);"
        f" the limit is {MAX_EXPANSION:,}: use smaller counts or * / +"
    )
