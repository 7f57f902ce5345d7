"""The shipped prompt sets load and are well formed; bad prompt files fail with a located error."""

from __future__ import annotations

import json

import pytest

from specexport.bench.prompts import (
    CALIBRATION_DIR,
    DEFAULT_MAX_NEW_TOKENS,
    DOMAINS,
    Prompt,
    PromptSetError,
    file_label,
    load_prompts,
)
from specexport_runtime.errors import SpecExportError

# The target (SmolLM2-135M-Instruct) has 2048 tokens of context; prompts stay under
# ~350 tokens. Without a tokenizer here, bound characters (~3 chars/token for code).
MAX_PROMPT_CHARS = 1100
# agentic conversations carry the earlier output they edit, rag prompts their document: longer
LIMITS = {
    "agentic": (2400, 320),
    "rag": (2400, 256),
    "structured_json": (1100, 640),
}  # domain -> (max characters, max max_new_tokens)


def _body(p: Prompt) -> str:
    return p.text if p.text is not None else "\n".join(c for _, c in p.messages)


@pytest.mark.parametrize("domain", DOMAINS)
def test_domain_set_loads(domain):
    prompts = load_prompts(domain)
    assert len(prompts) >= 25
    assert {p.domain for p in prompts} == {domain}
    for p in prompts:
        assert p.id.startswith(domain + "-"), p.id
        chars, new = LIMITS.get(domain, (MAX_PROMPT_CHARS, 256))
        assert 64 <= p.max_new_tokens <= new, p.id
        assert len(_body(p)) <= chars, p.id
        if p.is_chat:
            assert p.chat()[-1]["role"] == "user"


def test_all_loads_every_domain_with_unique_ids():
    prompts = load_prompts("all")
    assert [p.domain for p in prompts] == sorted((p.domain for p in prompts), key=DOMAINS.index)
    assert {p.domain for p in prompts} == set(DOMAINS)
    ids = [p.id for p in prompts]
    assert len(ids) == len(set(ids))
    assert len(prompts) == sum(len(load_prompts(d)) for d in DOMAINS)


def test_load_by_path_equals_load_by_name():
    assert load_prompts(CALIBRATION_DIR / "chat.jsonl") == load_prompts("chat")
    assert load_prompts(str(CALIBRATION_DIR / "chat.jsonl")) == load_prompts("chat")


def test_copy_edit_prompts_carry_an_input_block():
    for p in load_prompts("copy_edit"):
        body = _body(p)
        instruction, sep, block = body.partition("\n\n")
        assert sep, f"{p.id}: no blank line between instruction and input"
        assert len(block) >= 300, f"{p.id}: input block has {len(block)} chars"


@pytest.mark.parametrize("domain", ["code", "creative"])
def test_code_and_creative_include_raw_text_prompts(domain):
    raw = [p for p in load_prompts(domain) if not p.is_chat]
    assert len(raw) >= 3
    with pytest.raises(PromptSetError):
        raw[0].chat()


def test_error_class_hierarchy():
    assert issubclass(PromptSetError, SpecExportError)
    assert issubclass(PromptSetError, ValueError)


# ---- bad input -------------------------------------------------------------------------

GOOD = {"id": "chat-001", "domain": "chat", "messages": [{"role": "user", "content": "Hi?"}], "max_new_tokens": 64}


def _with(**changes):
    rec = dict(GOOD)
    for k, v in changes.items():
        if v is _DROP:
            rec.pop(k)
        else:
            rec[k] = v
    return json.dumps(rec)


_DROP = object()
GOOD_LINE = json.dumps(GOOD)
GOOD_LINE_2 = _with(id="chat-002")

BAD_CASES = {
    # name: (second line of the file, field named in the error or None, text in message)
    "bad_json": ('{"id": "chat-002", "domain": "chat",', None, "invalid JSON"),
    "not_object": ('["chat-002"]', None, "JSON object"),
    "unknown_key": (_with(id="chat-002", temperature=0.7), "temperature", "unknown key"),
    "missing_messages_and_text": (
        _with(id="chat-002", messages=_DROP),
        "messages",
        ("exactly one of 'messages', 'prompt' and 'text' is required (keys found: id, domain, max_new_tokens)"),
    ),
    "nothing_but_the_prompt_missing": ("{}", "messages", "(keys found: none)"),
    "both_messages_and_text": (
        _with(id="chat-002", text="x"),
        "text",
        "keys found: id, domain, messages, max_new_tokens, text",
    ),
    "both_messages_and_prompt": (_with(id="chat-002", prompt="x"), "prompt", "exactly one"),
    "both_prompt_and_text": (_with(id="chat-002", messages=_DROP, prompt="x", text="y"), "text", "exactly one"),
    "all_three": (_with(id="chat-002", prompt="x", text="y"), "text", "exactly one"),
    "empty_prompt": (_with(id="chat-002", messages=_DROP, prompt=" "), "prompt", "non-empty"),
    "prompt_not_string": (
        _with(id="chat-002", messages=_DROP, prompt=["a", "b"]),
        "prompt",
        "must be a non-empty string, got ['a', 'b']",
    ),
    "messages_not_list": (
        _with(id="chat-002", messages="Hi?"),
        "messages",
        "non-empty list of {role, content} objects, got 'Hi?'",
    ),
    "message_not_object": (
        _with(id="chat-002", messages=["Hi?"]),
        "messages[0]",
        "must be a {role, content} object, got str",
    ),
    "message_missing_content": (_with(id="chat-002", messages=[{"role": "user"}]), "messages[0].content", "missing"),
    "message_content_parts": (
        _with(id="chat-002", messages=[{"role": "user", "content": [{"type": "text", "text": "x"}]}]),
        "messages[0].content",
        "non-empty string",
    ),
    "id_with_space": (_with(id="chat 002"), "id", "without whitespace, got 'chat 002'"),
    "long_value_cut": (_with(id="chat-002", domain="x" * 500), "domain", "..."),
    "unknown_domain": (_with(id="chat-002", domain="poetry"), "domain", "must be one of"),
    "duplicate_id": (_with(), "id", "duplicate id 'chat-001'"),
    "max_new_tokens_zero": (_with(id="chat-002", max_new_tokens=0), "max_new_tokens", "1..4096"),
    "max_new_tokens_big": (_with(id="chat-002", max_new_tokens=4097), "max_new_tokens", "1..4096"),
    "max_new_tokens_str": (_with(id="chat-002", max_new_tokens="64"), "max_new_tokens", "integer"),
    "max_new_tokens_bool": (_with(id="chat-002", max_new_tokens=True), "max_new_tokens", "integer"),
    "id_not_string": (_with(id=7), "id", "non-empty string"),
    "empty_messages": (_with(id="chat-002", messages=[]), "messages", "non-empty list"),
    "bad_role": (
        _with(id="chat-002", messages=[{"role": "bot", "content": "x"}]),
        "messages[0].role",
        "must be one of",
    ),
    "empty_content": (
        _with(id="chat-002", messages=[{"role": "user", "content": " "}]),
        "messages[0].content",
        "non-empty",
    ),
    "message_unknown_key": (
        _with(id="chat-002", messages=[{"role": "user", "content": "x", "name": "a"}]),
        "messages[0].name",
        "unknown key",
    ),
    "last_not_user": (
        _with(id="chat-002", messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]),
        "messages[1].role",
        "last message",
    ),
    "empty_text": (_with(id="chat-002", messages=_DROP, text=""), "text", "non-empty"),
    "schema_not_object": (_with(id="chat-002", schema=[1]), "schema", "JSON Schema object"),
    "schema_and_tools": (
        _with(id="chat-002", schema={"type": "object"}, tools=[{"type": "function"}]),
        "tools",
        "not both",
    ),
    "tool_choice_without_tools": (_with(id="chat-002", tool_choice="required"), "tool_choice", "needs tools"),
    "parallel_without_tools": (_with(id="chat-002", parallel_tool_calls=False), "parallel_tool_calls", "needs tools"),
    "parallel_not_bool": (
        _with(id="chat-002", tools=[{"type": "function"}], parallel_tool_calls="no"),
        "parallel_tool_calls",
        "true or false",
    ),
    "schema_on_raw_text": (
        _with(id="chat-002", messages=_DROP, text="x", schema={"type": "object"}),
        "schema",
        "chat messages",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_line_names_file_line_and_field(tmp_path, case):
    bad_line, field, fragment = BAD_CASES[case]
    path = tmp_path / "set.jsonl"
    path.write_text(GOOD_LINE + "\n" + bad_line + "\n" + GOOD_LINE_2 + "\n", encoding="utf-8")
    with pytest.raises(PromptSetError) as info:
        load_prompts(path)
    err = info.value
    assert err.path == path and err.line == 2 and err.field == field
    msg = str(err)
    assert "\n" not in msg and len(msg) < len(str(path)) + 200, msg
    assert msg.startswith(f"{path}:2: ")
    assert fragment in msg
    if field is not None:
        assert f"field {field!r}" in msg


def test_blank_lines_are_skipped_and_line_numbers_kept(tmp_path):
    path = tmp_path / "set.jsonl"
    path.write_text(GOOD_LINE + "\n\n" + _with(id="chat-002", max_new_tokens=0) + "\n")
    with pytest.raises(PromptSetError) as info:
        load_prompts(path)
    assert info.value.line == 3


def test_raw_text_prompt_loads(tmp_path):
    path = tmp_path / "set.jsonl"
    path.write_text(_with(id="code-001", domain="code", messages=_DROP, text="def f():\n"))
    [p] = load_prompts(path)
    assert p == Prompt("code-001", "code", None, "def f():\n", 64)
    assert not p.is_chat


def test_wrong_domain_in_named_set(tmp_path, monkeypatch):
    monkeypatch.setattr("specexport.bench.prompts.CALIBRATION_DIR", tmp_path)
    (tmp_path / "code.jsonl").write_text(GOOD_LINE + "\n")
    with pytest.raises(PromptSetError) as info:
        load_prompts("code")
    assert info.value.line == 1 and info.value.field == "domain"
    assert "'chat' in the 'code' prompt set" in str(info.value)


def test_duplicate_id_across_sets(tmp_path, monkeypatch):
    monkeypatch.setattr("specexport.bench.prompts.CALIBRATION_DIR", tmp_path)
    for d in DOMAINS:
        (tmp_path / f"{d}.jsonl").write_text(_with(id=f"{d}-001", domain=d) + "\n")
    (tmp_path / "creative.jsonl").write_text(
        _with(id="creative-001", domain="creative") + "\n" + _with(id="code-001", domain="creative") + "\n"
    )
    with pytest.raises(PromptSetError) as info:
        load_prompts("all")
    err = info.value
    assert err.path == tmp_path / "creative.jsonl" and err.line == 2 and err.field == "id"
    assert f"{tmp_path / 'code.jsonl'}:1" in str(err)


def test_empty_file(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(PromptSetError, match="no prompts"):
        load_prompts(path)


def test_invalid_utf8_names_line(tmp_path):
    path = tmp_path / "set.jsonl"
    path.write_bytes(GOOD_LINE.encode() + b"\n" + b'{"id": "\xff"}\n')
    with pytest.raises(PromptSetError, match="UTF-8") as info:
        load_prompts(path)
    assert info.value.line == 2


@pytest.mark.parametrize("spec", ["poetry", "nope/missing.jsonl", "nope/missing.txt"])
def test_unknown_spec(spec):
    with pytest.raises(PromptSetError, match="not a domain name"):
        load_prompts(spec)


def test_prompt_needs_exactly_one_of_messages_and_text():
    with pytest.raises(PromptSetError):
        Prompt("x-1", "chat", None, None, 64)
    with pytest.raises(PromptSetError):
        Prompt("x-1", "chat", (("user", "hi"),), "hi", 64)


# ---- the shipped sets are read exactly as their lines say -------------------------------


@pytest.mark.parametrize("domain", DOMAINS)
def test_shipped_sets_load_exactly_as_written(domain):
    """Every field of every shipped prompt is the line's own value (no default fills in)."""
    expected = []
    for line in (CALIBRATION_DIR / f"{domain}.jsonl").read_text(encoding="utf-8").split("\n"):
        if not line.strip():
            continue
        rec = json.loads(line)
        constraint = set(rec) & {"schema", "tools", "tool_choice", "parallel_tool_calls"}
        assert set(rec) - constraint in (
            {"id", "domain", "messages", "max_new_tokens"},
            {"id", "domain", "text", "max_new_tokens"},
        ), rec.get("id")
        msgs = tuple((m["role"], m["content"]) for m in rec["messages"]) if "messages" in rec else None
        tools = tuple(rec["tools"]) if "tools" in rec else None
        expected.append(
            Prompt(
                rec["id"],
                rec["domain"],
                msgs,
                rec.get("text"),
                rec["max_new_tokens"],
                rec.get("schema"),
                tools,
                rec.get("tool_choice"),
                rec.get("parallel_tool_calls", True),
            )
        )
    loaded = load_prompts(domain)
    assert loaded == expected
    # the constraint fields are left out of equality: compare them apart
    constraints = [(p.schema, p.tools, p.tool_choice, p.parallel_tool_calls) for p in expected]
    assert [(p.schema, p.tools, p.tool_choice, p.parallel_tool_calls) for p in loaded] == constraints
    assert load_prompts(CALIBRATION_DIR / f"{domain}.jsonl") == expected
    # a caller's default for missing max_new_tokens changes nothing here
    assert load_prompts(domain, max_new_tokens=7) == expected


# ---- the prompt files users already have ------------------------------------------------


def _write(path, lines):
    path.write_text(
        "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines), encoding="utf-8"
    )
    return path


def test_openai_messages_lines_need_nothing_else(tmp_path):
    path = _write(
        tmp_path / "support chats.jsonl",
        [
            {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]},
            "",
            {"messages": [{"role": "user", "content": "Bye?"}]},
        ],
    )
    assert load_prompts(path) == [
        Prompt(
            "support_chats-1", "support_chats", (("system", "Be brief."), ("user", "Hi?")), None, DEFAULT_MAX_NEW_TOKENS
        ),
        Prompt("support_chats-3", "support_chats", (("user", "Bye?"),), None, DEFAULT_MAX_NEW_TOKENS),
    ]
    assert DEFAULT_MAX_NEW_TOKENS == 128


@pytest.mark.parametrize("key", ["prompt", "text"])
def test_prompt_and_text_are_raw_text(tmp_path, key):
    path = _write(tmp_path / "completions.jsonl", [{key: "def f():\n"}, {key: "x = 1", "id": "mine"}])
    assert load_prompts(path) == [
        Prompt("completions-1", "completions", None, "def f():\n", DEFAULT_MAX_NEW_TOKENS),
        Prompt("mine", "completions", None, "x = 1", DEFAULT_MAX_NEW_TOKENS),
    ]
    assert not load_prompts(path)[0].is_chat


def test_given_fields_are_kept_and_mixed_with_defaults(tmp_path):
    path = _write(
        tmp_path / "mixed.jsonl",
        [
            {"id": "a", "domain": "code", "prompt": "p", "max_new_tokens": 9},
            {"domain": "chat", "messages": [{"role": "user", "content": "m"}]},
            {"id": "c", "text": "t", "max_new_tokens": 300},
        ],
    )
    assert load_prompts(path) == [
        Prompt("a", "code", None, "p", 9),
        Prompt("mixed-2", "chat", (("user", "m"),), None, DEFAULT_MAX_NEW_TOKENS),
        Prompt("c", "mixed", None, "t", 300),
    ]


def test_max_new_tokens_default_fills_in_only_missing_values(tmp_path):
    path = _write(tmp_path / "set.jsonl", [{"prompt": "a"}, {"prompt": "b", "max_new_tokens": 40}])
    assert [p.max_new_tokens for p in load_prompts(path, max_new_tokens=16)] == [16, 40]
    assert [p.max_new_tokens for p in load_prompts(path)] == [DEFAULT_MAX_NEW_TOKENS, 40]
    txt = _write(tmp_path / "set.txt", ["a", "b"])
    assert [p.max_new_tokens for p in load_prompts(txt, max_new_tokens=16)] == [16, 16]


@pytest.mark.parametrize("bad", [0, 4097, "64", True, 2.5])
def test_bad_max_new_tokens_default(tmp_path, bad):
    path = _write(tmp_path / "set.jsonl", [{"prompt": "a"}])
    with pytest.raises(PromptSetError) as info:
        load_prompts(path, max_new_tokens=bad)
    assert info.value.field == "max_new_tokens"
    assert "1..4096" in str(info.value) and repr(bad) in str(info.value)


def test_plain_text_file_is_one_prompt_per_line(tmp_path):
    path = tmp_path / "My Prompts.v2.txt"
    path.write_text('  Write a haiku about rain.  \n\nSummarize: {"a": 1}\r\n\t\nlast line', encoding="utf-8")
    assert load_prompts(path) == [
        Prompt("my_prompts_v2-1", "my_prompts_v2", None, "Write a haiku about rain.", DEFAULT_MAX_NEW_TOKENS),
        Prompt("my_prompts_v2-3", "my_prompts_v2", None, 'Summarize: {"a": 1}', DEFAULT_MAX_NEW_TOKENS),
        Prompt("my_prompts_v2-5", "my_prompts_v2", None, "last line", DEFAULT_MAX_NEW_TOKENS),
    ]


@pytest.mark.parametrize("name", ["questions", "questions.md", "questions.csv"])
def test_any_other_suffix_is_plain_text(tmp_path, name):
    path = tmp_path / name
    path.write_text('{"prompt": "not parsed"}\nsecond\n', encoding="utf-8")
    prompts = load_prompts(path)
    assert [p.text for p in prompts] == ['{"prompt": "not parsed"}', "second"]
    assert {p.domain for p in prompts} == {"questions"}


@pytest.mark.parametrize("name", ["set.json", "set.ndjson", "SET.JSONL"])
def test_json_suffixes_are_jsonl(tmp_path, name):
    path = _write(tmp_path / name, [{"prompt": "a"}])
    assert [p.text for p in load_prompts(path)] == ["a"]


def test_byte_order_mark_is_ignored(tmp_path):
    path = tmp_path / "set.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"prompt": "a"}).encode() + b"\n")
    assert [p.text for p in load_prompts(path)] == ["a"]


def test_stem_that_is_a_domain_is_that_domain(tmp_path):
    assert {p.domain for p in load_prompts(_write(tmp_path / "code.txt", ["def f():"]))} == {"code"}


def test_missing_domain_in_a_named_set_is_the_sets_domain(tmp_path, monkeypatch):
    monkeypatch.setattr("specexport.bench.prompts.CALIBRATION_DIR", tmp_path)
    _write(tmp_path / "structured.jsonl", [{"id": "s-1", "prompt": "a", "max_new_tokens": 8}])
    assert load_prompts("structured") == [Prompt("s-1", "structured", None, "a", 8)]


@pytest.mark.parametrize(
    "stem, label",
    [
        ("chat", "chat"),
        ("My Prompts", "my_prompts"),
        ("a--b..c", "a_b_c"),
        ("__x__", "x"),
        ("été", "t"),
        ("???", "prompts"),
    ],
)
def test_file_label(stem, label):
    assert file_label(f"/some/dir/{stem}.jsonl") == label


def test_default_id_colliding_with_a_given_id_is_a_duplicate(tmp_path):
    path = _write(tmp_path / "set.jsonl", [{"id": "set-2", "prompt": "a"}, {"prompt": "b"}])
    with pytest.raises(PromptSetError, match="duplicate id 'set-2'") as info:
        load_prompts(path)
    assert info.value.line == 2 and info.value.field == "id"


def test_empty_text_file(tmp_path):
    path = tmp_path / "empty.txt"
    path.write_text(" \n\n\t\n")
    with pytest.raises(PromptSetError, match="no prompts"):
        load_prompts(path)


def test_bench_reads_a_text_file_and_its_max_new_tokens_flag(tiny_artifacts, tmp_path):
    """The bench takes a plain text file and an OpenAI-shaped JSONL file, and
    --max-new-tokens sets every prompt's length."""
    from click.testing import CliRunner

    from specexport.cli.bench import bench as bench_cmd

    txt = _write(tmp_path / "lines.txt", ["def add(a, b):", "The quick brown fox"])
    chats = _write(tmp_path / "chats.jsonl", [{"messages": [{"role": "user", "content": "Hello"}]}])
    out = tmp_path / "r.json"
    result = CliRunner().invoke(
        bench_cmd,
        [
            str(tiny_artifacts["self"]),
            "--prompts",
            f"{txt},{chats}",
            "--gamma",
            "2",
            "--repeats",
            "1",
            "--max-new-tokens",
            "5",
            "--json",
            str(out),
            "--quiet",
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["meta"]["domains"] == {"lines": 2, "chats": 1}
    runs = data["runs"]
    assert {r["prompt_id"] for r in runs} == {"lines-1", "lines-2", "chats-1"}
    assert all(r["new_tokens"] <= 5 for r in runs)
    assert any(r["new_tokens"] == 5 for r in runs)
