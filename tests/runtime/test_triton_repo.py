"""`specexport triton-repo`: the model repository's config.pbtxt parses as Triton's ModelConfig, and
its model.py, run against a stand-in `triton_python_backend_utils` (tests/triton_stub) the way the
Python backend runs it (initialize with the JSON model config, execute with decoupled senders),
streams exactly the tokens of in-process generation. The end-to-end run through a real Triton
server is test_triton_server.py."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from click.testing import CliRunner

pytest.importorskip("tritonclient")
from google.protobuf import json_format, text_format  # noqa: E402
from tritonclient.grpc import model_config_pb2  # noqa: E402

from specexport.cli.main import cli  # noqa: E402
from specexport_runtime.api import load  # noqa: E402
from specexport_runtime.errors import ChecksumError, InvalidArgument  # noqa: E402
from specexport_runtime.generator import Generation  # noqa: E402
from specexport_runtime.package import pack  # noqa: E402
from specexport_runtime.signing import SignatureError, keygen, sign  # noqa: E402
from specexport_runtime.triton.repo import RepoSettings, write_repository  # noqa: E402

STUB = Path(__file__).parents[1] / "triton_stub"
KIND = "int8"
PROMPT = "The quick brown fox"


def parsed_config(repo: Path, name: str):
    return text_format.Parse((repo / name / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())


@pytest.fixture()
def backend(monkeypatch):
    """Loads a repository's model.py with the stand-in utils module; returns (load_model, pb_utils)."""
    monkeypatch.syspath_prepend(str(STUB))
    monkeypatch.delitem(sys.modules, "triton_python_backend_utils", raising=False)
    import triton_python_backend_utils as pb_utils

    def load_model(repo: Path, name: str):
        spec = importlib.util.spec_from_file_location(f"triton_model_{name}", repo / name / "1" / "model.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        model = module.TritonPythonModel()
        config = json_format.MessageToDict(
            parsed_config(repo, name), preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
        model.initialize(
            {
                "model_config": json.dumps(config),
                "model_instance_kind": "CPU",
                "model_instance_name": f"{name}_0_0",
                "model_repository": str(repo / name),
                "model_version": "1",
                "model_name": name,
            }
        )
        return model

    yield load_model, pb_utils
    sys.modules.pop("triton_python_backend_utils", None)


@pytest.fixture(scope="module")
def repo(tiny_artifacts, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("triton") / "models"
    write_repository(tiny_artifacts[KIND], out, RepoSettings(name="tiny", threads=1))
    return out


@pytest.fixture(scope="module")
def ref(tiny_artifacts):
    return load(tiny_artifacts[KIND], threads=1)


def request(pb_utils, text: str | None = PROMPT, **inputs):
    if text is not None:
        inputs["text_input"] = np.array([text.encode()], dtype=np.object_)
    return pb_utils.FakeRequest(**inputs)


def outputs(response) -> dict:
    return {t.name(): t.as_numpy() for t in response.output_tensors()}


def test_config_pbtxt_parses_as_tritons_model_config(repo):
    config = parsed_config(repo, "tiny")
    assert (config.name, config.backend, config.max_batch_size) == ("tiny", "python", 0)
    assert config.model_transaction_policy.decoupled
    inputs = {i.name: (model_config_pb2.DataType.Name(i.data_type), list(i.dims), i.optional) for i in config.input}
    assert inputs["text_input"] == ("TYPE_STRING", [1], False)
    assert inputs["max_tokens"] == ("TYPE_INT32", [1], True) and inputs["stream"] == ("TYPE_BOOL", [1], True)
    names = [o.name for o in config.output]
    assert names[:3] == ["text_output", "token_ids", "finish_reason"] and "speculative" in names
    assert config.parameters["artifact"].string_value == "artifact"
    assert config.parameters["threads"].string_value == "1"
    assert (repo / "tiny" / "1" / "artifact" / "manifest.json").is_file()


def test_model_py_streams_the_runtimes_tokens_one_response_per_round(repo, ref, backend):
    load_model, pb_utils = backend
    model = load_model(repo, "tiny")
    want = ref.generate(PROMPT, max_new_tokens=24, speculative=False)
    streamed = request(pb_utils, max_tokens=np.array([24], np.int32), stream=np.array([True]))
    whole = request(pb_utils, max_tokens=np.array([24], np.int32))
    assert model.execute([streamed, whole]) is None  # decoupled: everything goes through the senders
    sent = streamed.sender.sent
    final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    assert all(flags == 0 for _, flags in sent[:-1]) and sent[-1][1] == final and len(sent) > 3
    rounds = [outputs(r) for r, _ in sent[:-1]]
    assert [t for o in rounds for t in o["token_ids"].tolist()] == want.token_ids
    assert "".join(o["text_output"][0].decode() for o in rounds) == want.text
    last = outputs(sent[-1][0])
    assert last["finish_reason"][0] == b"length" and last["text_output"][0] == b""
    figures = json.loads(last["speculative"][0])
    assert figures["drafted"] == int(last["drafted"][0]) > 0 and figures["rounds"] == int(last["rounds"][0])
    assert figures["accepted"] == int(last["accepted"][0]) and figures["proposer"] == "draft"
    ((response, flags),) = whole.sender.sent  # not streamed: one response with everything
    one = outputs(response)
    assert flags == final and one["token_ids"].tolist() == want.token_ids
    assert one["text_output"][0].decode() == want.text


def only_error(pb_utils, req) -> tuple[str, int]:
    """(message, code) of the one response `req` got, which must be a FINAL error."""
    ((response, flags),) = req.sender.sent
    assert flags == pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL and response.has_error()
    assert response.output_tensors() == []
    message = response.error().message()
    assert "\n" not in message, message
    return message, response.error().code()


def watch_events(model, fail_after: int | None = None) -> list:
    """Replace model.gen.events by one that records each Generation it returns (so only an explicit
    close() ends it) as [generation, closed]; fail_after: the first generation raises RuntimeError
    after that many rounds."""
    real = model.gen.events
    runs: list = []

    def events(ids, config):
        run = real(ids, config)
        record = [None, False]

        def rounds():
            try:
                for i, event in enumerate(run):
                    if not runs[1:] and fail_after is not None and i == fail_after:
                        raise RuntimeError("the session went away")
                    yield event
            finally:
                run.close()
                record[1] = True

        record[0] = Generation(rounds(), run.stats, run.config, run.gamma_policy)
        runs.append(record)
        return record[0]

    model.gen.events = events
    return runs


def test_bad_requests_get_one_final_error_response(repo, backend):
    load_model, pb_utils = backend
    model = load_model(repo, "tiny")
    missing = request(pb_utils, None, max_tokens=np.array([4], np.int32))
    too_long = request(pb_utils, max_tokens=np.array([100_000], np.int32))
    bad_proposer = request(pb_utils, proposer=np.array([b"nope"], dtype=np.object_))
    # what Triton's typed inputs would refuse, read here anyway: int(inf) raises OverflowError, int(1j) TypeError
    infinite = request(pb_utils, max_tokens=np.array([np.inf]))
    huge = request(pb_utils, max_tokens=np.array([2**70], dtype=np.object_))
    no_number = request(pb_utils, top_k=np.array([1j]))
    not_utf8 = pb_utils.FakeRequest(text_input=np.array([b"\xff\xfe"], dtype=np.object_))
    cases = {
        missing: "input text_input (STRING [1]) is required",
        too_long: "max_tokens 100000 + the prompt's",
        bad_proposer: "proposer 'nope'",
        infinite: "input max_tokens must be an integer, got inf",
        huge: f"max_tokens {2**70} + the prompt's",
        no_number: "input top_k must be an integer, got 1j",
        not_utf8: "input text_input must be UTF-8 text, got b'\\xff\\xfe'",
    }
    model.execute(list(cases))
    for req, fragment in cases.items():
        message, code = only_error(pb_utils, req)
        assert fragment in message and code == pb_utils.TritonError.INVALID_ARG, message


def test_an_unexpected_failure_ends_its_request_and_the_next_one_is_answered(repo, ref, backend, caplog):
    load_model, pb_utils = backend
    model = load_model(repo, "tiny")
    runs = watch_events(model, fail_after=1)  # the first request's second round raises RuntimeError
    want = ref.generate(PROMPT, max_new_tokens=24, speculative=False)
    failing = request(pb_utils, max_tokens=np.array([24], np.int32), stream=np.array([True]))
    whole = request(pb_utils, max_tokens=np.array([24], np.int32))
    with caplog.at_level("ERROR", logger="specexport.triton"):
        assert model.execute([failing, whole]) is None
    final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    (first, flags), (last, last_flags) = failing.sender.sent  # one round, then the FINAL error
    got = outputs(first)["token_ids"].tolist()
    assert flags == 0 and not first.has_error() and 0 < len(got) < 24 and got == want.token_ids[: len(got)]
    assert last_flags == final and last.has_error() and last.error().code() == pb_utils.TritonError.INTERNAL
    assert last.error().message() == "internal error: RuntimeError (the server log has the traceback)"
    ((answer, answer_flags),) = whole.sender.sent
    assert answer_flags == final and not answer.has_error() and outputs(answer)["token_ids"].tolist() == want.token_ids
    assert [closed for _, closed in runs] == [True, True]
    (record,) = [r for r in caplog.records if r.name == "specexport.triton"]
    assert record.exc_info[0] is RuntimeError and "the session went away" in caplog.text


def test_a_cancelled_request_stops_between_rounds_with_a_final_cancelled_error(repo, ref, backend):
    load_model, pb_utils = backend
    model = load_model(repo, "tiny")
    runs = watch_events(model)
    want = ref.generate(PROMPT, max_new_tokens=24, speculative=False)
    # is_cancelled: False before the first round, True after it
    streamed = request(pb_utils, max_tokens=np.array([24], np.int32), stream=np.array([True]))
    streamed.cancel_after = 1
    whole = request(pb_utils, max_tokens=np.array([24], np.int32))
    whole.cancel_after = 1
    queued = request(pb_utils, max_tokens=np.array([24], np.int32))
    queued.cancel_after = 0  # cancelled before it started
    plain = request(pb_utils, max_tokens=np.array([24], np.int32))
    older = SimpleNamespace(inputs=plain.inputs, get_response_sender=plain.get_response_sender)  # no is_cancelled
    model.execute([streamed, whole, queued, older])
    final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    (first, flags), (last, last_flags) = streamed.sender.sent
    got = outputs(first)["token_ids"].tolist()
    assert flags == 0 and 0 < len(got) < 24 and got == want.token_ids[: len(got)]
    assert last_flags == final and last.has_error() and last.error().code() == pb_utils.TritonError.CANCELLED
    assert last.error().message() == f"request cancelled after {len(got)} tokens"
    assert (streamed.cancel_checks, whole.cancel_checks, queued.cancel_checks) == (2, 2, 1)
    message, code = only_error(pb_utils, whole)
    assert code == pb_utils.TritonError.CANCELLED and message.startswith("request cancelled after ")
    assert only_error(pb_utils, queued) == ("request cancelled before it started", pb_utils.TritonError.CANCELLED)
    ((answer, answer_flags),) = plain.sender.sent
    assert answer_flags == final and outputs(answer)["token_ids"].tolist() == want.token_ids
    assert [closed for _, closed in runs] == [True, True, True]  # streamed, whole, older: queued never started


def test_a_config_that_is_not_decoupled_is_refused_at_initialize(repo, backend, tmp_path):
    load_model, _ = backend
    copy = shutil.copytree(repo, tmp_path / "models")
    config = copy / "tiny" / "config.pbtxt"
    config.write_text(config.read_text().replace("decoupled: true", "decoupled: false"))
    with pytest.raises(InvalidArgument) as refused:
        load_model(copy, "tiny")
    assert str(refused.value) == (
        "model 'tiny' needs `model_transaction_policy { decoupled: true }` in its config.pbtxt (it sends a"
        " response per round through each request's sender), got a non-decoupled policy"
    )


def test_a_signed_package_is_checked_when_written_and_when_triton_loads_it(tiny_artifacts, tmp_path, backend):
    load_model, _ = backend
    root = shutil.copytree(tiny_artifacts[KIND], tmp_path / "artifact")
    private, public = keygen(tmp_path / "keys")
    sign(root, private)
    spx = pack(root, tmp_path / "tiny.spx")
    report = write_repository(spx, tmp_path / "repo", RepoSettings(name="signed", threads=1), [public])
    assert report.signed and (tmp_path / "repo" / "signed" / "1" / "keys" / "key0.pem").is_file()
    load_model(tmp_path / "repo", "signed")  # verifies at load
    tokenizer = tmp_path / "repo" / "signed" / "1" / "artifact" / "tokenizer.json"
    tokenizer.write_bytes(tokenizer.read_bytes().replace(b'"', b"'", 1))
    with pytest.raises(ChecksumError):
        load_model(tmp_path / "repo", "signed")
    other, other_public = keygen(tmp_path / "other", "other")
    with pytest.raises(SignatureError):  # a repository is only written from an artifact the keys trust
        write_repository(spx, tmp_path / "repo2", trusted_keys=[other_public])
    assert not (tmp_path / "repo2").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no half-written folder left


def test_cli_writes_a_new_repository_and_never_overwrites(tiny_artifacts, tmp_path):
    out = tmp_path / "models"
    result = CliRunner().invoke(cli, ["triton-repo", str(tiny_artifacts[KIND]), "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["model"] == "tiny-int8" and report["signed"] is False
    assert report["files"] == sum(1 for p in out.rglob("*") if p.is_file())
    again = CliRunner().invoke(cli, ["triton-repo", str(tiny_artifacts[KIND]), "-o", str(out)])
    assert again.exit_code == 2 and "exists; triton-repo writes a new repository" in again.output
    with pytest.raises(InvalidArgument, match="instances must be an integer in 1..64, got 0"):
        RepoSettings(instances=0)


@pytest.mark.parametrize("bad", ["model.v2", "v1.0-final"])
def test_a_manifest_name_that_cannot_name_a_model_needs_name(tiny_artifacts, tmp_path, bad):
    """A manifest name is a plain name (the manifest reader refuses paths, quotes, newlines:
    test_package); a Triton model name is narrower (no '.'), so such an artifact needs --name."""
    root = shutil.copytree(tiny_artifacts[KIND], tmp_path / "artifact")  # unsigned: the manifest may say anything
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["name"] = bad
    (root / "manifest.json").write_text(json.dumps(manifest))
    out = tmp_path / "work" / "models"
    refused = CliRunner().invoke(cli, ["triton-repo", str(root), "-o", str(out)])
    assert refused.exit_code == 2, refused.output
    assert (
        f"the artifact's manifest name must be letters, digits, '-' and '_', got {bad!r}"
        " (pass --name to name the Triton model)"
    ) in refused.output
    assert sorted(p.name for p in (tmp_path / "work").iterdir()) == []  # nothing written, nothing left over
    assert sorted(p.name for p in tmp_path.iterdir()) == ["artifact", "work"]
    report = write_repository(root, out, RepoSettings(name="ok", threads=1))
    assert report.model == "ok" and parsed_config(out, "ok").name == "ok"
    assert sorted(p.name for p in out.iterdir()) == ["ok"]
