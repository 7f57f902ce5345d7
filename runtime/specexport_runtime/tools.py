"""Tool calls in chat (OpenAI's `tools` and `tool_choice`), for the Python API and the server.

    plan = ToolPlan.create(tools, tool_choice, codec)
    ids = codec.encode_chat(plan.messages(messages), tools=plan.template_tools)
    result = gen.generate(ids, grammar=plan.grammar())
    content, calls = plan.parse(result.text)

The model sees the tools either through its chat template (a template that reads a `tools`
variable renders them in the model's own way) or, when the template does not, through a system
message in the generic format below. Either way the answer is constrained (structured.py) to one
of two shapes, so it always parses:

    a tool call   {"tool_calls": [{"name": "<a tool>", "arguments": {<its parameters>}}, ...]}
    plain content any text that does not start with "{" (tool_choice "auto" only)

tool_choice: "none" (no tool is offered, plain content), "auto" (either shape), "required" (a
tool call, one or more), or {"type": "function", "function": {"name": N}} (exactly one call of N).
A list of calls ends at its first call identical (name and arguments) to an earlier one: a model
that repeats itself would otherwise write calls until max_tokens. parse() keeps the calls before
that repeat, and the server stops the generation once repeats() sees it (finish_reason
"tool_calls"); the grammar cannot say "no repeat" itself.
Earlier turns: an assistant message's `tool_calls` is rendered as the JSON above, a `tool`
message (a tool's result) as a user message naming the call it answers.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import InvalidArgument
from .structured import JSON_OPTIONS, Grammar

TOOL_CHOICES = ("none", "auto", "required")
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
GENERIC_SYSTEM = (
    "You can call tools. To call one or more, answer with only a JSON object of the form\n"
    '{{"tool_calls": [{{"name": "<tool name>", "arguments": {{<arguments>}}}}]}}\n'
    "{when}\nTools (name: description; parameters as JSON Schema):\n{tools}"
)
WHEN = {
    "auto": "Otherwise answer normally, in plain text.",
    "required": "You must call a tool.",
    "named": "You must call {name}.",
}


class ToolError(InvalidArgument):
    """A tool definition or tool_choice that cannot be used; `param` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict  # JSON Schema of the arguments object
    strict: bool = False

    def as_openai(self) -> dict:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text (OpenAI's function.arguments)

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parse_tools(tools: Any) -> tuple[Tool, ...]:
    """OpenAI tool definitions -> Tools; ToolError naming tools[i].field otherwise."""
    if not isinstance(tools, (list, tuple)):
        raise ToolError(f"tools must be a list of tool objects, got {type(tools).__name__}", "tools")
    out: list[Tool] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if (
            not isinstance(tool, Mapping)
            or tool.get("type") != "function"
            or not isinstance(tool.get("function"), Mapping)
        ):
            raise ToolError(f"{where} must be {{'type': 'function', 'function': {{...}}}}", where)
        fn = tool["function"]
        unknown = sorted(set(fn) - {"name", "description", "parameters", "strict"})
        if unknown:
            raise ToolError(f"{where}.function has unknown field {unknown[0]!r}", f"{where}.function.{unknown[0]}")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise ToolError(
                f"{where}.function.name must match [A-Za-z0-9_-]{{1,64}}, got {name!r}", f"{where}.function.name"
            )
        if any(t.name == name for t in out):
            raise ToolError(f"{where}.function.name {name!r} is defined twice", f"{where}.function.name")
        description = fn.get("description") or ""
        if not isinstance(description, str):
            raise ToolError(f"{where}.function.description must be a string", f"{where}.function.description")
        parameters = fn.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        if not isinstance(parameters, Mapping) or parameters.get("type", "object") != "object":
            raise ToolError(
                f"{where}.function.parameters must be a JSON Schema of an object", f"{where}.function.parameters"
            )
        out.append(Tool(name, description, dict(parameters), bool(fn.get("strict", False))))
    return tuple(out)


def _choice(tool_choice: Any, tools: tuple[Tool, ...]) -> str:
    """'none' | 'auto' | 'required' | a tool's name."""
    if tool_choice is None:
        return "auto" if tools else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICES:
            raise ToolError(
                f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or a function, got {tool_choice!r}",
                "tool_choice",
            )
        if tool_choice != "none" and not tools:
            raise ToolError(f"tool_choice {tool_choice!r} needs tools", "tool_choice")
        return tool_choice
    fn = tool_choice.get("function") if isinstance(tool_choice, Mapping) else None
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(tool_choice, Mapping) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise ToolError(
            "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
            "tool_choice",
        )
    if name not in {t.name for t in tools}:
        raise ToolError(
            f"tool_choice names function {name!r}, which is not among tools"
            f" ({', '.join(t.name for t in tools) or 'none given'})",
            "tool_choice.function.name",
        )
    return name


@dataclass(frozen=True)
class ToolPlan:
    tools: tuple[Tool, ...]
    choice: str  # 'none' | 'auto' | 'required' | a tool's name
    native: bool  # the chat template renders `tools` itself
    parallel: bool = True  # OpenAI's parallel_tool_calls: False allows one call per answer

    @classmethod
    def create(cls, tools: Any, tool_choice: Any, template_reads_tools: bool, parallel: Any = True) -> ToolPlan:
        parsed = parse_tools(tools) if tools is not None else ()
        choice = _choice(tool_choice, parsed)
        if not isinstance(parallel, bool):
            raise ToolError(f"parallel_tool_calls must be true or false, got {parallel!r}", "parallel_tool_calls")
        plan = cls(parsed, choice, template_reads_tools, parallel)
        for i, tool in enumerate(parsed):  # each parameters schema must compile (checked with the grammar)
            try:
                Grammar.json_schema(tool.parameters, strict=tool.strict).check()
            except InvalidArgument as exc:
                raise ToolError(f"tools[{i}].function.parameters: {exc}", f"tools[{i}].function.parameters") from None
        return plan

    @property
    def active(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    @property
    def template_tools(self) -> list[dict] | None:
        """What the chat template's `tools` variable gets (None: the generic system message)."""
        return [t.as_openai() for t in self.offered] if self.active and self.native else None

    @property
    def offered(self) -> tuple[Tool, ...]:
        if self.choice in ("none", "auto", "required"):
            return self.tools
        return tuple(t for t in self.tools if t.name == self.choice)

    def messages(self, messages: Sequence[Mapping[str, Any]]) -> list[dict]:
        """The conversation as the chat template renders it: tool turns in the generic format
        and, unless the template renders the tools, a system message describing them."""
        out = [_generic_turn(i, m) for i, m in enumerate(messages)]
        if not self.active or self.native:
            return out
        when = WHEN["named"].format(name=self.choice) if self.choice not in WHEN else WHEN[self.choice]
        listing = "\n".join(
            f"- {t.name}: {t.description or '(no description)'} {json.dumps(t.parameters)}" for t in self.offered
        )
        text = GENERIC_SYSTEM.format(when=when, tools=listing)
        if out and out[0]["role"] == "system":
            return [{"role": "system", "content": out[0]["content"] + "\n\n" + text}, *out[1:]]
        return [{"role": "system", "content": text}, *out]

    def call_schema(self) -> dict:
        """JSON Schema of the tool-call object: one alternative per offered tool."""
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in self.offered
        ]
        items = calls[0] if len(calls) == 1 else {"anyOf": calls}
        array = {"type": "array", "items": items, "minItems": 1}
        if self.choice not in TOOL_CHOICES or not self.parallel:  # a named function, or no parallel calls: one
            array["maxItems"] = 1
        return {
            "type": "object",
            "properties": {"tool_calls": array},
            "required": ["tool_calls"],
            "additionalProperties": False,
            "x-guidance": JSON_OPTIONS,
        }

    @property
    def multiple(self) -> bool:
        """Whether an answer may hold several calls (so a call can repeat)."""
        return self.active and self.parallel and self.choice in TOOL_CHOICES

    def repeats(self, text: str) -> bool:
        """Whether the answer so far (cut anywhere) holds a complete call identical to an earlier one."""
        if not self.multiple or not text.startswith(_HEAD):
            return False
        calls = _complete_calls(text)
        return len(_before_repeat(calls)) < len(calls)

    def grammar(self) -> Grammar | None:
        """The answer's grammar: a tool call, or (auto) a tool call or text not starting with '{'."""
        if not self.active:
            return None
        if self.choice != "auto":
            return Grammar.json_schema(self.call_schema(), strict=all(t.strict for t in self.offered))
        return Grammar.lark(
            f"start: calls | TEXT\ncalls: %json {json.dumps(self.call_schema())}\nTEXT: /[^{{](.|\\n)*/\n"
        )

    def parse(self, text: str) -> tuple[str | None, tuple[ToolCall, ...]]:
        """(content, tool calls) of an answer made under grammar(); a text that is no tool call is
        content. An answer cut short (max_tokens, or a repeat) inside its list of calls gives the
        calls it completed; one cut before its first complete call is content. The calls end
        before the first one identical to an earlier call."""
        if not self.active or not text.lstrip().startswith("{"):
            return text, ()
        try:
            found = json.loads(text).get("tool_calls", [])
        except json.JSONDecodeError:  # cut short: the calls completed before the cut
            found = _complete_calls(text)
            if not found:
                return text, ()
        calls = tuple(
            ToolCall(f"call_{uuid.uuid4().hex[:24]}", c["name"], json.dumps(c["arguments"]))
            for c in _before_repeat(found)
        )
        return None, calls


_HEAD = '{"tool_calls": ['  # how the grammar's answer of calls starts


def _before_repeat(calls: list[dict]) -> list[dict]:
    """`calls` up to (not including) the first one equal, name and arguments, to an earlier one."""
    seen: set[str] = set()
    for i, call in enumerate(calls):
        key = json.dumps([call.get("name"), call.get("arguments")], sort_keys=True)
        if key in seen:
            return calls[:i]
        seen.add(key)
    return calls


def _complete_calls(text: str) -> list[dict]:
    """The complete call objects at the start of a cut `{"tool_calls": [call, call, ...` (the
    grammar writes JSON with fixed separators, JSON_OPTIONS)."""
    if not text.startswith(_HEAD):
        return []
    decoder, pos, calls = json.JSONDecoder(), len(_HEAD), []
    while True:
        try:
            call, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return calls
        if not isinstance(call, dict) or not {"name", "arguments"} <= set(call):
            return calls
        calls.append(call)
        if not text.startswith(JSON_OPTIONS["item_separator"], pos):
            return calls
        pos += len(JSON_OPTIONS["item_separator"])


# keys a turn may carry beside 'role', by role (any other role: 'content' only)
TURN_KEYS = {"assistant": {"content", "tool_calls"}, "tool": {"content", "tool_call_id"}}


def _generic_turn(i: int, message: Any) -> dict:
    """Turn i checked, in the generic format: an assistant's tool calls as their JSON, a tool's
    result as a user message naming the call; InvalidArgument names the turn."""
    shape = (
        "{'role': str, 'content': str} (an assistant's may carry tool_calls instead of content, a tool's tool_call_id)"
    )
    if not isinstance(message, Mapping):
        raise InvalidArgument(f"message {i} must be {shape}, got {type(message).__name__}")
    role, content = message.get("role"), message.get("content")
    calls = message.get("tool_calls") if role == "assistant" else None
    if (
        not isinstance(role, str)
        or set(message) - {"role", *TURN_KEYS.get(role, {"content"})}
        or not (isinstance(content, str) or (content is None and calls))
    ):
        raise InvalidArgument(f"message {i} must be {shape}, got keys {sorted(message)}")
    if calls:
        try:
            calls = [
                {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"] or "{}")}
                for c in calls
            ]
        except (KeyError, TypeError, json.JSONDecodeError):
            raise InvalidArgument(
                f"message {i}: tool_calls must be [{{'id', 'type': 'function', 'function': "
                "{'name': str, 'arguments': JSON text}}, ...]"
            ) from None
        return {"role": "assistant", "content": json.dumps({"tool_calls": calls})}
    if role == "tool":
        return {"role": "user", "content": f"Result of tool call {message.get('tool_call_id', '')}: {content}"}
    return {"role": role, "content": content}


__all__ = ["TOOL_CHOICES", "Tool", "ToolCall", "ToolError", "ToolPlan", "parse_tools"]
