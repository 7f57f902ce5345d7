"""Artifact paths stay inside the artifact (runtime/specexport_runtime/paths.py): every case of
the confinement rule of docs/artifact.md gives a typed PathError, and nothing outside the folder is read."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from specexport_runtime.api import load
from specexport_runtime.errors import ArtifactError
from specexport_runtime.manifest import Manifest, read_manifest, verify_files
from specexport_runtime.paths import PathError, confined, external_data_locations


@pytest.mark.parametrize("rel", ["../x", "a/../../x", "/etc/passwd", "C:/x", "\\\\server\\share", "a\\b", "", "a\x00b"])
def test_bad_relative_paths(tmp_path, rel):
    with pytest.raises(PathError):
        confined(tmp_path, rel, "thing")


def test_symlink_leaving_the_folder(tmp_path):
    root, outside = tmp_path / "art", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "secret.txt").write_text("no")
    os.symlink(outside, root / "link")
    with pytest.raises(PathError, match="outside the artifact folder"):
        confined(root, "link/secret.txt", "manifest files entry")
    (root / "inside.txt").write_text("ok")
    os.symlink(root / "inside.txt", root / "alias.txt")  # a link that stays inside is fine
    assert confined(root, "alias.txt", "x") == root / "alias.txt"


def _copy(tiny_artifacts, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_artifacts["ngram"], tmp_path / "art"))


def _rewrite(root: Path, change) -> None:
    path = root / "manifest.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_manifest_with_a_dotdot_file_entry_is_refused_before_reading(tiny_artifacts, tmp_path):
    root = _copy(tiny_artifacts, tmp_path)
    (tmp_path / "outside.json").write_text("{}")
    _rewrite(root, lambda d: d["files"].update({"../outside.json": "0" * 64}))
    with pytest.raises(PathError, match=r"manifest files entry '\.\./outside\.json' contains '\.\.'"):
        read_manifest(root)


def test_absolute_graph_path_is_refused(tiny_artifacts, tmp_path):
    root = _copy(tiny_artifacts, tmp_path)
    graph = str((root / "target" / "model.onnx").resolve())
    _rewrite(root, lambda d: d["target"].update({"graph": graph}))
    with pytest.raises(PathError, match="target graph .* is an absolute path"):
        load(root, verify=False)


def test_files_entry_through_a_symlink_out_is_refused(tiny_artifacts, tmp_path):
    root = _copy(tiny_artifacts, tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "w.bin").write_bytes(b"x")
    os.symlink(outside, root / "ext")
    _rewrite(root, lambda d: d["files"].update({"ext/w.bin": "0" * 64}))
    with pytest.raises(PathError, match="outside the artifact folder"):
        read_manifest(root)
    unchecked = Manifest.from_dict(json.loads((root / "manifest.json").read_text()))  # bypasses read_manifest
    with pytest.raises(PathError, match="outside the artifact folder"):
        verify_files(root, unchecked)  # which checks again before hashing


def _graph_with_external(folder: Path, location: str) -> Path:
    """A one-MatMul ONNX graph whose weight lives in external data at `location`."""
    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    w.data_location = TensorProto.EXTERNAL
    w.ClearField("raw_data")
    for key, value in (("location", location), ("offset", "0"), ("length", "64")):
        entry = w.external_data.add()
        entry.key, entry.value = key, value
    node = helper.make_node("MatMul", ["x", "w"], ["y"])
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [w],
    )
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.onnx"
    onnx.save_model(helper.make_model(graph), str(path))  # written as is: the data file is not touched
    return path


def test_external_data_locations_are_read_without_onnx(tmp_path):
    path = _graph_with_external(tmp_path / "g", "weights.bin")
    assert external_data_locations(path) == ["weights.bin"]


def test_graph_with_external_data_outside_is_refused(tiny_artifacts, tmp_path):
    root = _copy(tiny_artifacts, tmp_path)
    (tmp_path / "stolen.bin").write_bytes(b"\x00" * 64)
    _graph_with_external(root / "target", "../../stolen.bin")
    with pytest.raises(PathError, match="external data '../../stolen.bin' outside the artifact folder"):
        load(root, verify=False)


def test_real_graphs_pass_and_list_their_data(tiny_artifacts):
    root = Path(tiny_artifacts["ngram"])
    m = read_manifest(root)
    locations = external_data_locations(root / m.target.graph)
    assert locations and all(loc == "model.onnx.data" for loc in locations)
    load(root)  # the checks pass on what the build writes


def test_garbage_graph_is_a_typed_error(tmp_path):
    (tmp_path / "model.onnx").write_bytes(b"\x3a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff")
    with pytest.raises(ArtifactError, match="not a readable ONNX protobuf"):
        external_data_locations(tmp_path / "model.onnx")


def test_calibration_symlink_out_is_refused(tiny_artifacts, tmp_path):
    root = _copy(tiny_artifacts, tmp_path)
    (tmp_path / "elsewhere.json").write_text("{}")
    os.symlink(tmp_path / "elsewhere.json", root / "calibration.json")
    with pytest.raises(PathError, match="calibration file 'calibration.json' resolves to"):
        load(root)


def test_a_graph_that_is_missing_is_a_typed_error(tiny_artifacts, tmp_path):
    """Found by the manifest fuzz test: a graph path naming no file (and not listed in files)."""
    root = _copy(tiny_artifacts, tmp_path)
    _rewrite(root, lambda d: d["target"].update({"graph": "0"}))
    with pytest.raises(ArtifactError, match="graph .* cannot be read"):
        load(root, verify=True)
