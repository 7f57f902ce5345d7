"""tools.ToolPlan on its own: OpenAI tool definitions read and refused, the tool-call schema
checked with jsonschema (an independent validator), the generic turns, answers parsed."""

from __future__ import annotations

import json

import jsonschema
import pytest

pytest.importorskip("llguidance")

from specexport_runtime.errors import InvalidArgument  # noqa: E402
from specexport_runtime.tools import ToolError, ToolPlan  # noqa: E402


def tool(name: str, **properties) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name} tool",
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": sorted(properties),
                "additionalProperties": False,
            },
        },
    }


WEATHER = tool("get_weather", city={"type": "string"})
ADD = tool("add", a={"type": "integer"}, b={"type": "integer"})


def call(name: str, **arguments) -> dict:
    return {"name": name, "arguments": arguments}


def valid(schema: dict, answer: dict) -> bool:
    schema = {k: v for k, v in schema.items() if k != "x-guidance"}  # llguidance's options, not JSON Schema
    try:
        jsonschema.validate(answer, schema)
        return True
    except jsonschema.ValidationError:
        return False


@pytest.mark.parametrize(
    "choice, parallel, calls, ok",
    [
        ("required", True, [call("add", a=1, b=2), call("get_weather", city="Oslo")], True),
        ("required", True, [], False),
        ("required", False, [call("add", a=1, b=2)], True),
        ("required", False, [call("add", a=1, b=2), call("add", a=3, b=4)], False),
        ("auto", False, [call("add", a=1, b=2), call("add", a=3, b=4)], False),
        ("required", True, [call("add", a=1)], False),  # arguments checked against the parameters
        ("required", True, [call("multiply", a=1, b=2)], False),
        ({"type": "function", "function": {"name": "add"}}, True, [call("add", a=1, b=2)], True),
        ({"type": "function", "function": {"name": "add"}}, True, [call("get_weather", city="Oslo")], False),
        ({"type": "function", "function": {"name": "add"}}, True, [call("add", a=1, b=2)] * 2, False),
    ],
)
def test_call_schema_admits_what_the_choice_allows(choice, parallel, calls, ok):
    plan = ToolPlan.create([WEATHER, ADD], choice, False, parallel)
    assert valid(plan.call_schema(), {"tool_calls": calls}) is ok


def test_grammar_kind_follows_the_choice():
    assert ToolPlan.create([WEATHER], "none", False).grammar() is None
    assert ToolPlan.create(None, None, False).grammar() is None
    assert ToolPlan.create([WEATHER], "required", False).grammar().kind == "json_schema"
    assert ToolPlan.create([WEATHER], None, False).grammar().kind == "lark"  # auto: a call or plain text


@pytest.mark.parametrize(
    "tools, choice, parallel, param",
    [
        ([{"function": {"name": "f"}}], None, True, "tools[0]"),
        ([tool("no spaces")], None, True, "tools[0].function.name"),
        ([WEATHER, WEATHER], None, True, "tools[1].function.name"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
            None,
            True,
            "tools[0].function.parameters",
        ),
        ([tool("f", x={"type": "strin"})], None, True, "tools[0].function.parameters"),
        ([WEATHER], "sometimes", True, "tool_choice"),
        ([WEATHER], {"type": "function", "function": {"name": "add"}}, True, "tool_choice.function.name"),
        ([WEATHER], "required", "yes", "parallel_tool_calls"),
    ],
)
def test_bad_tools_name_their_field(tools, choice, parallel, param):
    with pytest.raises(ToolError) as info:
        ToolPlan.create(tools, choice, False, parallel)
    assert info.value.param == param and "\n" not in str(info.value)


def test_generic_turns_and_the_system_message():
    plan = ToolPlan.create([WEATHER, ADD], "required", False)
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "3 C"},
    ]
    out = plan.messages(history)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert (
        out[0]["content"].startswith("Be brief.\n\nYou can call tools.")
        and "You must call a tool." in out[0]["content"]
    )
    assert "- get_weather: get_weather tool" in out[0]["content"] and "- add: add tool" in out[0]["content"]
    assert json.loads(out[2]["content"]) == {"tool_calls": [call("get_weather", city="Oslo")]}
    assert out[3]["content"] == "Result of tool call c1: 3 C"
    native = ToolPlan.create([WEATHER], "required", True)
    assert native.messages(history[1:2]) == history[1:2]  # the template renders the tools
    assert native.template_tools == [WEATHER]
    named = ToolPlan.create([WEATHER, ADD], {"type": "function", "function": {"name": "add"}}, True)
    assert [t["function"]["name"] for t in named.template_tools] == ["add"]  # only the named tool is offered


@pytest.mark.parametrize(
    "message, match",
    [
        ({"role": "user", "content": "hi", "name": "x"}, "message 0 .*'name'"),
        ({"role": "user", "content": 3}, "message 0"),
        ({"role": "user"}, "message 0"),
        ("hi", "message 0 .*got str"),
        ({"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]}, "message 0: tool_calls"),
        (
            {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]},
            "message 0: tool_calls",
        ),
    ],
)
def test_malformed_turns_are_refused(message, match):
    with pytest.raises(InvalidArgument, match=match):
        ToolPlan.create([WEATHER], "required", False).messages([message])


def test_answers_parse_into_calls_or_content():
    plan = ToolPlan.create([WEATHER, ADD], None, False)
    content, calls = plan.parse('{"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]}')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1, "b": 2})]
    assert (
        calls[0].id.startswith("call_")
        and calls[0].id != plan.parse('{"tool_calls": [{"name": "add", "arguments": {}}]}')[1][0].id
    )
    assert plan.parse("It is sunny.") == ("It is sunny.", ())
    assert plan.parse('{"tool_calls": [{"name": "add", "argu') == ('{"tool_calls": [{"name": "add", "argu', ())
    assert ToolPlan.create(None, None, False).parse('{"a": 1}') == ('{"a": 1}', ())  # no tools: all content
