"""Bad artifacts and bad arguments raise the runtime's typed errors, naming the bad value,
before any model call; the CLI turns them into one `error: ...` line and exit status 2."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specexport_runtime.api import load
from specexport_runtime.engine import available_providers
from specexport_runtime.errors import (
    ArtifactError,
    ChecksumError,
    InvalidArgument,
    PromptError,
    ProviderUnavailable,
    SpecExportError,
)


@pytest.fixture
def artifact_copy(tiny_artifacts, tmp_path):
    """A private copy of the tiny unpadded 'ngram' artifact (small: one graph; contract 1.0),
    safe to damage."""
    dst = tmp_path / "artifact"
    shutil.copytree(tiny_artifacts["ngram-numerical"], dst)
    return dst


@pytest.fixture(scope="module")
def gen(tiny_artifacts):
    return load(tiny_artifacts["noisy"])


def edit_manifest(root: Path, **changes) -> None:
    path = root / "manifest.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    data.update(changes)
    path.write_text(json.dumps(data), encoding="utf-8")


# ------------------------------------------------------------------ artifacts


def test_missing_folder(tmp_path):
    missing = tmp_path / "no-such-artifact"
    with pytest.raises(ArtifactError, match="does not exist") as info:
        load(missing)
    assert str(missing) in str(info.value)


def test_folder_without_manifest(tmp_path):
    folder = tmp_path / "empty"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("{}", encoding="utf-8")
    with pytest.raises(ArtifactError, match="manifest.json") as info:
        load(folder)
    assert str(folder) in str(info.value)
    assert not isinstance(info.value, ChecksumError)


def test_truncated_graph_data_is_checksum_error(artifact_copy):
    data = artifact_copy / "target" / "model.onnx.data"
    size = data.stat().st_size
    with open(data, "r+b") as handle:
        handle.truncate(size // 2)
    with pytest.raises(ChecksumError) as info:
        load(artifact_copy)
    assert "target/model.onnx.data" in str(info.value)


def test_tampered_tokenizer_is_checksum_error(artifact_copy):
    path = artifact_copy / "tokenizer.json"
    vocab = json.loads(path.read_text(encoding="utf-8"))
    vocab["added_tokens"][0]["content"] = "<|tampered|>"  # still valid JSON, still loadable
    path.write_text(json.dumps(vocab), encoding="utf-8")
    with pytest.raises(ChecksumError) as info:
        load(artifact_copy)
    assert "tokenizer.json" in str(info.value)


def test_untouched_copy_loads(artifact_copy):
    """Control for the tests above: the copy itself is fine."""
    assert load(artifact_copy).generate([5, 6, 7], max_new_tokens=3).stats.new_tokens == 3


def test_unsupported_contract_major(artifact_copy):
    edit_manifest(artifact_copy, contract_version="2.0")
    with pytest.raises(ArtifactError, match=r"'2\.0'"):
        load(artifact_copy)


def test_newer_contract_minor_is_refused(artifact_copy):
    """A minor newer than the runtime's may use a layout it does not know."""
    from specexport_runtime import contract

    major, minor = contract.parse_version(contract.CONTRACT_VERSION)
    newer = f"{major}.{minor + 1}"
    edit_manifest(artifact_copy, contract_version=newer)
    with pytest.raises(ArtifactError, match=newer.replace(".", r"\.")):
        load(artifact_copy)


def test_older_contract_minor_loads(artifact_copy):
    """A portable artifact declares 1.0 and a 1.1 runtime reads it (any older minor)."""
    assert json.loads((artifact_copy / "manifest.json").read_text())["contract_version"] == "1.0"
    assert load(artifact_copy).generate([5, 6], max_new_tokens=2).stats.new_tokens == 2


def test_layout_newer_than_declared_contract(artifact_copy):
    path = artifact_copy / "manifest.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    data["target"]["kv_layout"] = "head_major_inplace"  # needs 1.1, the manifest says 1.0
    path.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(ArtifactError, match="head_major_inplace.*1.1"):
        load(artifact_copy)


def test_unknown_kv_layout(artifact_copy):
    path = artifact_copy / "manifest.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    data["target"]["kv_layout"] = "paged"
    path.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(ArtifactError, match="'paged'"):
        load(artifact_copy)


def test_fused_graph_refused_on_providers_that_cannot_run_it(tiny_artifacts):
    """GroupQueryAttention: CPU, or CUDA with fp16 caches; never TensorRT. Checked before any
    session is made, so this runs without a GPU."""
    from specexport_runtime.engine import check_layout_provider
    from specexport_runtime.errors import ContractError
    from specexport_runtime.manifest import read_manifest

    spec = read_manifest(tiny_artifacts["int8-fused"]).target.graph_spec()
    check_layout_provider(spec, "cpu")
    for provider in ("cuda", "tensorrt"):
        with pytest.raises(ContractError, match=f"float32 caches cannot run on provider '{provider}'"):
            check_layout_provider(spec, provider)


def test_unsupported_schema_version(artifact_copy):
    edit_manifest(artifact_copy, schema_version=99)
    with pytest.raises(ArtifactError, match="99"):
        load(artifact_copy)


def test_malformed_manifest_json(artifact_copy):
    path = artifact_copy / "manifest.json"
    path.write_text(path.read_text(encoding="utf-8")[:-20], encoding="utf-8")
    with pytest.raises(ArtifactError, match="not valid JSON") as info:
        load(artifact_copy)
    assert "manifest.json" in str(info.value)


def test_manifest_missing_key(artifact_copy):
    path = artifact_copy / "manifest.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    del data["target"]
    path.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(ArtifactError, match="target"):
        load(artifact_copy)


def test_missing_listed_file(artifact_copy):
    (artifact_copy / "chat_template.jinja").unlink()
    with pytest.raises(ArtifactError, match="chat_template.jinja"):
        load(artifact_copy)


def test_invalid_calibration_json(artifact_copy):
    (artifact_copy / "calibration.json").write_text("{not json", encoding="utf-8")  # unlisted: no checksum
    with pytest.raises(ArtifactError, match="calibration.json"):
        load(artifact_copy)


# ------------------------------------------------------------------ arguments


def no_model_calls(gen):
    """Snapshot of the call counters of both models."""
    return (gen.target.stats.calls, gen.draft.stats.calls if gen.draft is not None else 0)


@pytest.mark.parametrize(
    "kwargs, name, shown",
    [
        ({"temperature": -0.5}, "temperature", "-0.5"),
        ({"temperature": 1.0, "top_p": 0.0}, "top_p", "0.0"),
        ({"temperature": 1.0, "top_p": 1.5}, "top_p", "1.5"),
        ({"temperature": 1.0, "top_k": -1}, "top_k", "-1"),
        ({"gamma": 0}, "gamma", "0"),
        ({"gamma": 33}, "gamma", "33"),
        ({"max_new_tokens": 0}, "max_new_tokens", "0"),
        ({"seed": -1}, "seed", "-1"),
        ({"proposer": "medusa"}, "proposer", "'medusa'"),
        ({"stop": ["ok", ""]}, "stop", "''"),
        ({"min_draft_prob": 1.0}, "min_draft_prob", "1.0"),
        ({"min_draft_prob": -0.1}, "min_draft_prob", "-0.1"),
    ],
)
def test_bad_generation_arguments(gen, kwargs, name, shown):
    before = no_model_calls(gen)
    with pytest.raises(InvalidArgument) as info:
        gen.generate("def add(a, b):", **kwargs)
    message = str(info.value)
    assert name in message and shown in message, message
    assert no_model_calls(gen) == before
    with pytest.raises(InvalidArgument):  # stream validates too, on first use
        next(gen.stream("def add(a, b):", **kwargs))
    assert no_model_calls(gen) == before


@pytest.mark.parametrize(
    "prompt, shown",
    [
        ("", "empty"),
        (b"", "empty"),
        (b"abc\xff\xfe", "0xff"),
        ([], "no tokens"),
        ([5, 6, 99999], "99999"),
        ([5, -1], "-1"),
        ([5, "6"], "'6'"),
        ([5, 6.0], "6.0"),
    ],
    ids=["empty-str", "empty-bytes", "not-utf8", "no-ids", "id-too-large", "id-negative", "id-str", "id-float"],
)
def test_bad_prompts(gen, prompt, shown):
    before = no_model_calls(gen)
    with pytest.raises(PromptError) as info:
        gen.generate(prompt, max_new_tokens=4)
    assert shown in str(info.value), str(info.value)
    assert no_model_calls(gen) == before


def test_prompt_too_long_for_context(gen):
    max_context = gen.manifest.max_context
    assert max_context == 256
    before = no_model_calls(gen)
    for prompt in ([5] * max_context, [5] * (max_context + 40)):
        with pytest.raises(PromptError) as info:
            gen.generate(prompt, max_new_tokens=4)
        assert str(len(prompt)) in str(info.value) and str(max_context) in str(info.value)
    text = "def add(a, b):\n" * 100  # many more tokens than the context
    n = len(gen.codec.encode(text))
    assert n >= max_context
    with pytest.raises(PromptError) as info:
        gen.generate(text, max_new_tokens=4)
    assert str(n) in str(info.value)
    with pytest.raises(PromptError):
        gen.chat([{"role": "user", "content": text}], max_new_tokens=4)
    assert no_model_calls(gen) == before
    # the longest prompt that fits still generates (one free position)
    result = gen.generate([5] * (max_context - 1), max_new_tokens=4)
    assert len(result.token_ids) == 1 and result.finish_reason == "length"


def test_bad_chat_messages(gen):
    before = no_model_calls(gen)
    with pytest.raises(PromptError):
        gen.chat([], max_new_tokens=4)
    with pytest.raises(InvalidArgument, match="name"):
        gen.chat([{"role": "user", "content": "hi", "name": "x"}], max_new_tokens=4)
    with pytest.raises(InvalidArgument, match="message 0"):
        gen.chat([{"role": "user", "content": 3}], max_new_tokens=4)
    with pytest.raises(InvalidArgument, match="message 1: tool_calls"):
        gen.chat(
            [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]},
            ],
            max_new_tokens=4,
        )
    with pytest.raises(InvalidArgument, match="message 0 .*tool_call_id"):
        gen.chat([{"role": "user", "content": "hi", "tool_call_id": "c1"}], max_new_tokens=4)
    assert no_model_calls(gen) == before


def test_cuda_provider_unavailable(tiny_artifacts):
    if "cuda" in available_providers():
        pytest.skip("CUDA is available in this onnxruntime build")
    with pytest.raises(ProviderUnavailable, match="'cuda'"):
        load(tiny_artifacts["ngram"], provider="cuda")


def test_unknown_provider(tiny_artifacts):
    with pytest.raises(InvalidArgument, match="'rocm'"):
        load(tiny_artifacts["ngram"], provider="rocm")


def test_draft_proposer_on_ngram_artifact(tiny_artifacts):
    gen = load(tiny_artifacts["ngram"])
    assert gen.draft is None
    with pytest.raises(InvalidArgument, match="'draft'"):
        gen.generate("def add(a, b):", proposer="draft", max_new_tokens=4)
    assert gen.target.stats.calls == 0
    # target-only never needs a proposer
    assert gen.generate("def add(a, b):", proposer="draft", speculative=False, max_new_tokens=3).stats.new_tokens == 3


def test_errors_share_one_base():
    for cls in (ArtifactError, ChecksumError, InvalidArgument, PromptError, ProviderUnavailable):
        assert issubclass(cls, SpecExportError)


# ------------------------------------------------------------------ CLI


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run(
        [sys.executable, "-m", "specexport_runtime.cli", *args], capture_output=True, text=True, timeout=120, env=env
    )


def test_cli_missing_artifact(tmp_path):
    missing = tmp_path / "nothing-here"
    proc = run_cli("generate", str(missing), "--prompt", "hello")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and str(missing) in lines[0]
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_cli_bad_argument_and_tampered_artifact(artifact_copy):
    proc = run_cli("generate", str(artifact_copy), "--prompt", "hi", "--temperature", "1", "--top-p", "1.5")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "1.5" in lines[0], proc.stderr
    (artifact_copy / "target" / "model.onnx.data").write_bytes(b"\0" * 16)
    proc = run_cli("generate", str(artifact_copy), "--prompt", "hi")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: checksum mismatch"), proc.stderr
    assert "Traceback" not in proc.stderr


def test_write_manifest_is_atomic_and_ignores_leftover_temporaries(artifact_copy, monkeypatch):
    """A crash while writing leaves the old manifest whole; a leftover temporary file is never
    checksummed into the next manifest."""
    import specexport_runtime.manifest as mf

    before = (artifact_copy / "manifest.json").read_text(encoding="utf-8")
    manifest = mf.read_manifest(artifact_copy)

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(mf.os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        mf.write_manifest(artifact_copy, manifest)
    monkeypatch.undo()
    assert (artifact_copy / "manifest.json").read_text(encoding="utf-8") == before
    assert not [p for p in artifact_copy.iterdir() if p.name.endswith(".tmp")]  # cleaned up

    (artifact_copy / ".manifest.json.abc.tmp").write_text("left by a killed writer", encoding="utf-8")
    mf.write_manifest(artifact_copy, manifest)
    assert ".manifest.json.abc.tmp" not in mf.read_manifest(artifact_copy).files
    load(artifact_copy)  # still verifies


def test_speculative_proposers_follow_the_draft(tiny_artifacts):
    """What an artifact can run: draft-free proposers always, 'draft' with a draft model, 'eagle'
    with an EAGLE-3 head, 'hybrid' with either; each listed one resolves, each other one is refused."""
    from dataclasses import replace

    from specexport_runtime.api import load, open_artifact
    from specexport_runtime.contract import EAGLE3_HEAD
    from specexport_runtime.registry import speculative_names

    model, _, _ = open_artifact(tiny_artifacts["self"], verify=False)
    assert model.speculative_proposers() == ("draft", "ngram", "hybrid", "suffix")
    head = replace(model, draft=replace(model.draft, kind=EAGLE3_HEAD))
    assert head.speculative_proposers() == ("ngram", "hybrid", "eagle", "suffix")
    assert replace(model, draft=None).speculative_proposers() == ("ngram", "suffix")
    gen = load(tiny_artifacts["self"], threads=1)
    for name in speculative_names():
        if name in model.speculative_proposers():
            assert gen.resolve_proposer(name) == name
        else:
            with pytest.raises(InvalidArgument):
                gen.resolve_proposer(name)


@pytest.mark.parametrize("kind", ["self", "int8-fused"])
@pytest.mark.parametrize(
    "field, value, words",
    [
        ("num_kv_heads", 1, "KV heads"),
        ("head_dim", 8, "KV heads x 8"),
        ("kv_dtype", "float16", "float16"),
        ("embedding_rows", 7, "embedding_rows 7"),
    ],
)
def test_a_manifest_that_disagrees_with_its_graph_is_refused_at_load(
    tiny_artifacts, tmp_path, kind, field, value, words
):
    """Cache shape facts the manifest states but the graph contradicts (a hand-edited or mixed-up
    manifest) are a typed ContractError when the session opens, not an ONNX Runtime error mid-generation."""
    from specexport_runtime.errors import ContractError

    root = Path(shutil.copytree(tiny_artifacts[kind], tmp_path / "a"))
    raw = json.loads((root / "manifest.json").read_text())
    raw["draft"][field] = value
    (root / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(ContractError, match=words):
        load(root, verify=False)


def test_cli_suffix_draft_limit(tiny_artifacts, capsys):
    """--suffix-max-spec / --suffix-factor reach the suffix proposer (no round drafts more than
    max_spec tokens, the output stays the target's); a bad value is one error line, before the load."""
    from specexport_runtime.cli import main

    art = str(tiny_artifacts["ngram"])
    prompt = ["--prompt", "a b c d e f g a b c d e f g a b c", "--max-new-tokens", "120", "--json"]  # it repeats

    def run(*extra: str) -> dict:
        assert main(["generate", art, *prompt, *extra]) == 0
        return json.loads(capsys.readouterr().out)

    base = run("--no-speculation")
    wide = run("--proposer", "suffix", "--gamma", "8")
    capped = run("--proposer", "suffix", "--gamma", "8", "--suffix-max-spec", "2", "--suffix-factor", "4")
    assert wide["token_ids"] == base["token_ids"] == capped["token_ids"]
    assert len(wide["stats"]["drafted_at"]) > 2 and 1 <= len(capped["stats"]["drafted_at"]) <= 2
    proc = run_cli("generate", str(tiny_artifacts["ngram"]), "--prompt", "hi", "--suffix-max-spec", "0")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "max_spec" in lines[0] and "0" in lines[0], proc.stderr
