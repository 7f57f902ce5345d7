"""Server pieces without a server: request validation, settings, the `serve` command line."""

from __future__ import annotations

import pytest

from specexport_runtime.errors import InvalidArgument
from specexport_runtime.server import SERVE_EXTRA, missing_serve_extra
from specexport_runtime.server.config import ServerConfig
from specexport_runtime.server.errors import ApiError
from specexport_runtime.server.schemas import parse_chat, parse_completion


def chat(**fields):
    return {"messages": [{"role": "user", "content": "hi"}], **fields}


def error_of(parse, body) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(body)
    return info.value


def test_chat_defaults_follow_openai():
    req = parse_chat(chat())
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed, s.stop, s.proposer, s.gamma) == (
        None,
        1.0,
        1.0,
        0,
        None,
        (),
        None,
        None,
    )
    assert (req.stream, req.include_usage, req.return_token_ids, req.model) == (False, False, False, None)


def test_chat_fields_are_read():
    req = parse_chat(
        chat(
            model="m",
            max_completion_tokens=7,
            max_tokens=7,
            temperature=0,
            top_p=0.5,
            seed=3,
            stop="END",
            stream=True,
            stream_options={"include_usage": True},
            proposer="ngram",
            gamma=2,
            top_k=5,
            n=1,
            logprobs=False,
            presence_penalty=0,
            frequency_penalty=0.0,
            logit_bias={},
            user="u",
            response_format={"type": "text"},
            tools=None,
            return_token_ids=True,
        )
    )
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.seed, s.stop, s.proposer, s.gamma, s.top_k) == (
        7,
        0.0,
        0.5,
        3,
        ("END",),
        "ngram",
        2,
        5,
    )
    assert req.stream and req.include_usage and req.return_token_ids and req.model == "m"
    assert req.max_tokens_param == "max_completion_tokens"


def test_messages_are_normalized():
    req = parse_chat(
        {
            "messages": [
                {"role": "developer", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                    "name": "bob",
                },
            ]
        }
    )
    assert req.messages == ({"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"})


@pytest.mark.parametrize(
    "body, param",
    [
        (chat(max_tokens=5, max_completion_tokens=6), "max_tokens"),
        (chat(n=True), "n"),  # true is not 1
        (chat(logprobs=0), "logprobs"),
        (chat(temperature=True), "temperature"),
        (chat(temperature=2.5), "temperature"),
        (chat(max_tokens=3.5), "max_tokens"),
        (chat(stop=5), "stop"),
        (chat(stream=True, stream_options={"include_usage": "yes"}), "stream_options.include_usage"),
        (chat(stream=True, stream_options={"other": 1}), "stream_options.other"),
        (chat(logprobs=True, top_logprobs=21), "top_logprobs"),
        (chat(response_format={"type": "yaml"}), "response_format"),
        (chat(tools={"type": "function"}), "tools"),
        (chat(model=5), "model"),
        (
            {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]}]},
            "messages[0].tool_calls[0]",
        ),
        ({"messages": [{"role": "tool", "content": "3"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "user", "content": "x", "tool_call_id": "1"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "user", "content": "x", "name": 3}]}, "messages[0].name"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ],
)
def test_chat_rejections_name_the_field(body, param):
    err = error_of(parse_chat, body)
    assert err.status == 400 and err.param == param, err.message


def test_completion_defaults_and_prompt_forms():
    req = parse_completion({"prompt": "abc"})
    assert req.sampling.max_tokens == 16 and req.prompt == "abc"  # OpenAI's default for completions
    assert parse_completion({"prompt": ["abc"]}).prompt == "abc"  # a batch of one
    assert parse_completion({"prompt": [[1, 2, 3]]}).prompt == (1, 2, 3)
    assert parse_completion({"prompt": [4, 5], "max_tokens": 2}).prompt == (4, 5)
    assert error_of(parse_completion, {"prompt": [1, True]}).param == "prompt"
    assert error_of(parse_completion, {"prompt": "a", "best_of": 2}).param == "best_of"
    assert error_of(parse_completion, {"prompt": "a", "suffix": "z"}).param == "suffix"


def test_error_body_is_openai_shaped():
    err = error_of(parse_chat, chat(n=3))
    assert err.body() == {
        "error": {
            "message": err.message,
            "type": "invalid_request_error",
            "param": "n",
            "code": "unsupported_parameter",
        }
    }


@pytest.mark.parametrize(
    "host, key, warns",
    [
        ("127.0.0.1", None, False),
        ("localhost", None, False),
        ("::1", None, False),
        ("127.0.0.2", None, False),
        ("0.0.0.0", None, True),
        ("192.168.1.5", None, True),
        ("myboard.local", None, True),
        ("0.0.0.0", "k", False),
    ],
)
def test_binding_elsewhere_without_a_key_warns(host, key, warns):
    warning = ServerConfig(host=host, api_key=key).exposure_warning()
    assert (warning is not None) == warns
    if warns:
        assert host in warning and "--api-key" in warning


@pytest.mark.parametrize(
    "field, value",
    [
        ("port", 70000),
        ("max_queue", -1),
        ("max_body_bytes", 10),
        ("request_timeout", 0),
        ("drain_seconds", -1.0),
        ("stall_seconds", float("nan")),
        ("api_key", ""),
        ("api_key", " k "),
        ("model_name", ""),
    ],
)
def test_bad_settings_are_one_line_errors(field, value):
    with pytest.raises(InvalidArgument, match=field):
        ServerConfig(**{field: value})


def test_serve_help_lists_every_option(capsys):
    from specexport_runtime.cli import main

    with pytest.raises(SystemExit) as info:
        main(["serve", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for option in (
        "--host",
        "--port",
        "--api-key",
        "--max-queue",
        "--proposer",
        "--threads",
        "--max-body-bytes",
        "--request-timeout",
        "--drain-seconds",
        "--stall-seconds",
        "--model-name",
        "--provider",
    ):
        assert option in out


def test_specexport_serve_passes_through():
    from click.testing import CliRunner

    from specexport.cli.main import cli

    result = CliRunner().invoke(cli, ["serve", "--help"])
    assert result.exit_code == 0 and "--max-queue" in result.output


def test_missing_serve_extra_is_a_one_line_error(monkeypatch, capsys, tmp_path):
    import importlib.util

    from specexport_runtime.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else real(name, *a))
    assert "uvicorn" in missing_serve_extra() and SERVE_EXTRA in missing_serve_extra()
    assert main(["serve", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: ") and "pip install ./runtime[serve]" in err


def test_bad_setting_fails_before_loading(capsys, tmp_path):
    from specexport_runtime.cli import main

    assert main(["serve", str(tmp_path / "missing"), "--max-queue", "-3"]) == 2
    assert "max_queue" in capsys.readouterr().err  # not the missing artifact: settings are checked first
