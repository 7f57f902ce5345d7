"""Request bodies of /v1/chat/completions and /v1/completions, validated into dataclasses.

Every rejection is an ApiError 400 whose `param` names the field. Fields the server cannot honour
(n > 1, penalties, logit_bias, ...) are rejected, never silently ignored; fields that do not
change the output (user, metadata, ...) are accepted and ignored; any other field is rejected as
unrecognized, as OpenAI does. A JSON null means "absent" for every optional field.

Structured output (structured.py, tools.py): `response_format` ({"type": "text"},
{"type": "json_object"}, {"type": "json_schema", "json_schema": {"name", "schema", "strict",
"description"}}), `tools` and `tool_choice` are read here and compiled by the handler (a schema
llguidance refuses is a 400 naming the field); `logprobs` / `top_logprobs` (chat, up to 20) and
`logprobs` (completions, an integer up to 5) return the target's (masked) log-probabilities.

Extensions (not in OpenAI's API): `proposer` (a registered proposer, registry.names(); 'none' =
target only), `gamma` (fixed draft length constants.MIN_GAMMA..MAX_GAMMA; absent = adaptive),
`top_k`, `min_p` and `repetition_penalty` (vLLM's and llama-server's: applied to the target's
rows before verification, so speculation stays exact), `return_token_ids` (vLLM's name: the
generated token ids in each choice or chunk),
`response_format` on /v1/completions (as vLLM and llama-server accept it), `trace` (streamed
chunks carry how each token came: trace.py).

The chat messages and the completion prompt are read in messages.py, scalar fields in fields.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import registry
from ..constants import MAX_GAMMA, MIN_GAMMA
from ..penalties import MAX_PENALTY
from .errors import ApiError, bad_request, unsupported
from .fields import check_utf8, kind_of, read_bool, read_int, read_number
from .messages import read_messages, read_prompt

CHAT, COMPLETION = "chat", "completion"
MAX_STOPS = 4  # OpenAI's limit
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default: sampling; pass 0 for greedy
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat: the rest of the context)

IGNORED = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier")
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs (OpenAI's bound)
MAX_COMPLETION_LOGPROBS = 5  # completions' logprobs (OpenAI's bound)
COMMON = (
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "proposer",
    "gamma",
    "top_k",
    "min_p",
    "repetition_penalty",
    "return_token_ids",
    "cache_prompt",
    "trace",
    *IGNORED,
)
CHAT_FIELDS = (
    *COMMON,
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "functions",
    "function_call",
    "response_format",
)
COMPLETION_FIELDS = (*COMMON, "prompt", "echo", "best_of", "suffix", "response_format")


@dataclass(frozen=True)
class Sampling:
    max_tokens: int | None  # None: the default of the endpoint (chat: the rest of the context)
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    proposer: str | None = None  # None: the server's default
    gamma: int | None = None  # None: adaptive
    cache_prompt: bool = True  # reuse and leave cached prompt rows (llama-server's field; prefix_cache.py)
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off


@dataclass(frozen=True)
class GenerationRequest:
    kind: str  # CHAT or COMPLETION
    model: str | None
    sampling: Sampling
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    messages: tuple[dict, ...] = ()  # chat: {'role', 'content'} (+ an assistant's tool_calls, a tool's tool_call_id)
    prompt: str | tuple[int, ...] | None = None  # completion: text or token ids
    max_tokens_param: str = "max_tokens"  # the field that set sampling.max_tokens (for errors)
    response_format: dict | None = None  # json_object / json_schema (None: text)
    tools: tuple | None = None  # chat: OpenAI tool definitions, checked by tools.ToolPlan
    tool_choice: Any = None
    parallel_tool_calls: bool = True  # False: at most one tool call per answer
    logprobs: int | None = None  # alternatives per token when log-probabilities are asked for (None: not asked)
    trace: bool = False  # streamed chunks say how each token came (trace.py; the web page asks for it)


def parse_chat(body: Any) -> GenerationRequest:
    body = _object(body)
    _check_fields(body, CHAT_FIELDS)
    if _given(body, "functions"):
        raise unsupported("functions", "the deprecated functions field: use tools")
    if _given(body, "function_call"):
        raise unsupported("function_call", "the deprecated function_call field: use tool_choice")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise bad_request(f"tools must be a list of tool objects, got {kind_of(tools)}", "tools", "invalid_type")
    logprobs = read_bool(body, "logprobs", False)
    top = body.get("top_logprobs")
    if top is not None:
        top = read_int(body, "top_logprobs", 0)
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise bad_request(f"top_logprobs must be an integer in 0..{MAX_TOP_LOGPROBS}, got {top!r}", "top_logprobs")
        if not logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    max_tokens, param = _max_tokens(body, ("max_completion_tokens", "max_tokens"))
    return GenerationRequest(
        CHAT,
        _model(body),
        _sampling(body, max_tokens),
        *_streaming(body),
        messages=read_messages(body),
        trace=read_bool(body, "trace", False),
        max_tokens_param=param,
        response_format=_response_format(body),
        tools=None if not tools else tuple(tools),
        tool_choice=body.get("tool_choice"),
        parallel_tool_calls=read_bool(body, "parallel_tool_calls", True),
        logprobs=(top or 0) if logprobs else None,
    )


def _response_format(body: dict) -> dict | None:
    """None (text), or the json_object / json_schema format, its shape checked (the schema itself
    is compiled by the handler)."""
    fmt = body.get("response_format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise bad_request(
            f"response_format must be {{'type': 'text' | 'json_object' | 'json_schema', ...}}, got {kind_of(fmt)}",
            "response_format",
        )
    extra = sorted(set(fmt) - {"type", "json_schema"})
    if extra:
        raise bad_request(
            f"response_format has unknown field {extra[0]!r}", f"response_format.{extra[0]}", "unknown_parameter"
        )
    if fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise bad_request(
            "response_format.json_schema must be an object with a 'schema' object", "response_format.json_schema"
        )
    extra = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if extra:
        raise bad_request(
            f"response_format.json_schema has unknown field {extra[0]!r}",
            f"response_format.json_schema.{extra[0]}",
            "unknown_parameter",
        )
    return {"type": "json_schema", "schema": spec["schema"], "strict": bool(spec.get("strict") or False)}


def parse_completion(body: Any) -> GenerationRequest:
    body = _object(body)
    _check_fields(body, COMPLETION_FIELDS)
    if not _absent_or(body.get("echo"), False):
        raise unsupported("echo", "the prompt is not echoed")
    if not _absent_or(body.get("best_of"), 1):
        raise unsupported("best_of", "one completion per request")
    if _given(body, "suffix"):
        raise unsupported("suffix", "insertion (fill in the middle) is not implemented")
    max_tokens, _ = _max_tokens(body, ("max_tokens",))
    if max_tokens is None:
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS
    logprobs = body.get("logprobs")
    if logprobs is not None:
        logprobs = read_int(body, "logprobs", 0)
        if not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS:
            raise bad_request(
                f"logprobs must be an integer in 0..{MAX_COMPLETION_LOGPROBS}, got {logprobs!r}", "logprobs"
            )
    return GenerationRequest(
        COMPLETION,
        _model(body),
        _sampling(body, max_tokens),
        *_streaming(body),
        prompt=read_prompt(body),
        trace=read_bool(body, "trace", False),
        logprobs=logprobs,
        response_format=_response_format(body),
    )


# --- fields --------------------------------------------------------------------------------
def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {kind_of(body)}", None, "invalid_type")
    return body


def _given(body: dict, name: str) -> bool:
    return body.get(name) is not None


def _absent_or(value: Any, *allowed: Any) -> bool:
    """None, or equal to one of `allowed` with the same JSON type (True is not 1, 0 is not False)."""
    return value is None or any(type(value) is type(a) and value == a for a in allowed)


def _check_fields(body: dict, allowed: tuple[str, ...]) -> None:
    for name in body:
        if name not in allowed:
            raise bad_request(f"unrecognized request argument supplied: {name!r}", name, "unknown_parameter")


def _model(body: dict) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request(f"model must be a string, got {kind_of(model)}", "model", "invalid_type")
    return model


def _streaming(body: dict) -> tuple[bool, bool, bool]:
    """(stream, include_usage, return_token_ids)."""
    stream = read_bool(body, "stream", False)
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        if not isinstance(options, dict):
            raise bad_request(
                f"stream_options must be an object, got {kind_of(options)}", "stream_options", "invalid_type"
            )
        for name in options:
            if name != "include_usage":
                raise bad_request(
                    f"unrecognized stream option {name!r} (known: 'include_usage')",
                    f"stream_options.{name}",
                    "unknown_parameter",
                )
        include_usage = read_bool(options, "include_usage", False, "stream_options.include_usage")
    return stream, include_usage, read_bool(body, "return_token_ids", False)


def _sampling(body: dict, max_tokens: int | None) -> Sampling:
    if not _absent_or(body.get("n"), 1):
        raise unsupported("n", f"one choice per request (n must be 1, got {body['n']!r})")
    for name in ("presence_penalty", "frequency_penalty"):
        if not _absent_or(body.get(name), 0, 0.0):
            raise unsupported(name, "penalties would change the target's distribution (only 0 is accepted)")
    if not _absent_or(body.get("logit_bias"), {}):
        raise unsupported("logit_bias", "biases would change the target's distribution (only {} is accepted)")
    temperature = read_number(body, "temperature", DEFAULT_TEMPERATURE)
    if not 0.0 <= temperature <= MAX_TEMPERATURE:
        raise bad_request(
            f"temperature must be in [0, {MAX_TEMPERATURE:g}] (0 = greedy), got {temperature!r}", "temperature"
        )
    top_p = read_number(body, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise bad_request(f"top_p must be in (0, 1], got {top_p!r}", "top_p")
    top_k = read_int(body, "top_k", 0)
    if top_k < 0:
        raise bad_request(f"top_k must be >= 0 (0 = off), got {top_k!r}", "top_k")
    min_p = read_number(body, "min_p", 0.0)
    if not 0.0 <= min_p < 1.0:
        raise bad_request(f"min_p must be in [0, 1) (0 = off), got {min_p!r}", "min_p")
    penalty = read_number(body, "repetition_penalty", 1.0)
    if not 0.0 < penalty <= MAX_PENALTY:
        raise bad_request(
            f"repetition_penalty must be in (0, {MAX_PENALTY:g}] (1 = off), got {penalty!r}", "repetition_penalty"
        )
    seed = body.get("seed")
    if seed is not None:
        seed = read_int(body, "seed", 0)
        if not 0 <= seed < 1 << 64:
            raise bad_request(f"seed must be an integer in [0, 2**64), got {seed!r}", "seed")
    proposer = body.get("proposer")
    if proposer is not None and proposer not in registry.names():
        raise bad_request(
            f"proposer must be one of {', '.join(map(repr, registry.names()))}, got {proposer!r}", "proposer"
        )
    gamma = body.get("gamma")
    if gamma is not None:
        gamma = read_int(body, "gamma", 0)
        if not MIN_GAMMA <= gamma <= MAX_GAMMA:
            expected = f"an integer in {MIN_GAMMA}..{MAX_GAMMA} (absent = adaptive)"
            raise bad_request(f"gamma must be {expected}, got {gamma!r}", "gamma")
    cache_prompt = read_bool(body, "cache_prompt", True)
    return Sampling(
        max_tokens,
        temperature,
        top_p,
        top_k,
        seed,
        _stop(body),
        proposer,
        gamma,
        cache_prompt=cache_prompt,
        min_p=min_p,
        repetition_penalty=penalty,
    )


def _max_tokens(body: dict, names: tuple[str, ...]) -> tuple[int | None, str]:
    """(the maximum new tokens asked for or None, the field that asked: for error messages)."""
    given = [name for name in names if _given(body, name)]
    values = {name: read_int(body, name, 0) for name in given}
    for name, value in values.items():
        if value < 1:
            raise bad_request(f"{name} must be an integer >= 1, got {value!r}", name)
    if len(set(values.values())) > 1:
        raise bad_request(f"{' and '.join(given)} differ ({values}); give one", given[-1])
    return next(iter(values.values()), None), (given or ["max_tokens"])[0]


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list):
        raise bad_request(f"stop must be a string or a list of strings, got {kind_of(stop)}", "stop", "invalid_type")
    if len(stops) > MAX_STOPS:
        raise bad_request(f"stop holds at most {MAX_STOPS} strings, got {len(stops)}", "stop")
    for i, s in enumerate(stops):
        if not isinstance(s, str) or not s:
            raise bad_request(
                f"stop strings must be non-empty strings, got {s!r}", f"stop[{i}]" if stops is stop else "stop"
            )
        check_utf8(s, f"stop[{i}]" if stops is stop else "stop")
    return tuple(stops)


def check_model(request_model: str | None, served: str) -> None:
    """An unknown model name is a 404, as OpenAI answers it (absent: the one served)."""
    if request_model is not None and request_model != served:
        raise ApiError(
            404,
            f"the model {request_model!r} does not exist; this server serves {served!r}",
            "invalid_request_error",
            "model",
            "model_not_found",
        )
