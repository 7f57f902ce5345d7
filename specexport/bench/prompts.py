"""Calibration and benchmark prompt sets: the shipped sets (one JSONL file per domain under
calibration/) and the prompt files users already have.

A JSONL file (.jsonl, .json or .ndjson) holds one JSON object per line:

    {"id": "code-001", "domain": "code",
     "messages": [{"role": "user", "content": "..."}], "max_new_tokens": 128}

The prompt is exactly one of "messages" (the OpenAI chat shape: a list of {role, content}),
"prompt" or "text" (a raw completion prompt, no chat template). Everything else is
optional: "id" defaults to "<stem>-<line>", "domain" to the set's domain (calibration sets)
or the file's stem, "max_new_tokens" to the caller's default (DEFAULT_MAX_NEW_TOKENS when it
gives none). Any other file is plain text: one raw prompt per non-empty line, stripped.
load_prompts() validates every line and raises PromptSetError naming the file, the line
and the bad field. Pure stdlib (plus the runtime's error base), so the benchmark and the
calibration code can load prompts without importing torch. See calibration/README.md and
docs/benchmarking.md.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specexport_runtime.errors import SpecExportError

DOMAINS: tuple[str, ...] = ("code", "chat", "structured", "copy_edit", "creative", "agentic", "rag", "structured_json")
CALIBRATION_DIR = Path(__file__).resolve().parents[2] / "calibration"
ROLES = ("system", "user", "assistant")
MAX_NEW_TOKENS_RANGE = (1, 4096)
# max_new_tokens of a prompt whose line gives none when the caller passes no default.
# (bench --max-new-tokens, when given, overrides every prompt's value anyway.)
DEFAULT_MAX_NEW_TOKENS = 128
# suffixes (lower-cased) of files read as JSONL; any other file is plain text
JSONL_SUFFIXES = frozenset((".jsonl", ".json", ".ndjson"))

_PROMPT_KEYS = ("messages", "prompt", "text")  # exactly one per line
# a chat prompt's constraint (bench --constrained): a JSON Schema, or OpenAI tools (+ tool_choice)
_CONSTRAINT_KEYS = ("schema", "tools", "tool_choice", "parallel_tool_calls")
_ALLOWED = frozenset(("id", "domain", "max_new_tokens") + _PROMPT_KEYS + _CONSTRAINT_KEYS)
_MESSAGE_KEYS = frozenset(("role", "content"))
_LINE_BREAK = re.compile(r"\r\n|\r|\n")  # what editors count as lines (not str.splitlines)


class PromptSetError(SpecExportError, ValueError):
    """A prompt set file is missing or a line of it is invalid.

    path, line (1-based, None for file-level problems) and field (None when the line as a
    whole is bad) say where; the message names all three.
    """

    def __init__(
        self, message: str, *, path: Path | str | None = None, line: int | None = None, field: str | None = None
    ) -> None:
        self.path = None if path is None else Path(path)
        self.line = line
        self.field = field
        where = "" if path is None else str(path) + ("" if line is None else f":{line}")
        what = "" if field is None else f"field {field!r}: "
        super().__init__(f"{where}: {what}{message}" if where else f"{what}{message}")


@dataclass(frozen=True)
class Prompt:
    """One prompt: chat messages (role, content) pairs, or a raw completion text."""

    id: str
    domain: str
    messages: tuple[tuple[str, str], ...] | None
    text: str | None
    max_new_tokens: int
    schema: dict | None = field(default=None, compare=False)  # the answer's JSON Schema
    tools: tuple | None = field(default=None, compare=False)  # OpenAI tool definitions the answer may call
    tool_choice: Any = field(default=None, compare=False)
    parallel_tool_calls: bool = field(default=True, compare=False)  # False: one tool call per answer

    @property
    def constrained(self) -> bool:
        return self.schema is not None or self.tools is not None

    def __post_init__(self) -> None:
        if (self.messages is None) == (self.text is None):
            raise PromptSetError(f"prompt {self.id!r}: exactly one of messages and text must be set")

    @property
    def is_chat(self) -> bool:
        return self.messages is not None

    def chat(self) -> list[dict[str, str]]:
        """The messages as dicts, the form tokenizer.apply_chat_template takes."""
        if self.messages is None:
            raise PromptSetError(f"prompt {self.id!r} is a raw text prompt, not chat")
        return [{"role": role, "content": content} for role, content in self.messages]


def resolve(spec: str | os.PathLike[str]) -> list[tuple[Path, str | None]]:
    """The files a spec names, each with the domain its lines must have (None: any).

    spec: a domain name (calibration/<domain>.jsonl), "all" (every domain, in DOMAINS
    order) or the path of a prompt file (JSONL, or plain text with one prompt per line).
    """
    if isinstance(spec, str) and spec == "all":
        return [(CALIBRATION_DIR / f"{d}.jsonl", d) for d in DOMAINS]
    if isinstance(spec, str) and spec in DOMAINS:
        return [(CALIBRATION_DIR / f"{spec}.jsonl", spec)]
    path = Path(spec)
    if not path.is_file():
        raise PromptSetError(
            f"not a domain name ({', '.join(DOMAINS)}), 'all' or an existing prompt file (JSONL or text)", path=path
        )
    return [(path, None)]


def load_prompts(spec: str | os.PathLike[str], *, max_new_tokens: int | None = None) -> list[Prompt]:
    """Load and validate the prompts spec names (see resolve()); ids are unique across
    everything loaded in one call. max_new_tokens: the value of prompts whose line gives
    none (None: DEFAULT_MAX_NEW_TOKENS); lines that give one keep theirs."""
    default_mnt = DEFAULT_MAX_NEW_TOKENS if max_new_tokens is None else max_new_tokens
    lo, hi = MAX_NEW_TOKENS_RANGE
    if isinstance(default_mnt, bool) or not isinstance(default_mnt, int) or not lo <= default_mnt <= hi:
        raise PromptSetError(
            f"default must be an integer in {lo}..{hi}, got {_show(default_mnt)}", field="max_new_tokens"
        )
    prompts: list[Prompt] = []
    seen: dict[str, tuple[Path, int]] = {}
    for path, domain in resolve(spec):
        prompts.extend(_load_file(path, domain, seen, default_mnt))
    return prompts


def file_label(path: Path | str) -> str:
    """The file's stem as a label for default ids and domains: lower case, every run of
    characters other than a-z, 0-9 and _ replaced by one _ ("My prompts.v2" -> "my_prompts_v2";
    "prompts" when nothing is left)."""
    return re.sub(r"[^a-z0-9_]+", "_", Path(path).stem.lower()).strip("_") or "prompts"


def _is_jsonl(path: Path) -> bool:
    return path.suffix.lower() in JSONL_SUFFIXES


def _show(value, limit: int = 60) -> str:
    """repr() cut to one short line for error messages."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _load_file(
    path: Path,
    expected_domain: str | None,
    seen: dict[str, tuple[Path, int]],
    default_max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
) -> list[Prompt]:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise PromptSetError(f"cannot read prompt set: {e.strerror or e}", path=path) from e
    try:
        content = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise PromptSetError(f"not valid UTF-8 ({e.reason})", path=path, line=line) from e
    content = content.removeprefix("\ufeff")  # a byte order mark some editors write
    label = file_label(path)
    defaults = _Defaults(label, expected_domain or label, default_max_new_tokens)
    jsonl = _is_jsonl(path)
    out = []
    for lineno, line in enumerate(_LINE_BREAK.split(content), 1):
        if not line.strip():
            continue
        if jsonl:
            prompt = _parse_line(line, path, lineno, expected_domain, defaults)
        else:
            prompt = Prompt(
                id=f"{label}-{lineno}",
                domain=defaults.domain,
                messages=None,
                text=line.strip(),
                max_new_tokens=default_max_new_tokens,
            )
        if prompt.id in seen:
            first_path, first_line = seen[prompt.id]
            raise PromptSetError(
                f"duplicate id {prompt.id!r} (first used at {first_path}:{first_line})",
                path=path,
                line=lineno,
                field="id",
            )
        seen[prompt.id] = (path, lineno)
        out.append(prompt)
    if not out:
        raise PromptSetError("prompt set has no prompts", path=path)
    return out


@dataclass(frozen=True)
class _Defaults:
    """What a JSONL line that omits a field gets: id "<id_prefix>-<line>", domain, max_new_tokens."""

    id_prefix: str
    domain: str
    max_new_tokens: int


def _parse_line(
    line: str, path: Path, lineno: int, expected_domain: str | None, defaults: _Defaults | None = None
) -> Prompt:
    if defaults is None:
        label = file_label(path)
        defaults = _Defaults(label, expected_domain or label, DEFAULT_MAX_NEW_TOKENS)

    def fail(message: str, field: str | None = None) -> PromptSetError:
        return PromptSetError(message, path=path, line=lineno, field=field)

    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise fail(f"invalid JSON: {e.msg} at column {e.colno}") from e
    if not isinstance(obj, dict):
        raise fail(f"expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - _ALLOWED)
    if unknown:
        raise fail(f"unknown key (allowed: {', '.join(sorted(_ALLOWED))})", unknown[0])
    given = [k for k in _PROMPT_KEYS if k in obj]
    if len(given) != 1:
        found = ", ".join(obj) or "none"
        raise fail(
            f"exactly one of 'messages', 'prompt' and 'text' is required (keys found: {found})",
            given[-1] if given else "messages",
        )

    if "id" in obj:
        pid = obj["id"]
        if not isinstance(pid, str) or not pid or any(c.isspace() for c in pid):
            raise fail(f"must be a non-empty string without whitespace, got {_show(pid)}", "id")
    else:
        pid = f"{defaults.id_prefix}-{lineno}"

    if "domain" in obj:
        domain = obj["domain"]
        if domain not in DOMAINS:
            raise fail(f"must be one of {', '.join(DOMAINS)}, got {_show(domain)}", "domain")
        if expected_domain is not None and domain != expected_domain:
            raise fail(f"is {domain!r} in the {expected_domain!r} prompt set", "domain")
    else:
        domain = defaults.domain

    lo, hi = MAX_NEW_TOKENS_RANGE
    if "max_new_tokens" in obj:
        mnt = obj["max_new_tokens"]
        if isinstance(mnt, bool) or not isinstance(mnt, int) or not lo <= mnt <= hi:
            raise fail(f"must be an integer in {lo}..{hi}, got {_show(mnt)}", "max_new_tokens")
    else:
        mnt = defaults.max_new_tokens

    messages = None
    text = None
    key = given[0]
    if key == "messages":
        messages = _parse_messages(obj["messages"], fail)
    else:
        text = obj[key]
        if not isinstance(text, str) or not text.strip():
            raise fail(f"must be a non-empty string, got {_show(text)}", key)
    schema, tools = obj.get("schema"), obj.get("tools")
    if schema is not None and not isinstance(schema, dict):
        raise fail(f"must be a JSON Schema object, got {_show(schema)}", "schema")
    if tools is not None and (not isinstance(tools, list) or not tools or not all(isinstance(t, dict) for t in tools)):
        raise fail(f"must be a non-empty list of tool objects, got {_show(tools)}", "tools")
    if schema is not None and tools is not None:
        raise fail("give schema or tools, not both", "tools")
    for key in ("tool_choice", "parallel_tool_calls"):
        if key in obj and tools is None:
            raise fail("needs tools", key)
    parallel = obj.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise fail(f"must be true or false, got {_show(parallel)}", "parallel_tool_calls")
    if (schema is not None or tools is not None) and messages is None:
        raise fail("a constrained prompt must be chat messages", "schema" if schema is not None else "tools")
    return Prompt(
        id=pid,
        domain=domain,
        messages=messages,
        text=text,
        max_new_tokens=mnt,
        schema=schema,
        tools=None if tools is None else tuple(tools),
        tool_choice=obj.get("tool_choice"),
        parallel_tool_calls=parallel,
    )


def _parse_messages(value, fail) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise fail(f"must be a non-empty list of {{role, content}} objects, got {_show(value)}", "messages")
    out = []
    for i, msg in enumerate(value):
        field = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise fail(f"must be a {{role, content}} object, got {type(msg).__name__}", field)
        extra = sorted(set(msg) - _MESSAGE_KEYS)
        if extra:
            raise fail("unknown key (allowed: content, role)", f"{field}.{extra[0]}")
        for key in ("role", "content"):
            if key not in msg:
                raise fail("missing", f"{field}.{key}")
        role, content = msg["role"], msg["content"]
        if role not in ROLES:
            raise fail(f"must be one of {', '.join(ROLES)}, got {_show(role)}", f"{field}.role")
        if not isinstance(content, str) or not content.strip():
            raise fail(f"must be a non-empty string, got {_show(content)}", f"{field}.content")
        out.append((role, content))
    if out[-1][0] != "user":
        raise fail("the last message must have role 'user'", f"messages[{len(out) - 1}].role")
    return tuple(out)
