"""`specexport check-pair` on a built artifact (folder or .spx) and on hub ids without a reachable
hub: a cached hub id is read from the cache, an uncached one is one error line at once (it used to
retry for about 45 s), a modified artifact tokenizer is refused in one line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from test_build import _other_tokenizer
from test_cli import assert_one_error_line, invoke
from tiny import make_model, make_tokenizer, save_hf_folder, write_recipe

from specexport_runtime.package import pack

CLOSED = "http://127.0.0.1:9"  # a hub endpoint nothing listens on: connections are refused at once
HUB_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """An HF folder with the tiny tokenizer and one with another tokenizer."""
    root = tmp_path_factory.mktemp("pair-hf")
    model = make_model("llama")
    return {
        "target": save_hf_folder(model, root / "target"),
        "other": save_hf_folder(model, root / "other", tokenizer=_other_tokenizer()),
    }


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, folders):
    """`specexport build` of the target folder (int8 self-draft)."""
    root = tmp_path_factory.mktemp("pair-build")
    recipe = write_recipe(root / "tiny.yaml", folders["target"], {"from_target": {"precision": "int8"}}, name="pair")
    result = invoke("build", str(recipe), "-o", str(root / "artifact"))
    assert result.exit_code == 0, result.output
    return root / "artifact"


def test_a_built_artifact_folder_or_package_is_compared_with_a_model_folder(artifact, folders, tmp_path):
    spx = pack(artifact, tmp_path / "tiny.spx")
    for side in (artifact, spx):
        result = invoke("check-pair", str(folders["target"]), str(side), "--json")
        assert result.exit_code == 0, result.output
        report = json.loads(result.stdout)
        # BOS and EOS are compared against the artifact's recorded ids; UNK / PAD are not recorded there
        assert report["compatible"] and report["checks"]["special_tokens"] is True
        assert any("UNK/PAD not compared" in w for w in report["warnings"])
    assert invoke("check-pair", str(artifact), str(spx)).exit_code == 0
    other = invoke("check-pair", str(artifact), str(folders["other"]))
    assert other.exit_code == 1 and "vocab" in other.stdout


def test_a_modified_artifact_tokenizer_is_refused_in_one_line(artifact, folders, tmp_path):
    copy = shutil.copytree(artifact, tmp_path / "copy")
    with open(copy / "tokenizer.json", "a") as f:
        f.write(" ")
    result = invoke("check-pair", str(folders["target"]), str(copy))
    assert_one_error_line(result, str(copy), "does not match its manifest")


def _offline(monkeypatch, **env) -> None:
    for name in HUB_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize(
    "env, reason",
    [({"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE is set"), ({"HF_ENDPOINT": CLOSED}, "127.0.0.1:9 cannot be reached")],
)
def test_an_uncached_hub_id_without_a_hub_fails_at_once(folders, monkeypatch, env, reason):
    _offline(monkeypatch, **env)
    start = time.monotonic()
    result = invoke("check-pair", "specexport-tests/not-cached", str(folders["target"]))
    assert_one_error_line(result, "'specexport-tests/not-cached' is not in the local cache", reason)
    assert time.monotonic() - start < 10


@pytest.mark.slow  # ~8 s
def test_a_cached_hub_id_is_read_from_the_cache_without_the_hub(folders, tmp_path):
    """A hub cache holding the tiny tokenizer under specexport-tests/tiny, the hub unreachable:
    the pair is compared from the cache, in a fresh process (huggingface_hub reads its settings
    at import)."""
    commit = "0" * 40
    repo = tmp_path / "hub" / "models--specexport-tests--tiny"
    make_tokenizer().save_pretrained(repo / "snapshots" / commit)
    shutil.copy(folders["target"] / "config.json", repo / "snapshots" / commit)  # as a model repo has it
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    env = {k: v for k, v in os.environ.items() if k not in HUB_ENV}
    env.update(HF_HUB_CACHE=str(tmp_path / "hub"), HF_ENDPOINT=CLOSED, PYTHONPATH=os.pathsep.join(sys.path))
    code = "import sys; from specexport.cli.main import cli; sys.exit(cli(sys.argv[1:]))"
    cmd = [sys.executable, "-c", code, "check-pair", "specexport-tests/tiny", str(folders["target"])]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and "compatible" in proc.stdout, proc.stdout + proc.stderr
    assert time.monotonic() - start < 30


def test_an_artifacts_eos_agrees_when_the_other_eos_is_one_it_stops_on():
    """An artifact records every id it stops on (the generation config's first): the roles agree
    when the model folder's EOS is among them, and disagree otherwise."""
    from specexport.cli.pair import ArtifactTokenizer
    from specexport.models.tokcheck import check_pair

    tok = make_tokenizer()
    data = tok.backend_tokenizer.to_str().encode()
    eos, other = tok.eos_token_id, tok.pad_token_id
    for stops, ok in (([other, eos], True), ([eos], True), ([other], False)):
        side = ArtifactTokenizer(data, {"bos_token_id": tok.bos_token_id, "eos_token_ids": stops}, "a")
        report = check_pair(tok, side)
        assert report.checks["special_tokens"] is ok and report.compatible is ok, (stops, report.summary())
