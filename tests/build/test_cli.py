"""The `specexport` command line, through click's CliRunner and (once) as a real subprocess.

Errors the tool raises on purpose (SpecExportError) must reach the user as exit code 2 and one
`error: ...` line on stderr, without a traceback unless --debug is given.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest
import yaml
from click.testing import CliRunner
from test_build import _other_tokenizer
from tiny import make_model, save_hf_folder, write_recipe

from specexport.cli.main import cli
from specexport_runtime.cli import add_generate_arguments


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def assert_one_error_line(result, *needles: str) -> str:
    """Exit 2, stderr is exactly one `error: ...` line (plus nothing), no traceback."""
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Two HF folders with the tiny tokenizer and one with another tokenizer."""
    root = tmp_path_factory.mktemp("cli-hf")
    model = make_model("llama")
    return {
        "target": save_hf_folder(model, root / "target"),
        "same": save_hf_folder(make_model("llama", seed=2), root / "same"),
        "other": save_hf_folder(model, root / "other", tokenizer=_other_tokenizer()),
    }


@pytest.fixture(scope="module")
def built(tmp_path_factory, folders):
    """`specexport build RECIPE -o DIR --json` on a tiny recipe (int8 self-draft); run once."""
    root = tmp_path_factory.mktemp("cli-build")
    recipe = write_recipe(
        root / "tiny.yaml", folders["target"], {"from_target": {"precision": "int8"}}, name="tiny-cli"
    )
    out = root / "artifact"
    result = invoke("build", str(recipe), "-o", str(out), "--json")
    return result, out, recipe


def test_build_json(built):
    result, out, _ = built
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)  # stdout is the JSON alone (progress goes to stderr)
    assert report["output"] == str(out) and report["manifest"] == "tiny-cli"
    assert report["seconds"] and all(isinstance(v, (int, float)) and v >= 0 for v in report["seconds"].values())
    assert any(k.startswith("export_target") for k in report["seconds"])
    files = {p.relative_to(out).as_posix(): p.stat().st_size for p in out.rglob("*") if p.is_file()}
    assert report["sizes"] == {k: v for k, v in files.items() if k in report["sizes"]}
    assert {"target/model.onnx.data", "draft/model.onnx.data", "tokenizer.json"} <= set(report["sizes"])
    val = report["validation"]
    assert val["target"]["max_abs_diff"] <= 1e-4 and val["target"]["tolerance"]["max_abs"] == 1e-4
    assert val["target"]["long_range"]["tokens"] == 256 and val["target"]["long_range"]["max_abs_diff"] <= 1e-4
    assert 0 < val["draft"]["argmax_agreement"] <= 1 and "note" in val["draft"]


def test_build_existing_output(built):
    _, out, recipe = built
    result = invoke("build", str(recipe), "-o", str(out))  # exists, no --force
    assert result.exit_code == 2
    assert f"error: output folder {str(out)!r} already exists" in result.stderr and "Traceback" not in result.output


def test_build_existing_output_is_one_line(built):
    _, out, recipe = built
    assert_one_error_line(invoke("build", str(recipe), "-o", str(out)), str(out), "--force")


def test_build_text_and_overrides(built):
    _, out, recipe = built
    result = invoke(
        "build",
        str(recipe),
        "-o",
        str(out.with_name("text")),
        "--quiet",
        "--no-validate",
        "--gamma",
        "6",
        "--max-context",
        "128",
    )
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"built {out.with_name('text')}") and "size" in result.stdout
    manifest = json.loads((out.with_name("text") / "manifest.json").read_text())
    assert manifest["speculation"]["gamma"] == 6 and manifest["max_context"] == 128
    assert manifest["target"]["validation"] == {}


def test_inspect(built):
    _, out, _ = built
    result = invoke("inspect", str(out))
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert text.startswith("tiny-cli  (contract 1.2, max_context 256)")  # a padded target (exactness bitwise)
    assert "target: llama fp32, 2 layers, 2 KV heads x 16" in text and "draft: llama int8" in text
    assert "checksums verified" in text
    result = invoke("inspect", str(out), "--json")
    summary = json.loads(result.stdout)
    assert summary["checksums"] == "verified" and summary["target"]["kv_cache_bytes"] == 2 * 2 * 256 * 2 * 16 * 4


@pytest.fixture
def tampered(built, tmp_path):
    _, out, _ = built
    copy = Path(shutil.copytree(out, tmp_path / "tampered"))
    with open(copy / "tokenizer.json", "a", encoding="utf-8") as handle:
        handle.write(" ")
    return copy


def test_inspect_tampered(tampered):
    assert_one_error_line(invoke("inspect", str(tampered)), "checksum mismatch", "'tokenizer.json'")
    result = invoke("inspect", str(tampered), "--no-verify")
    assert result.exit_code == 0 and "checksums not checked" in result.stdout
    debug = invoke("--debug", "inspect", str(tampered))
    assert debug.exit_code == 2
    assert "Traceback" in debug.stderr and "ChecksumError" in debug.stderr
    assert debug.stderr.rstrip().splitlines()[-1].startswith("error: checksum mismatch")


def test_inspect_tampered_subprocess(tampered):
    """The installed console script, as a user runs it."""
    exe = Path(sys.executable).with_name("specexport")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-c", "from specexport.cli.main import main; main()"]
    proc = subprocess.run(
        [*cmd, "inspect", str(tampered)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: checksum mismatch"), proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_check_pair(folders):
    same = invoke("check-pair", str(folders["target"]), str(folders["same"]))
    assert same.exit_code == 0 and same.stdout.startswith("tokenizers compatible")
    other = invoke("check-pair", str(folders["target"]), str(folders["other"]))
    assert other.exit_code == 1 and other.stdout.startswith("tokenizers incompatible")
    as_json = invoke("check-pair", str(folders["target"]), str(folders["other"]), "--json")
    assert as_json.exit_code == 1
    report = json.loads(as_json.stdout)
    assert report["compatible"] is False and "vocab" in report["failed"]
    assert json.loads(invoke("check-pair", str(folders["target"]), str(folders["same"]), "--json").stdout)["compatible"]
    # a missing folder is an error, not an incompatibility
    assert_one_error_line(invoke("check-pair", str(folders["target"]), "/no/such/model"), "'/no/such/model'")


def test_generate(built):
    _, out, _ = built
    result = invoke("generate", str(out), "--prompt", "hi", "--max-new-tokens", "5", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert 1 <= len(data["token_ids"]) <= 5 and isinstance(data["text"], str)
    assert data["stats"]["new_tokens"] == len(data["token_ids"])
    base = invoke("generate", str(out), "--prompt", "hi", "--max-new-tokens", "5", "--json", "--no-speculation")
    assert json.loads(base.stdout)["token_ids"] == data["token_ids"]  # exact: same greedy tokens
    assert_one_error_line(invoke("generate", "/no/such/artifact", "--prompt", "hi"), "'/no/such/artifact'")


def _click_options(command: click.Command) -> list[str]:
    return [opt for p in command.params if isinstance(p, click.Option) for opt in p.opts + p.secondary_opts]


@pytest.mark.parametrize("name", [""] + sorted(set(cli.commands) - {"generate"}))
def test_help(name):
    command = cli if not name else cli.commands[name]
    result = invoke(*([name] if name else []), "--help")
    assert result.exit_code == 0, result.output
    for opt in _click_options(command) + ["--help"]:
        if any(p.hidden for p in command.params if isinstance(p, click.Option) and opt in p.opts):
            continue
        assert opt in result.stdout, (name, opt)
    if not name:
        for sub in cli.commands:
            assert sub in result.stdout


def test_generate_help_is_the_runtime_parser():
    result = invoke("generate", "--help")
    assert result.exit_code == 0, result.output
    parser = argparse.ArgumentParser()
    add_generate_arguments(parser)
    options = [s for a in parser._actions for s in a.option_strings]
    assert "--max-new-tokens" in options and "--json" in options
    for opt in options:
        assert opt in result.stdout, opt
    assert "artifact" in result.stdout


def test_bad_input_is_one_line(tmp_path, folders):
    path = tmp_path / "typo.yaml"
    path.write_text(
        yaml.safe_dump(
            {"name": "t", "max_contxt": 64, "target": {"model": str(folders["target"])}, "draft": {"proposer": "ngram"}}
        )
    )
    assert_one_error_line(invoke("build", str(path), "-o", str(tmp_path / "o")), "'max_contxt'", "max_context")
    assert not (tmp_path / "o").exists()
    assert_one_error_line(invoke("build", "no-such-recipe", "-o", str(tmp_path / "o")), "'no-such-recipe'")
    assert_one_error_line(invoke("inspect", str(tmp_path / "missing")), "does not exist")
    assert_one_error_line(invoke("inspect", str(tmp_path)), "manifest.json")


def test_build_summary_line_for_a_graph_and_for_an_eagle_head():
    """`specexport build` prints each model's validation; an EAGLE-3 head's has no max |diff| (it
    reports agreement with the target), which once crashed the summary after a good build."""
    from specexport.cli.main import _validation_line

    assert (
        _validation_line({"max_abs_diff": 2.5e-5, "argmax_agreement": 1.0})
        == "max |diff| 2.50e-05, argmax agreement 100.0%"
    )
    head = {"layer_ids": [2, 15, 27], "layer_ids_source": "default", "target_agreement": 0.25, "probe_rows": 40}
    line = _validation_line(head)
    assert "25.0% of 40 probe rows" in line and "[2, 15, 27]" in line
    assert _validation_line({"layer_ids": [1, 2, 3]}) == "target features entering layers [1, 2, 3]"
