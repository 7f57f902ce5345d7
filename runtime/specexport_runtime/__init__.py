"""specexport runtime: loads an artifact and runs exact speculative decoding.

    import specexport_runtime
    gen = specexport_runtime.load("artifact", provider="cpu", threads=2)
    result = gen.generate("def add(a, b):", max_new_tokens=64)

`load`, GeneratorConfig and the result types come from `specexport_runtime.api`, imported on
first use so that the build side can read `specexport_runtime.contract`, `.manifest`, `.registry`
and `.constants` without starting ONNX Runtime.
"""

from __future__ import annotations

_API = ("load", "SpecGenerator", "GeneratorConfig", "GenerationResult")
_STRUCTURED = ("Grammar",)  # structured.py: constrained decoding (the `structured` extra for llguidance)

__all__ = list(_API + _STRUCTURED)


def __getattr__(name: str):
    if name in _API:
        from . import api

        return getattr(api, name)
    if name in _STRUCTURED:
        from . import structured

        return getattr(structured, name)
    raise AttributeError(f"module 'specexport_runtime' has no attribute {name!r}")
