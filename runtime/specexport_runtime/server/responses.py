"""Response bodies and SSE chunks in OpenAI's shapes, plus the `speculative` object.

A streamed chat completion is, in order: one chunk with `delta.role`, content chunks, one chunk
with `finish_reason` (and `speculative`; and `usage` unless stream_options.include_usage asked for
a usage chunk), the usage chunk when asked for (`choices: []`, `usage`, `speculative`; every
other chunk then has `usage: null`, as OpenAI sends them), then `data: [DONE]`. A streamed text
completion is the same without the role chunk. Usage appears in exactly one chunk, so clients
that add usage up over chunks count it once.

With tools, an answer that is a tool call (it starts with "{": tools.py) is held back and sent
as one `delta.tool_calls` chunk per call (index, id, type, function name and whole arguments)
before the finish chunk, whose finish_reason is `tool_calls`; plain content streams as usual.
Log-probabilities ride with the content they belong to: chat `logprobs.content[]` entries
(token, logprob, bytes, top_logprobs), completions `logprobs` (tokens, token_logprobs,
top_logprobs, text_offset).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from ..generator import GenerationStats
from ..tools import ToolCall, ToolPlan
from .schemas import CHAT
from .trace import trace_items

# runtime finish reasons -> OpenAI's ('eos' and a stop string are both 'stop')
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class Outcome:
    """How one generation ended, with its figures (built by the worker)."""

    finish_reason: str  # the runtime's: 'eos' | 'stop' | 'length'
    stats: GenerationStats
    proposer: str  # the proposer that ran ('none': target only)
    gamma_policy: str  # config.GeneratorConfig.gamma_policy: 'adaptive' | 'fixed' | 'fixed (artifact)' | 'off' | ...
    gamma: int | None  # the fixed draft length, when one was asked for
    queue_seconds: float
    ttft_seconds: float | None  # request arrival (before queueing) to the first token
    interrupted: str | None = None  # 'timeout' | 'shutdown' when the server cut the generation short
    tree_nodes: int = 0  # the draft trees' size (0: chains)
    tree_policy: str = "chains"  # where it came from: 'given' | 'calibrated' | 'chains' (config.py "Tree size")

    @property
    def openai_finish_reason(self) -> str:
        return FINISH_REASONS[self.finish_reason]


def usage(stats: GenerationStats) -> dict:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.new_tokens,
        "total_tokens": stats.prompt_tokens + stats.new_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},  # from the prefix pool
    }


def speculative(outcome: Outcome) -> dict:
    """The speculation figures of one request (GenerationStats, named for readers of the API)."""
    s = outcome.stats
    return {
        "proposer": outcome.proposer,
        "gamma_policy": outcome.gamma_policy,
        "gamma": outcome.gamma,
        "tree_nodes": outcome.tree_nodes,
        "tree_policy": outcome.tree_policy,
        "drafted": s.drafted,
        "accepted": s.accepted,
        "acceptance_rate": s.acceptance_rate,
        "mean_accepted_length": s.mean_accepted_length,  # tokens per target call
        "per_position_acceptance": s.per_position_acceptance,
        "forced": s.forced,  # drafted because the grammar forces them (structured output): free
        "forced_accepted": s.forced_accepted,
        "grammar_cut": s.grammar_cut,  # draft tokens the grammar forbade, cut before verification
        "rounds": s.rounds,  # speculative rounds (one verify call each)
        "plain_steps": s.plain_steps,  # one-token target calls
        "by_source": {name: {"rounds": r, "drafted": d, "accepted": a} for name, (r, d, a) in s.by_source.items()},
        "decode_tokens_per_second": s.tokens_per_second,
        "time_to_first_token_seconds": outcome.ttft_seconds,
        "queue_seconds": outcome.queue_seconds,
        "prefill_seconds": s.prefill_seconds,
        "cached_tokens": s.cached_tokens,  # prompt tokens whose K/V came from the prefix pool
    }


def sse(data: dict) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


class Renderer:
    """The bodies of one request's response (one id and creation time for all its chunks).
    plan: the request's tools (None: none); codec: the artifact's, when log-probabilities are
    returned (token texts)."""

    def __init__(
        self,
        kind: str,
        model: str,
        include_usage: bool = False,
        return_token_ids: bool = False,
        plan: ToolPlan | None = None,
        codec=None,
    ):
        self.kind, self.model = kind, model
        self.include_usage, self.return_token_ids = include_usage, return_token_ids
        self.plan = plan if plan is not None and plan.active else None
        self.codec = codec
        self.id = ("chatcmpl-" if kind == CHAT else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.mode: str | None = None  # with tools: 'content' or 'call' once the answer's first text shows
        self.held: list[str] = []  # a tool call's text, held back until it is complete
        self.offset = 0  # completions: characters of text sent so far (logprobs.text_offset)
        self.trace_codec = None  # the artifact's codec when the request asked for a trace (trace.py)

    def _envelope(self, chunk: bool) -> dict:
        if self.kind == CHAT:
            kind = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _choice(
        self,
        text: str | None,
        tokens: list[int] | None,
        finish: str | None,
        chunk: bool,
        logprobs: list[dict] | None = None,
    ) -> dict:
        if self.kind == CHAT:
            if chunk:
                body = {"delta": {} if text is None else {"content": text}}
            else:
                body = {"message": {"role": "assistant", "content": text}}
        else:
            body = {"text": text or ""}
        choice = {"index": 0, **body, "logprobs": self._logprobs(logprobs, text), "finish_reason": finish}
        if self.return_token_ids and tokens is not None:
            choice["token_ids"] = tokens
        return choice

    def _logprobs(self, entries: list[dict] | None, text: str | None) -> dict | None:
        if self.codec is None or entries is None:
            return None

        def piece(token: int) -> str:
            return self.codec.decode([token])

        if self.kind == CHAT:
            return {
                "content": [
                    {
                        "token": piece(e["token"]),
                        "logprob": e["logprob"],
                        "bytes": list(piece(e["token"]).encode()),
                        "top_logprobs": [
                            {"token": piece(t), "logprob": lp, "bytes": list(piece(t).encode())} for t, lp in e["top"]
                        ],
                    }
                    for e in entries
                ]
            }
        offsets = []
        for e in entries:
            offsets.append(self.offset)
            self.offset += len(piece(e["token"]))
        return {
            "tokens": [piece(e["token"]) for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{piece(t): lp for t, lp in e["top"]} for e in entries],
            "text_offset": offsets,
        }

    def _chunk(self, choices: list[dict]) -> dict:
        data = {**self._envelope(True), "choices": choices}
        if self.include_usage:
            data["usage"] = None
        return data

    def _finish(self, outcome: Outcome, calls: tuple[ToolCall, ...]) -> str:
        """'tool_calls' for an answer of calls, 'length' when max_tokens cut it (with the calls it
        completed), else the generation's."""
        return "tool_calls" if calls and outcome.finish_reason != "length" else outcome.openai_finish_reason

    # --- streaming ---
    def role_chunk(self) -> bytes | None:
        if self.kind != CHAT:
            return None
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return sse(self._chunk([choice]))

    def content_chunk(
        self, text: str, tokens: list[int], logprobs: list[dict] | None = None, kinds: tuple[str, ...] = ()
    ) -> bytes | None:
        if self.plan is not None and self.mode is None and text:
            self.mode = "call" if text.startswith("{") else "content"
        if self.mode == "call":
            self.held.append(text)
            return None
        traced = self.trace_codec is not None and kinds
        if not text and not (self.return_token_ids and tokens) and not traced:
            return None  # nothing to say this round (a held-back stop prefix or a partial character)
        chunk = self._chunk([self._choice(text, tokens, None, chunk=True, logprobs=logprobs or None)])
        if traced:
            chunk["trace"] = trace_items(self.trace_codec, tokens, kinds)
        return sse(chunk)

    def final_chunks(self, outcome: Outcome) -> bytes:
        out, calls = b"", ()
        if self.mode == "call":
            content, calls = self.plan.parse("".join(self.held))
            if calls:
                deltas = [{"index": i, **c.as_openai()} for i, c in enumerate(calls)]
                choice = {"index": 0, "delta": {"tool_calls": deltas}, "logprobs": None, "finish_reason": None}
                out += sse(self._chunk([choice]))
            else:  # cut short: the prefix is content
                out += sse(self._chunk([self._choice(content, None, None, chunk=True)]))
        choice = self._choice(None if self.kind == CHAT else "", None, self._finish(outcome, calls), chunk=True)
        if outcome.interrupted:
            choice["interrupted"] = outcome.interrupted
        final = self._chunk([choice])
        final["speculative"] = speculative(outcome)
        if not self.include_usage:
            final["usage"] = usage(outcome.stats)
            return out + sse(final)
        tail = {
            **self._envelope(True),
            "choices": [],
            "usage": usage(outcome.stats),
            "speculative": final["speculative"],
        }
        return out + sse(final) + sse(tail)

    # --- whole response ---
    def completion(self, text: str, tokens: list[int], outcome: Outcome, logprobs: list[dict] | None = None) -> dict:
        content, calls = self.plan.parse(text) if self.plan is not None else (text, ())
        choice = self._choice(content, tokens, self._finish(outcome, calls), chunk=False, logprobs=logprobs)
        if calls:
            choice["message"]["tool_calls"] = [c.as_openai() for c in calls]
        if outcome.interrupted:
            choice["interrupted"] = outcome.interrupted
        return {
            **self._envelope(False),
            "choices": [choice],
            "usage": usage(outcome.stats),
            "speculative": speculative(outcome),
        }
