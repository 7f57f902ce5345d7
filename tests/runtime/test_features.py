"""Graph features by name (features.py): the versions they need, the list a manifest carries, and
the one-line refusal of an artifact whose graphs need a feature this runtime does not know."""

from __future__ import annotations

import json
import shutil

import pytest

from specexport_runtime.api import load
from specexport_runtime.contract import HEAD_MAJOR_INPLACE as FUSED
from specexport_runtime.contract import TIME_MAJOR as PORTABLE
from specexport_runtime.contract import version_for
from specexport_runtime.errors import ArtifactError
from specexport_runtime.features import features_for
from specexport_runtime.manifest import read_manifest

# docs/graph-contract.md: what brought each version
CASES = [
    (dict(kv_layout=PORTABLE), ("time_major",), "1.0"),
    (dict(kv_layout=FUSED), ("head_major_in_place",), "1.1"),
    (dict(kv_layout=FUSED, min_rows=2), ("head_major_in_place", "row_padding"), "1.2"),
    (dict(kv_layout=FUSED, head=True), ("head_major_in_place", "row_padding", "eagle3_head"), "1.2"),
    (dict(kv_layout=PORTABLE, head=True), ("time_major", "row_padding", "eagle3_head"), "1.3"),
    (dict(kv_layout=FUSED, windowed=True), ("head_major_in_place", "attention_windows"), "1.4"),
    (dict(kv_layout=PORTABLE, windowed=True), ("time_major",), "1.0"),
    (dict(kv_layout=FUSED, slots=4, idle_rows=1), ("head_major_in_place", "cache_slots"), "1.5"),
    (dict(kv_layout=FUSED, slots=4), ("head_major_in_place", "cache_slots", "idle_slots"), "1.6"),
    (dict(kv_layout=FUSED, tree=True), ("head_major_in_place", "tree_verify"), "1.7"),
    (
        dict(kv_layout=FUSED, head=True, tree=True),
        ("head_major_in_place", "row_padding", "eagle3_head", "eagle3_head_tree"),
        "1.8",
    ),
    (dict(kv_layout=PORTABLE, tree=True), ("time_major", "tree_verify"), "1.9"),
    (dict(kv_layout=PORTABLE, slots=3), ("time_major", "cache_slots", "idle_slots"), "1.10"),
    (dict(kv_layout=PORTABLE, mtp=True), ("time_major", "mtp_head"), "1.12"),
    (dict(kv_layout=FUSED, mtp=True), ("head_major_in_place", "mtp_head"), "1.12"),
]


@pytest.mark.parametrize("kwargs, features, version", CASES)
def test_each_graph_needs_its_features_and_their_version(kwargs, features, version):
    assert features_for(**kwargs) == features
    assert version_for(**kwargs) == version


@pytest.fixture
def artifact(tiny_artifacts, tmp_path):
    root = shutil.copytree(tiny_artifacts["int8-fused"], tmp_path / "art")
    return root, json.loads((root / "manifest.json").read_text())


def test_a_built_manifest_lists_the_features_of_its_graphs(artifact):
    root, data = artifact
    manifest = read_manifest(root)
    needed = set(manifest.target.features) | set(manifest.draft.features)
    assert data["graph_features"] == sorted(needed) and "head_major_in_place" in needed


def test_an_unknown_feature_is_refused_by_name_in_one_line(artifact):
    root, data = artifact
    data["graph_features"] = [*data["graph_features"], "shared_kv_layers"]
    data["contract_version"] = "1.11"  # what a newer build would also say
    (root / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ArtifactError) as info:
        load(root, verify=False)
    message = str(info.value)
    assert "shared_kv_layers" in message and "upgrade specexport-runtime" in message and "\n" not in message


def test_a_manifest_without_the_list_loads_as_before(artifact):
    """Artifacts built before the list existed derive their features from their entries."""
    root, data = artifact
    del data["graph_features"]
    (root / "manifest.json").write_text(json.dumps(data))
    manifest = read_manifest(root)
    assert manifest.graph_features and load(root, verify=False) is not None


def test_a_list_that_omits_a_needed_feature_is_refused(artifact):
    root, data = artifact
    data["graph_features"] = [f for f in data["graph_features"] if f != "head_major_in_place"]
    (root / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match="lacks head_major_in_place"):
        read_manifest(root)
