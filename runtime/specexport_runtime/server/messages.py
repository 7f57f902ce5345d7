"""The conversation of /v1/chat/completions (`messages`: roles, text content or text parts, an
assistant's earlier tool calls, a tool's answer) and the prompt of /v1/completions (text or
token ids), validated; every rejection is an ApiError 400 naming the field.
"""

from __future__ import annotations

import json
from typing import Any

from .errors import bad_request, unsupported
from .fields import check_utf8, kind_of

ROLES = ("system", "developer", "user", "assistant", "tool")  # 'developer' is read as 'system' (OpenAI's newer name)
MESSAGE_EXTRAS = {"assistant": ("tool_calls", "refusal"), "tool": ("tool_call_id",)}  # fields beyond role/content/name


def read_messages(body: dict) -> tuple[dict, ...]:
    messages = body.get("messages")
    if messages is None:
        raise bad_request("messages is required", "messages", "missing_required_parameter")
    if not isinstance(messages, list):
        raise bad_request(
            f"messages must be a list of message objects, got {kind_of(messages)}", "messages", "invalid_type"
        )
    if not messages:
        raise bad_request("messages is empty (expected at least one message)", "messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"{where} must be an object, got {kind_of(message)}", where, "invalid_type")
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
                f"{where}.name must be a string, got {kind_of(message['name'])}", f"{where}.name", "invalid_type"
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
            f"{where}.tool_calls must be a list, got {kind_of(calls)}", f"{where}.tool_calls", "invalid_type"
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


def _content(content: Any, where: str) -> str:
    """A message's text: a string, or a list of {'type': 'text', 'text': str} parts (joined)."""
    if isinstance(content, str):
        return check_utf8(content, f"{where}.content")
    if not isinstance(content, list):
        raise bad_request(
            f"{where}.content must be a string or a list of text parts, got {kind_of(content)}",
            f"{where}.content",
            "invalid_type",
        )
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise bad_request(f"{at} must be an object with a 'type', got {kind_of(part)}", at, "invalid_type")
        if part["type"] != "text":
            raise unsupported(f"{at}.type", f"content part {part['type']!r} (only 'text' parts are read)")
        if not isinstance(part.get("text"), str):
            raise bad_request(
                f"{at}.text must be a string, got {kind_of(part.get('text'))}", f"{at}.text", "invalid_type"
            )
        texts.append(check_utf8(part["text"], f"{at}.text"))
    return "".join(texts)


def read_prompt(body: dict) -> str | tuple[int, ...]:
    prompt = body.get("prompt")
    if prompt is None:
        raise bad_request("prompt is required", "prompt", "missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt is empty (expected at least one character)", "prompt")
        return check_utf8(prompt, "prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, (str, list)) for t in prompt):
        raise unsupported("prompt", f"one prompt per request, got a batch of {len(prompt)}")
    if (
        not isinstance(prompt, list)
        or not prompt
        or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        raise bad_request(
            f"prompt must be a non-empty string or a non-empty list of token ids, got {kind_of(prompt)}",
            "prompt",
            "invalid_type",
        )
    return tuple(prompt)
