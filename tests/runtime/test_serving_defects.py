"""Smaller defects a new user meets (issue 48): each test failed on the code before its fix."""

from __future__ import annotations

import json

import numpy as np
import pytest
from exactness_support import fixture_gens  # noqa: F401 (this module's `gens` fixture)

from specexport_runtime.api import load
from specexport_runtime.cli import main
from specexport_runtime.errors import InvalidArgument
from specexport_runtime.penalties import check_penalty, repetition_rows
from specexport_runtime.sampling import SamplingParams, probabilities


def test_serve_max_batch_on_a_batch_1_artifact_names_the_rebuild(tiny_artifacts, capsys):
    """`serve --max-batch 4` on an artifact without a batch graph: one line naming the command that
    rebuilds it with 4 slots, before the artifact is loaded; the API's batch=True says the same."""
    root = tiny_artifacts["noisy-fused"]
    capsys.readouterr()  # the fixture's build output
    assert main(["serve", str(root), "--max-batch", "4", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"specexport build {root / 'recipe.json'} --max-batch 4 -o " in err and "max_batch 1" in err
    with pytest.raises(InvalidArgument, match=r"specexport build .*recipe\.json --max-batch"):
        load(root, batch=True)


# --- min_p and repetition_penalty: applied to the target's rows before verification ------------


def test_min_p_keeps_tokens_with_at_least_min_p_times_the_top_probability():
    """Against a hand computation on one row (softmax, cut, renormalize), on both paths of
    `probabilities` (top-k fast path and full row)."""
    logits = np.log(np.array([[0.5, 0.2, 0.14, 0.1, 0.06]]))
    for top_k in (0, 4):
        p = probabilities(logits, SamplingParams(temperature=1.0, top_k=top_k, min_p=0.25))[0]
        keep = np.array([0.5, 0.2, 0.14, 0, 0])
        np.testing.assert_allclose(p, keep / keep.sum(), rtol=1e-12)
    with pytest.raises(InvalidArgument, match="min_p must be a number in \\[0, 1\\)"):
        SamplingParams(temperature=1.0, min_p=1.0)


def _penalized_by_hand(row: np.ndarray, seen: set[int], r: float) -> np.ndarray:
    out = row.astype(np.float64).copy()
    for t in seen:
        out[t] = out[t] / r if out[t] > 0 else out[t] * r
    return out


def test_repetition_rows_penalize_each_rows_own_context():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 12)).astype(np.float32)
    context, draft = [1, 5, 5, 7], [2, 5, 9]
    got = repetition_rows(logits, context, draft, 1.5)
    for j in range(4):
        expect = _penalized_by_hand(logits[j], set(context) | set(draft[:j]), 1.5)
        np.testing.assert_allclose(got[j], expect, rtol=1e-6)
    np.testing.assert_array_equal(repetition_rows(logits, context, draft, 1.0), logits)
    assert not np.shares_memory(got, logits)
    for bad in (0, -1.0, float("nan"), 11.0, True):
        with pytest.raises(InvalidArgument, match="repetition_penalty must be a number in \\(0, 10\\]"):
            check_penalty(bad)


def _greedy_by_hand(model, prompt: list[int], n: int, r: float, eos: int) -> list[int]:
    """Target-only greedy with the repetition penalty, one token per call, penalty by hand."""
    model.reset()
    seq, out = list(prompt), []
    row = model.forward(seq)[0]
    for _ in range(n):
        token = int(_penalized_by_hand(row, set(seq), r).argmax())
        if token == eos:
            break
        out.append(token)
        seq.append(token)
        row = model.forward([token])[0]
    model.reset()
    return out


@pytest.mark.parametrize("proposer", ["draft", "ngram", "hybrid", "suffix"])
def test_repetition_penalty_is_exact_under_speculation(gens, proposer):
    """Greedy, penalty 1.3: the speculative output equals a hand-penalized target-only run (one
    token per call), and differs from the unpenalized output (the penalty acts)."""
    gen = gens("noisy")
    prompt = gen.codec.encode("for i in range(10):\n    print(i)\nfor i in range(10):")
    (eos,) = gen.eos
    ref = _greedy_by_hand(gen.target, prompt, 40, 1.3, eos)
    out = gen.generate(prompt, max_new_tokens=40, proposer=proposer, gamma=4, repetition_penalty=1.3)
    assert out.token_ids == ref
    assert out.stats.drafted > 0 or proposer in ("ngram", "suffix")  # a penalized answer rarely repeats itself
    plain = gen.generate(prompt, max_new_tokens=40, speculative=False)
    assert plain.token_ids != ref


def test_seeded_sampling_with_min_p_and_penalty_is_the_targets(gens):
    gen = gens("noisy")
    kw = dict(max_new_tokens=40, temperature=1.0, min_p=0.05, repetition_penalty=1.2)
    for seed in (1, 2, 3):
        ref = gen.generate("def add(a, b):", seed=seed, speculative=False, **kw).token_ids
        for proposer in ("draft", "hybrid"):
            assert gen.generate("def add(a, b):", seed=seed, proposer=proposer, **kw).token_ids == ref
    with pytest.raises(InvalidArgument, match="tree_nodes > 0 with a repetition_penalty"):
        gen.configure(tree_nodes=4, repetition_penalty=1.2)


def test_the_server_takes_min_p_and_repetition_penalty(tiny_artifacts):
    pytest.importorskip("uvicorn")
    from test_server_support import KEY, LiveServer, msgs, post

    gen = load(tiny_artifacts["noisy"], threads=1)
    ref = load(tiny_artifacts["noisy"], threads=1)
    srv = LiveServer(gen, api_key=KEY)
    try:
        body = {"model": srv.state.model, "messages": msgs("count to ten"), "max_tokens": 24, "proposer": "draft"}
        body.update(temperature=0.8, seed=5, min_p=0.1, repetition_penalty=1.2)
        status, _, answer = post(srv.port, "/v1/chat/completions", body)
        assert status == 200, answer
        mine = ref.chat(msgs("count to ten"), max_new_tokens=24, temperature=0.8, seed=5, min_p=0.1,
                        repetition_penalty=1.2, speculative=False)  # fmt: skip
        assert answer["choices"][0]["message"]["content"] == mine.text
        for field, value in (("min_p", 1.5), ("repetition_penalty", 0)):
            status, _, err = post(srv.port, "/v1/chat/completions", {**body, field: value})
            assert status == 400 and err["error"]["param"] == field and repr(value) in err["error"]["message"]
    finally:
        srv.close()


# --- a truncated .spx (a failed download) ------------------------------------------------------


def _cut_points(pkg) -> dict[str, int]:
    import tarfile

    with tarfile.open(pkg) as tar:
        members = tar.getmembers()
    big = max(members, key=lambda m: m.size)
    return {
        "inside the manifest's header": 300,
        "at a member boundary": members[2].offset,
        "inside the largest file": big.offset_data + big.size // 2,
    }


def test_a_truncated_package_says_download_again_and_leaves_nothing(tiny_artifacts, tmp_path, capsys):
    from specexport_runtime.package import pack

    full = pack(tiny_artifacts["noisy"], tmp_path / "model.spx")
    data = full.read_bytes()
    capsys.readouterr()
    for where, cut in _cut_points(full).items():
        pkg = tmp_path / f"cut-{cut}.spx"
        pkg.write_bytes(data[:cut])
        into = tmp_path / "device" / "model"
        assert main(["unpack", str(pkg), "--into", str(into)]) == 2, where
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("error: ") and "download it again" in err, (where, err)
        assert str(pkg) in err and "rebuild" not in err and "Traceback" not in err
        assert not into.exists() and not into.with_name("model.versions").exists(), where
    assert main(["unpack", str(full), "--into", str(tmp_path / "device" / "model")]) == 0  # the whole one installs


def test_generate_refuses_max_new_tokens_beyond_the_context(tiny_artifacts, capsys):
    """As the server's 400: one line naming the option, the prompt's tokens and the room left
    (it used to clamp silently); a request that fits still runs."""
    root = str(tiny_artifacts["noisy"])
    capsys.readouterr()
    assert main(["generate", root, "--prompt", "hello world", "--max-new-tokens", "5000"]) == 2
    err = capsys.readouterr().err.strip()
    n = len(load(root).codec.encode("hello world"))
    assert err == (
        f"error: --max-new-tokens 5000 + the prompt's {n} tokens exceed this model's context of 256 tokens"
        f" (at most {256 - n} new tokens fit)"
    )
    assert main(["generate", root, "--prompt", "hello world", "--max-new-tokens", str(256 - n), "--json"]) == 0


# --- regex patterns whose counted repetitions explode ------------------------------------------


def test_regex_expansion_estimate():
    from specexport_runtime.regex_size import MAX_EXPANSION, expansion, schema_patterns

    assert expansion("^a{1000}{1000}$") == 1_000_000  # the pattern: counts in a row multiply
    assert expansion("(ab{50}){50}c{20}") == (1 + 50) * 50 + 20
    assert expansion("[a-z]{3,8}@x\\.com") == 8 + 6 and expansion("(?:ab|cd){2,5}") == 20
    assert expansion("a+b*c?") == 3 and expansion("a{10,}") == 10 and expansion("[{]}{2}") == 3
    schema = {"type": "object", "properties": {"pattern": {"type": "string", "pattern": "x{3}"}},
              "patternProperties": {"^k{2}$": {"pattern": "y"}}}  # fmt: skip
    assert sorted(schema_patterns(schema)) == ["^k{2}$", "x{3}", "y"]
    assert expansion(f"a{{{MAX_EXPANSION}}}") == MAX_EXPANSION


def test_an_exploding_pattern_is_a_400_before_streaming(tiny_artifacts):
    """The issue's schema pattern `^a{1000}{1000}$`: refused when the grammar is built (API) and
    with a 400 naming response_format before any stream starts (server), one line, no parser
    state; a pattern of ordinary size still streams."""
    pytest.importorskip("llguidance")
    pytest.importorskip("uvicorn")
    from test_server_support import KEY, LiveServer, SseStream, msgs

    from specexport_runtime.structured import Grammar, GrammarError

    bad = {"type": "string", "pattern": "^a{1000}{1000}$"}
    with pytest.raises(GrammarError, match="expands to about 1,000,000 positions"):
        Grammar.json_schema(bad)
    with pytest.raises(GrammarError, match="limit is 20,000"):
        Grammar.regex("a{1000}{1000}")
    gen = load(tiny_artifacts["ngram"], threads=1)
    srv = LiveServer(gen, api_key=KEY)
    try:
        for schema, ok in ((bad, False), ({"type": "string", "pattern": "^[a-z]{2,8}$"}, True)):
            fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}}
            body = {"model": srv.state.model, "messages": msgs("hi"), "max_tokens": 4, "stream": True}
            stream = SseStream(srv.port, "/v1/chat/completions", {**body, "response_format": fmt}, key=KEY)
            if ok:
                assert stream.resp.status == 200
                stream.events()
                continue
            assert stream.resp.status == 400
            err = json.loads(stream.resp.read())["error"]
            assert err["param"] == "response_format" and "1,000,000" in err["message"]
            assert "\n" not in err["message"] and "<state>" not in err["message"]
    finally:
        srv.close()


def test_a_stalled_upload_gets_408_and_the_connection_closes(tiny_artifacts):
    """Headers sent, the body never completed: 408 `request_timeout` after --body-seconds (it used to
    be held open with no limit), then the server closes the connection; the server goes on."""
    pytest.importorskip("uvicorn")
    import socket
    import time

    from test_server_support import LiveServer, get

    srv = LiveServer(load(tiny_artifacts["noisy"], threads=1), body_seconds=0.5)
    try:
        sock = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        sock.sendall(head + b"Content-Length: 100\r\n\r\n{")
        start = time.monotonic()
        data = b""
        while chunk := sock.recv(65536):  # until the server closes
            data += chunk
        waited = time.monotonic() - start
        sock.close()
        status, _, body = data.partition(b"\r\n\r\n")
        assert status.startswith(b"HTTP/1.1 408") and b"connection: close" in status.lower()
        assert json.loads(body)["error"]["code"] == "request_timeout" and 0.4 < waited < 5
        assert get(srv.port, "/health", key=None)[0] == 200
    finally:
        srv.close()


# --- tool calls cut by max_tokens ---------------------------------------------------------------


def test_calls_cut_by_max_tokens_come_back_as_the_completed_calls():
    """tool_choice 'required' with parallel calls: a model that repeats calls until max_tokens used to
    get its whole answer back as content; now the calls it completed are tool_calls and the
    finish reason says 'length'. A cut before the first complete call stays content."""
    from specexport_runtime.generator import GenerationStats
    from specexport_runtime.server.responses import Outcome, Renderer
    from specexport_runtime.tools import ToolPlan

    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}}}}]  # fmt: skip
    plan = ToolPlan.create(tools, "required", True, True)
    call = '{"name": "get_time", "arguments": {"city": "Oslo"}}'
    other = '{"name": "get_time", "arguments": {"city": "Bergen"}}'  # distinct: a repeat would end the calls
    cut = '{"tool_calls": [' + call + ", " + other + ', {"name": "get_ti'
    content, calls = plan.parse(cut)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_time", {"city": "Oslo"}),
        ("get_time", {"city": "Bergen"}),
    ]
    assert plan.parse('{"tool_calls": [{"name": "get_ti') == ('{"tool_calls": [{"name": "get_ti', ())
    whole = '{"tool_calls": [' + call + "]}"
    assert len(plan.parse(whole)[1]) == 1
    renderer = Renderer("chat", "m", plan=plan)
    body = renderer.completion(cut, [], Outcome("length", GenerationStats(), "none", "off", None, 0.0, None))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["message"]["tool_calls"]) == 2
    body = renderer.completion(whole, [], Outcome("eos", GenerationStats(), "none", "off", None, 0.0, None))
    assert body["choices"][0]["finish_reason"] == "tool_calls"
