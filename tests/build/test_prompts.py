"""The shipped prompt sets load and are well formed; bad prompt files fail with a located error."""

from __future__ import annotations

import json

import pytest

from specexport.prompts import (
    CALIBRATION_DIR,
    DOMAINS,
    Prompt,
    PromptSetError,
    load_prompts,
)
from specexport_runtime.errors import SpecExportError

# The target (SmolLM2-135M-Instruct) has 2048 tokens of context; prompts stay under
# ~350 tokens. Without a tokenizer here, bound characters (~3 chars/token for code).
MAX_PROMPT_CHARS = 1100


def _body(p: Prompt) -> str:
    return p.text if p.text is not None else "\n".join(c for _, c in p.messages)


@pytest.mark.parametrize("domain", DOMAINS)
def test_domain_set_loads(domain):
    prompts = load_prompts(domain)
    assert len(prompts) >= 25
    assert {p.domain for p in prompts} == {domain}
    for p in prompts:
        assert p.id.startswith(domain + "-"), p.id
        assert 64 <= p.max_new_tokens <= 256, p.id
        assert len(_body(p)) <= MAX_PROMPT_CHARS, p.id
        if p.is_chat:
            assert p.chat()[-1]["role"] == "user"


def test_all_loads_every_domain_with_unique_ids():
    prompts = load_prompts("all")
    assert [p.domain for p in prompts] == sorted(
        (p.domain for p in prompts), key=DOMAINS.index)
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

GOOD = {"id": "chat-001", "domain": "chat",
        "messages": [{"role": "user", "content": "Hi?"}], "max_new_tokens": 64}


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
    "missing_id": (_with(id=_DROP), "id", "missing"),
    "missing_domain": (_with(id="chat-002", domain=_DROP), "domain", "missing"),
    "missing_max_new_tokens": (
        _with(id="chat-002", max_new_tokens=_DROP), "max_new_tokens", "missing"),
    "missing_messages_and_text": (_with(id="chat-002", messages=_DROP), "messages", "exactly one"),
    "both_messages_and_text": (_with(id="chat-002", text="x"), "text", "exactly one"),
    "unknown_domain": (_with(id="chat-002", domain="poetry"), "domain", "must be one of"),
    "duplicate_id": (_with(), "id", "duplicate id 'chat-001'"),
    "max_new_tokens_zero": (_with(id="chat-002", max_new_tokens=0), "max_new_tokens", "1..4096"),
    "max_new_tokens_big": (
        _with(id="chat-002", max_new_tokens=4097), "max_new_tokens", "1..4096"),
    "max_new_tokens_str": (
        _with(id="chat-002", max_new_tokens="64"), "max_new_tokens", "integer"),
    "max_new_tokens_bool": (
        _with(id="chat-002", max_new_tokens=True), "max_new_tokens", "integer"),
    "id_not_string": (_with(id=7), "id", "non-empty string"),
    "empty_messages": (_with(id="chat-002", messages=[]), "messages", "non-empty list"),
    "bad_role": (_with(id="chat-002", messages=[{"role": "bot", "content": "x"}]),
                 "messages[0].role", "must be one of"),
    "empty_content": (_with(id="chat-002", messages=[{"role": "user", "content": " "}]),
                      "messages[0].content", "non-empty"),
    "message_unknown_key": (
        _with(id="chat-002", messages=[{"role": "user", "content": "x", "name": "a"}]),
        "messages[0].name", "unknown key"),
    "last_not_user": (
        _with(id="chat-002", messages=[{"role": "user", "content": "x"},
                                       {"role": "assistant", "content": "y"}]),
        "messages[1].role", "last message"),
    "empty_text": (_with(id="chat-002", messages=_DROP, text=""), "text", "non-empty"),
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
    monkeypatch.setattr("specexport.prompts.CALIBRATION_DIR", tmp_path)
    (tmp_path / "code.jsonl").write_text(GOOD_LINE + "\n")
    with pytest.raises(PromptSetError) as info:
        load_prompts("code")
    assert info.value.line == 1 and info.value.field == "domain"
    assert "'chat' in the 'code' prompt set" in str(info.value)


def test_duplicate_id_across_sets(tmp_path, monkeypatch):
    monkeypatch.setattr("specexport.prompts.CALIBRATION_DIR", tmp_path)
    for d in DOMAINS:
        (tmp_path / f"{d}.jsonl").write_text(_with(id=f"{d}-001", domain=d) + "\n")
    (tmp_path / "creative.jsonl").write_text(
        _with(id="creative-001", domain="creative") + "\n"
        + _with(id="code-001", domain="creative") + "\n")
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


@pytest.mark.parametrize("spec", ["poetry", "nope/missing.jsonl"])
def test_unknown_spec(spec):
    with pytest.raises(PromptSetError, match="not a domain name"):
        load_prompts(spec)


def test_prompt_needs_exactly_one_of_messages_and_text():
    with pytest.raises(PromptSetError):
        Prompt("x-1", "chat", None, None, 64)
    with pytest.raises(PromptSetError):
        Prompt("x-1", "chat", (("user", "hi"),), "hi", 64)
