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
`top_k`, `return_token_ids` (vLLM's name: the generated token ids in each choice or chunk),
`response_format` on /v1/completions (as vLLM and llama-server accept it).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from .. import registry
from ..constants import MAX_GAMMA, MIN_GAMMA
from .errors import ApiError, bad_request, unsupported

CHAT, COMPLETION = "chat", "completion"
ROLES = ("system", "developer", "user", "assistant", "tool")  # 'developer' is read as 'system' (OpenAI's newer name)
MESSAGE_EXTRAS = {"assistant": ("tool_calls", "refusal"), "tool": ("tool_call_id",)}  # fields beyond role/content/name
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
    "return_token_ids",
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


def parse_chat(body: Any) -> GenerationRequest:
    body = _object(body)
    _check_fields(body, CHAT_FIELDS)
    if _given(body, "functions"):
        raise unsupported("functions", "the deprecated functions field: use tools")
    if _given(body, "function_call"):
        raise unsupported("function_call", "the deprecated function_call field: use tool_choice")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise bad_request(f"tools must be a list of tool objects, got {_kind(tools)}", "tools", "invalid_type")
    logprobs = _bool(body, "logprobs", False)
    top = body.get("top_logprobs")
    if top is not None:
        top = _int(body, "top_logprobs", 0)
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
        messages=_messages(body),
        max_tokens_param=param,
        response_format=_response_format(body),
        tools=None if not tools else tuple(tools),
        tool_choice=body.get("tool_choice"),
        parallel_tool_calls=_bool(body, "parallel_tool_calls", True),
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
            f"response_format must be {{'type': 'text' | 'json_object' | 'json_schema', ...}}, got {_kind(fmt)}",
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
        logprobs = _int(body, "logprobs", 0)
        if not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS:
            raise bad_request(
                f"logprobs must be an integer in 0..{MAX_COMPLETION_LOGPROBS}, got {logprobs!r}", "logprobs"
            )
    return GenerationRequest(
        COMPLETION,
        _model(body),
        _sampling(body, max_tokens),
        *_streaming(body),
        prompt=_prompt(body),
        logprobs=logprobs,
        response_format=_response_format(body),
    )


# --- fields --------------------------------------------------------------------------------
def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {_kind(body)}", None, "invalid_type")
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
        raise bad_request(f"model must be a string, got {_kind(model)}", "model", "invalid_type")
    return model


def _streaming(body: dict) -> tuple[bool, bool, bool]:
    """(stream, include_usage, return_token_ids)."""
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        if not isinstance(options, dict):
            raise bad_request(
                f"stream_options must be an object, got {_kind(options)}", "stream_options", "invalid_type"
            )
        for name in options:
            if name != "include_usage":
                raise bad_request(
                    f"unrecognized stream option {name!r} (known: 'include_usage')",
                    f"stream_options.{name}",
                    "unknown_parameter",
                )
        include_usage = _bool(options, "include_usage", False, "stream_options.include_usage")
    return stream, include_usage, _bool(body, "return_token_ids", False)


def _sampling(body: dict, max_tokens: int | None) -> Sampling:
    if not _absent_or(body.get("n"), 1):
        raise unsupported("n", f"one choice per request (n must be 1, got {body['n']!r})")
    for name in ("presence_penalty", "frequency_penalty"):
        if not _absent_or(body.get(name), 0, 0.0):
            raise unsupported(name, "penalties would change the target's distribution (only 0 is accepted)")
    if not _absent_or(body.get("logit_bias"), {}):
        raise unsupported("logit_bias", "biases would change the target's distribution (only {} is accepted)")
    temperature = _number(body, "temperature", DEFAULT_TEMPERATURE)
    if not 0.0 <= temperature <= MAX_TEMPERATURE:
        raise bad_request(
            f"temperature must be in [0, {MAX_TEMPERATURE:g}] (0 = greedy), got {temperature!r}", "temperature"
        )
    top_p = _number(body, "top_p", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise bad_request(f"top_p must be in (0, 1], got {top_p!r}", "top_p")
    top_k = _int(body, "top_k", 0)
    if top_k < 0:
        raise bad_request(f"top_k must be >= 0 (0 = off), got {top_k!r}", "top_k")
    seed = body.get("seed")
    if seed is not None:
        seed = _int(body, "seed", 0)
        if not 0 <= seed < 1 << 64:
            raise bad_request(f"seed must be an integer in [0, 2**64), got {seed!r}", "seed")
    proposer = body.get("proposer")
    if proposer is not None and proposer not in registry.names():
        raise bad_request(
            f"proposer must be one of {', '.join(map(repr, registry.names()))}, got {proposer!r}", "proposer"
        )
    gamma = body.get("gamma")
    if gamma is not None:
        gamma = _int(body, "gamma", 0)
        if not MIN_GAMMA <= gamma <= MAX_GAMMA:
            expected = f"an integer in {MIN_GAMMA}..{MAX_GAMMA} (absent = adaptive)"
            raise bad_request(f"gamma must be {expected}, got {gamma!r}", "gamma")
    return Sampling(max_tokens, temperature, top_p, top_k, seed, _stop(body), proposer, gamma)


def _max_tokens(body: dict, names: tuple[str, ...]) -> tuple[int | None, str]:
    """(the maximum new tokens asked for or None, the field that asked: for error messages)."""
    given = [name for name in names if _given(body, name)]
    values = {name: _int(body, name, 0) for name in given}
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
        raise bad_request(f"stop must be a string or a list of strings, got {_kind(stop)}", "stop", "invalid_type")
    if len(stops) > MAX_STOPS:
        raise bad_request(f"stop holds at most {MAX_STOPS} strings, got {len(stops)}", "stop")
    for i, s in enumerate(stops):
        if not isinstance(s, str) or not s:
            raise bad_request(
                f"stop strings must be non-empty strings, got {s!r}", f"stop[{i}]" if stops is stop else "stop"
            )
        _utf8(s, f"stop[{i}]" if stops is stop else "stop")
    return tuple(stops)


def _messages(body: dict) -> tuple[dict, ...]:
    messages = body.get("messages")
    if messages is None:
        raise bad_request("messages is required", "messages", "missing_required_parameter")
    if not isinstance(messages, list):
        raise bad_request(
            f"messages must be a list of message objects, got {_kind(messages)}", "messages", "invalid_type"
        )
    if not messages:
        raise bad_request("messages is empty (expected at least one message)", "messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"{where} must be an object, got {_kind(message)}", where, "invalid_type")
        role = message.get("role")
        if role == "function":
            raise unsupported(f"{where}.role", "the deprecated role 'function': use 'tool'")
        if not isinstance(role, str) or role not in ROLES:
            raise bad_request(
                f"{where}.role must be one of {', '.join(map(repr, ROLES))}, got {role!r}", f"{where}.role"
            )
        known = ("role", "content", "name") + MESSAGE_EXTRAS.get(role, ())
        for key in message:
            if key not in known:
                raise bad_request(
                    f"unrecognized message field {key!r} for role {role!r} (known: {', '.join(known)})",
                    f"{where}.{key}",
                    "unknown_parameter",
                )
        if "name" in message and not isinstance(message["name"], str):
            raise bad_request(
                f"{where}.name must be a string, got {_kind(message['name'])}", f"{where}.name", "invalid_type"
            )
        entry: dict = {"role": "system" if role == "developer" else role}
        calls = message.get("tool_calls")
        if role == "assistant" and calls:
            entry["tool_calls"] = _tool_calls(calls, where)
            entry["content"] = _content(message["content"], where) if message.get("content") is not None else ""
        else:
            entry["content"] = _content(message.get("content"), where)
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str):
                raise bad_request(f"{where}.tool_call_id must be a string", f"{where}.tool_call_id", "invalid_type")
            entry["tool_call_id"] = call_id
        out.append(entry)
    return tuple(out)


def _tool_calls(calls: Any, where: str) -> list[dict]:
    """An assistant turn's earlier tool calls: [{id, type: function, function: {name, arguments}}]."""
    if not isinstance(calls, list):
        raise bad_request(
            f"{where}.tool_calls must be a list, got {_kind(calls)}", f"{where}.tool_calls", "invalid_type"
        )
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
            raise bad_request(
                f"{at} must be {{'id', 'type': 'function', 'function': {{'name': str, 'arguments': str}}}}",
                at,
                "invalid_type",
            )
        try:
            json.loads(fn["arguments"] or "{}")
        except ValueError:
            raise bad_request(f"{at}.function.arguments is not JSON", f"{at}.function.arguments") from None
        out.append(
            {
                "id": str(call.get("id", "")),
                "type": "function",
                "function": {"name": fn["name"], "arguments": fn["arguments"]},
            }
        )
    return out


def _utf8(text: str, param: str) -> str:
    """`text` unchanged, or a 400 when it holds a lone surrogate (JSON "\\ud800" decodes to one)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_request(f"{param} is not valid Unicode: {exc.reason} at position {exc.start}", param) from None
    return text


def _content(content: Any, where: str) -> str:
    """A message's text: a string, or a list of {'type': 'text', 'text': str} parts (joined)."""
    if isinstance(content, str):
        return _utf8(content, f"{where}.content")
    if not isinstance(content, list):
        raise bad_request(
            f"{where}.content must be a string or a list of text parts, got {_kind(content)}",
            f"{where}.content",
            "invalid_type",
        )
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise bad_request(f"{at} must be an object with a 'type', got {_kind(part)}", at, "invalid_type")
        if part["type"] != "text":
            raise unsupported(f"{at}.type", f"content part {part['type']!r} (only 'text' parts are read)")
        if not isinstance(part.get("text"), str):
            raise bad_request(
                f"{at}.text must be a string, got {_kind(part.get('text'))}", f"{at}.text", "invalid_type"
            )
        texts.append(_utf8(part["text"], f"{at}.text"))
    return "".join(texts)


def _prompt(body: dict) -> str | tuple[int, ...]:
    prompt = body.get("prompt")
    if prompt is None:
        raise bad_request("prompt is required", "prompt", "missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt is empty (expected at least one character)", "prompt")
        return _utf8(prompt, "prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, (str, list)) for t in prompt):
        raise unsupported("prompt", f"one prompt per request, got a batch of {len(prompt)}")
    if (
        not isinstance(prompt, list)
        or not prompt
        or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        raise bad_request(
            f"prompt must be a non-empty string or a non-empty list of token ids, got {_kind(prompt)}",
            "prompt",
            "invalid_type",
        )
    return tuple(prompt)


# --- scalars -------------------------------------------------------------------------------
def _kind(value: Any) -> str:
    names = {
        type(None): "null",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "an object",
    }
    text = repr(value)
    return f"{names.get(type(value), type(value).__name__)} {text if len(text) <= 40 else text[:37] + '...'}"


def _bool(body: dict, name: str, default: bool, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{param or name} must be a boolean, got {_kind(value)}", param or name, "invalid_type")
    return value


def _int(body: dict, name: str, default: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # JSON 4.0: an integer written as a number
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{name} must be an integer, got {_kind(value)}", name, "invalid_type")
    return value


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(f"{name} must be a finite number, got {_kind(value)}", name, "invalid_type")
    return float(value)


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
