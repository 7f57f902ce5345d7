"""Calibration and benchmark prompt sets: one JSONL file per domain under calibration/.

Each line is one prompt:

    {"id": "code-001", "domain": "code",
     "messages": [{"role": "user", "content": "..."}], "max_new_tokens": 128}

with "text" (a raw completion prompt, no chat template) instead of "messages" allowed.
load_prompts() validates every line and raises PromptSetError naming the file, the line
and the bad field. Pure stdlib (plus the runtime's error base), so the benchmark and the
calibration code can load prompts without importing torch. See calibration/README.md.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from specexport_runtime.errors import SpecExportError

DOMAINS: tuple[str, ...] = ("code", "chat", "structured", "copy_edit", "creative")
CALIBRATION_DIR = Path(__file__).resolve().parents[1] / "calibration"
ROLES = ("system", "user", "assistant")
MAX_NEW_TOKENS_RANGE = (1, 4096)

_REQUIRED = ("id", "domain", "max_new_tokens")
_ALLOWED = frozenset(_REQUIRED + ("messages", "text"))
_MESSAGE_KEYS = frozenset(("role", "content"))


class PromptSetError(SpecExportError, ValueError):
    """A prompt set file is missing or a line of it is invalid.

    path, line (1-based, None for file-level problems) and field (None when the line as a
    whole is bad) say where; the message names all three.
    """

    def __init__(
        self, message: str, *, path: Path | str | None = None,
        line: int | None = None, field: str | None = None,
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

    def __post_init__(self) -> None:
        if (self.messages is None) == (self.text is None):
            raise PromptSetError(
                f"prompt {self.id!r}: exactly one of messages and text must be set")

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
    order) or the path of a JSONL file.
    """
    if isinstance(spec, str) and spec == "all":
        return [(CALIBRATION_DIR / f"{d}.jsonl", d) for d in DOMAINS]
    if isinstance(spec, str) and spec in DOMAINS:
        return [(CALIBRATION_DIR / f"{spec}.jsonl", spec)]
    path = Path(spec)
    if not path.is_file():
        raise PromptSetError(
            f"not a domain name ({', '.join(DOMAINS)}), 'all' or an existing JSONL file",
            path=path)
    return [(path, None)]


def load_prompts(spec: str | os.PathLike[str]) -> list[Prompt]:
    """Load and validate the prompts spec names (see resolve()); ids are unique across
    everything loaded in one call."""
    prompts: list[Prompt] = []
    seen: dict[str, tuple[Path, int]] = {}
    for path, domain in resolve(spec):
        prompts.extend(_load_file(path, domain, seen))
    return prompts


def _load_file(path: Path, expected_domain: str | None,
               seen: dict[str, tuple[Path, int]]) -> list[Prompt]:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise PromptSetError(f"cannot read prompt set: {e.strerror or e}", path=path) from e
    try:
        content = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise PromptSetError(f"not valid UTF-8 ({e.reason})", path=path, line=line) from e
    out = []
    for lineno, line in enumerate(content.splitlines(), 1):
        if not line.strip():
            continue
        prompt = _parse_line(line, path, lineno, expected_domain)
        if prompt.id in seen:
            first_path, first_line = seen[prompt.id]
            raise PromptSetError(
                f"duplicate id {prompt.id!r} (first used at {first_path}:{first_line})",
                path=path, line=lineno, field="id")
        seen[prompt.id] = (path, lineno)
        out.append(prompt)
    if not out:
        raise PromptSetError("prompt set has no prompts", path=path)
    return out


def _parse_line(line: str, path: Path, lineno: int, expected_domain: str | None) -> Prompt:
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
    for key in _REQUIRED:
        if key not in obj:
            raise fail("missing", key)
    if ("messages" in obj) == ("text" in obj):
        raise fail("exactly one of 'messages' and 'text' is required",
                   "text" if "text" in obj else "messages")

    pid = obj["id"]
    if not isinstance(pid, str) or not pid or pid != pid.strip() or any(c.isspace() for c in pid):
        raise fail(f"must be a non-empty string without whitespace, got {pid!r}", "id")

    domain = obj["domain"]
    if domain not in DOMAINS:
        raise fail(f"must be one of {', '.join(DOMAINS)}, got {domain!r}", "domain")
    if expected_domain is not None and domain != expected_domain:
        raise fail(f"is {domain!r} in the {expected_domain!r} prompt set", "domain")

    mnt = obj["max_new_tokens"]
    lo, hi = MAX_NEW_TOKENS_RANGE
    if isinstance(mnt, bool) or not isinstance(mnt, int) or not lo <= mnt <= hi:
        raise fail(f"must be an integer in {lo}..{hi}, got {mnt!r}", "max_new_tokens")

    messages = None
    text = None
    if "text" in obj:
        text = obj["text"]
        if not isinstance(text, str) or not text.strip():
            raise fail("must be a non-empty string", "text")
    else:
        messages = _parse_messages(obj["messages"], fail)
    return Prompt(id=pid, domain=domain, messages=messages, text=text, max_new_tokens=mnt)


def _parse_messages(value, fail) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise fail("must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, msg in enumerate(value):
        field = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise fail(f"must be an object, got {type(msg).__name__}", field)
        extra = sorted(set(msg) - _MESSAGE_KEYS)
        if extra:
            raise fail("unknown key (allowed: content, role)", f"{field}.{extra[0]}")
        for key in ("role", "content"):
            if key not in msg:
                raise fail("missing", f"{field}.{key}")
        role, content = msg["role"], msg["content"]
        if role not in ROLES:
            raise fail(f"must be one of {', '.join(ROLES)}, got {role!r}", f"{field}.role")
        if not isinstance(content, str) or not content.strip():
            raise fail("must be a non-empty string", f"{field}.content")
        out.append((role, content))
    if out[-1][0] != "user":
        raise fail("the last message must have role 'user'", f"messages[{len(out) - 1}].role")
    return tuple(out)
