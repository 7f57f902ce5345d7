"""The manifest's schema, checked before anything is built from it or opened.

Each section is a table key -> Field(kind, required, bounds); unknown keys are refused (a
manifest is written by `specexport build`, which writes only these), types are exact (a bool is
not an int), numbers lie in stated ranges and lists and dicts have bounded sizes, so a damaged or
hostile manifest gives one ArtifactError naming the key, never a traceback or a huge allocation.
Free-form dicts (validation reports, tools, retrieval.info) are
checked for being JSON of bounded depth and size only: the runtime reads nothing from them that
it does not check again where it uses it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .constants import EXACTNESS, HYBRID_RETRIEVALS, MAX_GAMMA, MAX_NGRAM, MIN_GAMMA
from .errors import ArtifactError

MAX_FILES = 10_000  # files an artifact may list
MAX_NAME = 256  # characters of names, sources, paths
MAX_DEPTH = 8  # nesting of free-form dicts
MAX_ITEMS = 100_000  # items in a free-form dict or list, all levels together
SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class Field:
    # int | str | bool | ints | shapes | json | entry | tokenizer | speculation | generation | files | retrieval
    kind: str
    required: bool = False
    lo: int = 0
    hi: int = 1 << 31
    nullable: bool = False
    choices: tuple[str, ...] = ()


ENTRY = {
    "graph": Field("str", True),
    "source": Field("str", True, hi=4096),
    "architecture": Field("str", True),
    "num_layers": Field("int", True, 1, 1024),
    "num_kv_heads": Field("int", True, 1, 1024),
    "head_dim": Field("int", True, 1, 4096),
    "vocab_size": Field("int", True, 1, 1 << 24),
    "embedding_rows": Field("int", True, 1, 1 << 24),
    "precision": Field("str", True),
    "kv_dtype": Field("str", choices=("float32", "float16")),
    "validation": Field("json"),
    "kv_layout": Field("str"),
    "min_rows": Field("int", lo=1, hi=16),
    "cache_pad": Field("int", lo=0, hi=16),
    "feature_layers": Field("ints", lo=0, hi=1024),
    "feature_width": Field("int", lo=0, hi=1 << 20),
    "attention_windows": Field("ints", lo=1, hi=1 << 24),
    "kind": Field("str"),
    "hidden_width": Field("int", lo=0, hi=1 << 20),
    "vocab_map": Field("str", nullable=True),
    "exactness": Field("str", nullable=True, choices=EXACTNESS),
    "batch_graph": Field("str", nullable=True),
    "max_batch": Field("int", lo=1, hi=256),
    "tree_graph": Field("str", nullable=True),
    "states": Field("shapes", lo=1, hi=1 << 20),  # recurrent state shapes: at most 1024 of 1..4 dims
    "block_size": Field("int", lo=2, hi=256),  # a DFlash drafter's block rows
    "mask_token_id": Field("int", lo=0, hi=1 << 24),
    "shared_kv": Field("ints", lo=0, hi=1 << 16),  # an assistant's target caches
}
TOKENIZER = {
    "file": Field("str", True),
    "chat_template": Field("str", nullable=True),
    "eos_token_ids": Field("ints", lo=0, hi=1 << 24),
    "bos_token_id": Field("int", hi=1 << 24, nullable=True),
    "add_bos": Field("bool"),
    "sha256": Field("str"),
}
SPECULATION = {
    "proposer": Field("str"),
    "gamma": Field("int", lo=MIN_GAMMA, hi=MAX_GAMMA),
    "ngram_sizes": Field("ints", lo=1, hi=MAX_NGRAM),
    "hybrid_retrieval": Field("str", choices=HYBRID_RETRIEVALS),
}
GENERATION = {
    "max_gamma": Field("int", lo=MIN_GAMMA, hi=MAX_GAMMA, nullable=True),
    "adaptive": Field("bool"),
    # written by older builds, read by no runtime: accepted so that those artifacts still load
    "pad_draft_rows": Field("json"),
    "model_defaults": Field("json"),
}
RETRIEVAL = {
    "tokens": Field("str", True),
    "suffix_array": Field("str", True),
    "token_count": Field("int", True, 1),
    "info": Field("json"),
}
SYSTEM_PROMPT = {  # system_prompt.py; rows / shapes / built_with checked by SystemPromptEntry
    "text": Field("str", True),
    "ids": Field("str", True),
    "tokens": Field("int", True, 1, 1 << 22),
    "key": Field("str", True),
    "rows": Field("json", True),
    "shapes": Field("json", True),
    "built_with": Field("json"),
}
TOP = {
    "schema_version": Field("int", True),
    "contract_version": Field("str", True),
    "name": Field("str", True),
    "max_context": Field("int", True, 1, 1 << 22),
    "target": Field("entry", True),
    "draft": Field("entry", nullable=True),
    "tokenizer": Field("tokenizer", True),
    "speculation": Field("speculation"),
    "generation": Field("generation"),
    "files": Field("files"),
    "tools": Field("json"),
    "retrieval": Field("retrieval", nullable=True),
    "graph_features": Field("json"),  # features.py names; checked by Manifest.from_dict
    "system_prompt": Field("system_prompt", nullable=True),
}
SECTIONS = {
    "entry": ENTRY,
    "tokenizer": TOKENIZER,
    "speculation": SPECULATION,
    "generation": GENERATION,
    "retrieval": RETRIEVAL,
    "system_prompt": SYSTEM_PROMPT,
}


def _fail(where: str, message: str) -> ArtifactError:
    return ArtifactError(f"manifest {where}: {message}")


def _json_size(value: Any, where: str, depth: int = 0) -> int:
    """Items in a JSON value (and a check that it is JSON of bounded depth)."""
    if depth > MAX_DEPTH:
        raise _fail(where, f"nested deeper than {MAX_DEPTH}")
    if isinstance(value, dict):
        if any(not isinstance(k, str) for k in value):
            raise _fail(where, "has a non-string key")
        return len(value) + sum(_json_size(v, where, depth + 1) for v in value.values())
    if isinstance(value, list):
        return len(value) + sum(_json_size(v, where, depth + 1) for v in value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return 1
    raise _fail(where, f"holds a {type(value).__name__}, not JSON")


def _check(value: Any, f: Field, where: str) -> None:
    if value is None:
        if f.nullable:
            return
        raise _fail(where, "is null")
    kind = f.kind
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int) or not f.lo <= value <= f.hi:
            raise _fail(where, f"{value!r:.80} is not an integer in {f.lo}..{f.hi}")
    elif kind == "bool":
        if not isinstance(value, bool):
            raise _fail(where, f"{value!r:.80} is not true or false")
    elif kind == "str":
        if not isinstance(value, str) or len(value) > max(MAX_NAME, f.hi if f.hi < 1 << 31 else 0):
            raise _fail(where, f"{value!r:.80} is not a string of at most {MAX_NAME} characters")
        if f.choices and value not in f.choices:
            raise _fail(where, f"{value!r} is not one of {', '.join(f.choices)}")
    elif kind == "ints":
        if not isinstance(value, list) or len(value) > 64:
            raise _fail(where, f"{value!r:.80} is not a list of at most 64 integers")
        for i, v in enumerate(value):
            _check(v, Field("int", lo=f.lo, hi=f.hi), f"{where}[{i}]")
    elif kind == "shapes":
        if not isinstance(value, list) or len(value) > 1024:
            raise _fail(where, f"{value!r:.80} is not a list of at most 1024 shapes")
        for i, shape in enumerate(value):
            if not isinstance(shape, list) or not 1 <= len(shape) <= 4:
                raise _fail(f"{where}[{i}]", f"{shape!r:.80} is not a shape of 1 to 4 dimensions")
            for k, d in enumerate(shape):
                _check(d, Field("int", lo=f.lo, hi=f.hi), f"{where}[{i}][{k}]")
    elif kind == "json":
        if _json_size(value, where) > MAX_ITEMS:
            raise _fail(where, f"holds more than {MAX_ITEMS} items")
    elif kind == "files":
        if not isinstance(value, dict) or len(value) > MAX_FILES:
            raise _fail(where, f"is not a mapping of at most {MAX_FILES} files")
        for rel, digest in value.items():
            if (
                not isinstance(rel, str)
                or len(rel) > MAX_NAME
                or not isinstance(digest, str)
                or not SHA256.match(digest)
            ):
                raise _fail(f"{where}[{rel!r:.80}]", "is not a relative path with a lower-case hex sha256")
    else:
        check_section(value, SECTIONS[kind], where)


def check_section(data: Any, table: dict[str, Field], where: str) -> None:
    if not isinstance(data, dict):
        raise _fail(where, f"is a {type(data).__name__}, not a mapping")
    unknown = [k for k in data if k not in table]
    if unknown:
        raise _fail(where, f"has unknown key {unknown[0]!r:.80}; allowed: {', '.join(table)}")
    for key, f in table.items():
        if key not in data:
            if f.required:
                raise _fail(where, f"lacks the required key {key!r}")
            continue
        _check(data[key], f, f"{where}.{key}" if where != "top level" else key)


def check_manifest(data: Any) -> None:
    """Raise ArtifactError naming the first key that breaks the schema."""
    check_section(data, TOP, "top level")


__all__ = ["MAX_FILES", "Field", "check_manifest", "check_section"]
