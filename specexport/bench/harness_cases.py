"""The harness's prompt cases: prompt sets loaded and limited, prompts turned into token ids (chat
prompts through the artifact's chat template, with their tools), and the warm-up case outside
every measured set.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import HarnessError
from .prompts import Prompt, load_prompts

# the warm-up request's chat: in no shipped prompt set, so no engine has seen a measured answer
WARMUP_MESSAGES: tuple[dict[str, str], ...] = ({"role": "user", "content": "Name three colours."},)
WARMUP_ID = "warm-up"


@dataclass(frozen=True)
class Case:
    """One measured prompt: `ids` are its token ids (chat prompts through the artifact's
    template); max_new_tokens None means each method's own limit. run_interleaved hands a method
    the case with `repeat` set to the measurement's index (0 for the warm-up), e.g. for a
    per-repeat sampling seed."""

    id: str
    ids: tuple[int, ...]
    domain: str = ""
    max_new_tokens: int | None = None
    prompt: Prompt | None = field(default=None, compare=False, repr=False)
    repeat: int = field(default=0, compare=False)


def load_prompt_set(spec: str | os.PathLike | Sequence[str | os.PathLike], limit: int | None = None) -> list[Prompt]:
    """Prompts of a spec: calibration domains, 'all', JSONL or text files, given as one
    comma-separated string, one path or a sequence of them. A prompt id met again in a later
    spec is kept once (the first); `limit` keeps the first `limit` prompts of each domain.
    HarnessError when nothing is left."""
    if isinstance(spec, os.PathLike):
        specs: list = [spec]
    elif isinstance(spec, str):
        specs = [s.strip() for s in spec.split(",") if s.strip()]
    else:
        specs = list(spec)
    if limit is not None and limit < 1:
        raise HarnessError(f"limit must be >= 1, got {limit}")
    prompts: list[Prompt] = []
    seen: set[str] = set()
    for one in specs:
        for p in load_prompts(one):
            if p.id not in seen:
                seen.add(p.id)
                prompts.append(p)
    if limit is not None:
        counts: dict[str, int] = {}
        kept = []
        for p in prompts:
            counts[p.domain] = counts.get(p.domain, 0) + 1
            if counts[p.domain] <= limit:
                kept.append(p)
        prompts = kept
    if not prompts:
        raise HarnessError(f"prompt set {spec!r} holds no prompts")
    return prompts


def encode_prompt(codec, prompt: Prompt) -> list[int]:
    """Token ids of a prompt: a chat prompt through the codec's chat template (with its tools, as
    SpecGenerator.chat renders them), a text as it is."""
    if not prompt.is_chat:
        return codec.encode(prompt.text)
    if prompt.tools is None:
        return codec.encode_chat(prompt.chat())
    plan = tool_plan(codec, prompt)
    return codec.encode_chat(plan.messages(prompt.chat()), tools=plan.template_tools)


def tool_plan(codec, prompt: Prompt):
    """A tools prompt's tools.ToolPlan (how the answer's tool calls are read)."""
    from specexport_runtime.tools import ToolPlan

    return ToolPlan.create(list(prompt.tools), prompt.tool_choice, codec.reads_tools, prompt.parallel_tool_calls)


def make_cases(codec, prompts: Sequence[Prompt], per_prompt_limit: bool = False) -> list[Case]:
    """One Case per prompt; per_prompt_limit: each keeps its prompt file's max_new_tokens."""
    return [
        Case(p.id, tuple(encode_prompt(codec, p)), p.domain, p.max_new_tokens if per_prompt_limit else None, p)
        for p in prompts
    ]


def warmup_case(codec, max_new_tokens: int | None = None) -> Case:
    """The warm-up prompt (WARMUP_MESSAGES through the codec's chat template)."""
    return Case(WARMUP_ID, tuple(codec.encode_chat(list(WARMUP_MESSAGES))), WARMUP_ID, max_new_tokens)
