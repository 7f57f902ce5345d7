"""Smaller defects a new user meets (issue 48): each test failed on the code before its fix."""

from __future__ import annotations

import pytest

from specexport_runtime.api import load
from specexport_runtime.cli import main
from specexport_runtime.errors import InvalidArgument


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
