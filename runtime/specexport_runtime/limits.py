"""The context bound of a request, shared by the CLI and the server: the prompt plus the new tokens
asked for must fit the artifact's max_context (the server answers 400, the CLI exits 2)."""

from __future__ import annotations

from .errors import PromptError


def context_overflow(asked_by: str, max_new: int, prompt_tokens: int, context: int) -> str | None:
    """None when `max_new` new tokens fit after `prompt_tokens` in `context`, else the one-line
    reason naming the option or field `asked_by`."""
    room = context - prompt_tokens
    if max_new <= room:
        return None
    return (
        f"{asked_by} {max_new} + the prompt's {prompt_tokens} tokens exceed this model's context of {context}"
        f" tokens (at most {max(0, room)} new tokens fit)"
    )


def check_room(asked_by: str, max_new: int, prompt_tokens: int, context: int) -> None:
    """PromptError with context_overflow's reason when the request does not fit."""
    reason = context_overflow(asked_by, max_new, prompt_tokens, context)
    if reason is not None:
        raise PromptError(reason)
