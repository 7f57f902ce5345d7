"""The `specexport bench` and `specexport calibrate` commands on tiny artifacts: a smoke run of
each (outputs written, usage errors, every option has help)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_support import LINES, _copy

from specexport.cli.bench import bench as bench_cmd
from specexport.cli.bench import calibrate as calibrate_cmd
from specexport_runtime.api import CALIBRATION_NAME
from specexport_runtime.manifest import read_manifest, verify_files


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "tiny.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in LINES), encoding="utf-8")
    return path


def test_cli_bench_smoke(tiny_artifacts, prompt_file, tmp_path):
    from click.testing import CliRunner

    out, md = tmp_path / "r.json", tmp_path / "r.md"
    result = CliRunner().invoke(
        bench_cmd,
        [
            str(tiny_artifacts["self"]),
            "--prompts",
            str(prompt_file),
            "--gamma",
            "2,adaptive",
            "--repeats",
            "1",
            "--max-new-tokens",
            "6",
            "--limit",
            "1",
            "--json",
            str(out),
            "--markdown",
            str(md),
            "--quiet",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "speedup" in result.output and "equivalence (greedy)" in result.output
    data = json.loads(out.read_text())
    assert data["meta"]["prompts"] == 3 and [c["label"] for c in data["configs"]] == ["2", "adaptive"]
    assert md.read_text().startswith("# specexport bench")
    bad = CliRunner().invoke(bench_cmd, [str(tiny_artifacts["self"]), "--gamma", "two"])
    assert bad.exit_code == 2 and "--gamma" in bad.output


def test_cli_calibrate_smoke(tiny_artifacts, prompt_file, tmp_path):
    from click.testing import CliRunner

    art = _copy(tiny_artifacts["self"], tmp_path)
    result = CliRunner().invoke(
        calibrate_cmd,
        [
            str(art),
            "--prompts",
            str(prompt_file),
            "--domains",
            "code,chat",
            "--device",
            "cli-dev",
            "--prompts-per-domain",
            "1",
            "--max-new-tokens",
            "6",
            "--quiet",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "calibration profile 'cli-dev'" in result.output and "default" in result.output
    assert json.loads((art / CALIBRATION_NAME).read_text())["default_profile"] == "cli-dev"
    verify_files(art, read_manifest(art))
    for cmd in (bench_cmd, calibrate_cmd):
        helped = CliRunner().invoke(cmd, ["--help"])
        assert helped.exit_code == 0
        for param in cmd.params:
            if isinstance(param, __import__("click").Option):
                assert param.help, f"{cmd.name} {param.name} has no help"
