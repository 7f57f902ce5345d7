"""The config refusal every model module raises (one line naming the key, its value and what is
implemented), and how a value is shown in it."""

from __future__ import annotations

from typing import Any

from specexport_runtime.errors import SpecExportError


class UnsupportedConfig(SpecExportError):
    """The model uses a feature the exporter does not reproduce exactly."""


def show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
