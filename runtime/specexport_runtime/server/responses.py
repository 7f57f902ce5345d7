"""Response bodies and SSE chunks in OpenAI's shapes, plus the `speculative` object.

A streamed chat completion is, in order: one chunk with `delta.role`, content chunks, one chunk
with `finish_reason` (and `speculative`; and `usage` unless stream_options.include_usage asked for
a usage chunk), the usage chunk when asked for (`choices: []`, `usage`, `speculative`; every
other chunk then has `usage: null`, as OpenAI sends them), then `data: [DONE]`. A streamed text
completion is the same without the role chunk. Usage appears in exactly one chunk, so clients
that add usage up over chunks count it once.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from ..generator import GenerationStats
from .schemas import CHAT

# runtime finish reasons -> OpenAI's ('eos' and a stop string are both 'stop')
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class Outcome:
    """How one generation ended, with its figures (built by the worker)."""

    finish_reason: str  # the runtime's: 'eos' | 'stop' | 'length'
    stats: GenerationStats
    proposer: str  # the proposer that ran ('none': target only)
    gamma_policy: str  # 'adaptive' | 'fixed' | 'fixed (seeded sampling)' | 'off'
    gamma: int | None  # the fixed draft length, when one was asked for
    queue_seconds: float
    ttft_seconds: float | None  # request arrival (before queueing) to the first token
    interrupted: str | None = None  # 'timeout' | 'shutdown' when the server cut the generation short

    @property
    def openai_finish_reason(self) -> str:
        return FINISH_REASONS[self.finish_reason]


def usage(stats: GenerationStats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.new_tokens,
            "total_tokens": stats.prompt_tokens + stats.new_tokens}


def speculative(outcome: Outcome) -> dict:
    """The speculation figures of one request (GenerationStats, named for readers of the API)."""
    s = outcome.stats
    return {
        "proposer": outcome.proposer,
        "gamma_policy": outcome.gamma_policy,
        "gamma": outcome.gamma,
        "drafted": s.drafted,
        "accepted": s.accepted,
        "acceptance_rate": s.acceptance_rate,
        "mean_accepted_length": s.mean_accepted_length,  # tokens per target call
        "per_position_acceptance": s.per_position_acceptance,
        "rounds": s.rounds,  # speculative rounds (one verify call each)
        "plain_steps": s.plain_steps,  # one-token target calls
        "by_source": {name: {"rounds": r, "drafted": d, "accepted": a} for name, (r, d, a) in s.by_source.items()},
        "decode_tokens_per_second": s.tokens_per_second,
        "time_to_first_token_seconds": outcome.ttft_seconds,
        "queue_seconds": outcome.queue_seconds,
        "prefill_seconds": s.prefill_seconds,
    }


def sse(data: dict) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


class Renderer:
    """The bodies of one request's response (one id and creation time for all its chunks)."""

    def __init__(self, kind: str, model: str, include_usage: bool = False, return_token_ids: bool = False):
        self.kind, self.model = kind, model
        self.include_usage, self.return_token_ids = include_usage, return_token_ids
        self.id = ("chatcmpl-" if kind == CHAT else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _envelope(self, chunk: bool) -> dict:
        if self.kind == CHAT:
            kind = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _choice(self, text: str | None, tokens: list[int] | None, finish: str | None, chunk: bool) -> dict:
        if self.kind == CHAT:
            if chunk:
                body = {"delta": {} if text is None else {"content": text}}
            else:
                body = {"message": {"role": "assistant", "content": text}}
        else:
            body = {"text": text or ""}
        choice = {"index": 0, **body, "logprobs": None, "finish_reason": finish}
        if self.return_token_ids and tokens is not None:
            choice["token_ids"] = tokens
        return choice

    def _chunk(self, choices: list[dict]) -> dict:
        data = {**self._envelope(True), "choices": choices}
        if self.include_usage:
            data["usage"] = None
        return data

    # --- streaming ---
    def role_chunk(self) -> bytes | None:
        if self.kind != CHAT:
            return None
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return sse(self._chunk([choice]))

    def content_chunk(self, text: str, tokens: list[int]) -> bytes | None:
        if not text and not (self.return_token_ids and tokens):
            return None  # nothing to say this round (a held-back stop prefix or a partial character)
        return sse(self._chunk([self._choice(text, tokens, None, chunk=True)]))

    def final_chunks(self, outcome: Outcome) -> bytes:
        choice = self._choice(None if self.kind == CHAT else "", None, outcome.openai_finish_reason, chunk=True)
        if outcome.interrupted:
            choice["interrupted"] = outcome.interrupted
        final = self._chunk([choice])
        final["speculative"] = speculative(outcome)
        if not self.include_usage:
            final["usage"] = usage(outcome.stats)
            return sse(final)
        tail = {**self._envelope(True), "choices": [], "usage": usage(outcome.stats), "speculative": final["speculative"]}
        return sse(final) + sse(tail)

    # --- whole response ---
    def completion(self, text: str, tokens: list[int], outcome: Outcome) -> dict:
        choice = self._choice(text, tokens, outcome.openai_finish_reason, chunk=False)
        if outcome.interrupted:
            choice["interrupted"] = outcome.interrupted
        return {**self._envelope(False), "choices": [choice], "usage": usage(outcome.stats),
                "speculative": speculative(outcome)}
