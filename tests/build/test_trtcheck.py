"""specexport.plan.trtcheck: TensorRT buildability of contract graphs, checked without TensorRT."""

from __future__ import annotations

import json
from pathlib import Path

import click
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper
from tiny import export_portable, make_model

from specexport.cli.gpu import check_trt_cmd
from specexport.cli.main import _Group
from specexport.graphs.quantize import quantize_graph
from specexport.plan.trt_ops import SUPPORTED_OPS, UNSUPPORTED_OPS
from specexport.plan.trtcheck import TrtCheckError, check_artifact, check_trt, op_support
from specexport_runtime.manifest import Manifest, ModelEntry, TokenizerEntry, write_manifest
from specexport_runtime.trt_engines import Profile


@pytest.fixture(scope="module")
def graphs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("trtcheck")
    fp32 = export_portable(make_model("llama"), root / "fp32")
    out = {"fp32": fp32.path, "spec": fp32.spec}
    raw = export_portable(make_model("llama"), root / "raw", tie_lm_head=False)
    out["int4"] = quantize_graph(raw.path, root / "int4", "int4").path
    out["dynamic-int8"] = quantize_graph(raw.path, root / "dyn", "dynamic-int8").path
    return out


def _graph(tmp_path: Path, nodes, inputs, outputs, opset: int = 17, name: str = "hand.onnx", initializers=()) -> Path:
    graph = helper.make_graph(nodes, "hand", inputs, outputs, initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    path = tmp_path / name
    onnx.save(model, str(path))
    return path


def _ids_input(name="input_ids", dims=(1, "seq"), elem=TensorProto.INT64):
    return helper.make_tensor_value_info(name, elem, list(dims))


# --------------------------------------------------------------------------- exported graphs


def test_fp32_graph_passes_with_int64_warning_only(graphs):
    report = check_trt(graphs["fp32"], "10.3")
    assert report.ok, report.errors
    assert report.errors == []
    assert report.warnings and all("int64" in w for w in report.warnings)
    assert "input_ids" in report.warnings[0] and "logits_index" in report.warnings[0]
    assert report.unsupported == {}
    assert report.op_counts["MatMul"] > 0 and report.op_counts["Gemm"] == 1  # tied embedding read by Gemm
    assert report.nodes == sum(report.op_counts.values())
    assert set(report.dynamic_dims) == {"seq", "past", "rows"}
    assert report.opset == 17
    json.dumps(report.to_dict())


def test_fp32_graph_on_tensorrt_8_6(graphs):
    report = check_trt(graphs["fp32"], "8.6")
    assert report.ok, report.errors
    assert any("casts INT64 to INT32" in w for w in report.warnings)


def test_fused_graph_fails_naming_its_layout_and_contrib_ops(tmp_path):
    from specexport.graphs.decoder import build_decoder

    res = build_decoder(make_model("llama"), tmp_path / "fused", 64)
    report = check_trt(res.path, "10.3")
    assert not report.ok
    assert any("head_major_inplace" in e and "graph: portable" in e for e in report.errors), report.errors
    assert report.unsupported.get("com.microsoft::GroupQueryAttention") == 2
    # one layout error, not one per cache input: the profiles describe portable graphs only
    assert not any("dynamic dimension" in e for e in report.errors), report.errors


def test_int4_graph_fails_naming_matmulnbits(graphs):
    report = check_trt(graphs["int4"], "10.3")
    assert not report.ok
    assert "com.microsoft::MatMulNBits" in report.unsupported
    assert any("MatMulNBits" in e for e in report.errors)
    assert report.op_counts["com.microsoft::MatMulNBits"] == report.unsupported["com.microsoft::MatMulNBits"]
    assert not any("uint8" in e for e in report.errors)  # packed weights only feed the op already reported


def test_dynamic_int8_graph_fails_naming_its_ops(graphs):
    report = check_trt(graphs["dynamic-int8"], "10.3")
    assert not report.ok
    assert {"DynamicQuantizeLinear", "MatMulInteger"} <= set(report.unsupported)
    assert any("DynamicQuantizeLinear" in e for e in report.errors)


# --------------------------------------------------------------------------- hand-made graphs


def test_hand_made_unsupported_op_is_named(tmp_path):
    path = _graph(
        tmp_path,
        [helper.make_node("Unique", ["input_ids"], ["y"], name="uniq")],
        [_ids_input()],
        [helper.make_tensor_value_info("y", TensorProto.INT64, ["n"])],
    )
    report = check_trt(path)
    assert not report.ok
    assert report.unsupported == {"Unique": 1}
    assert any(e.startswith("unsupported operator Unique") for e in report.errors)


def test_an_unsupported_op_inside_a_subgraph_is_named(tmp_path):
    """If branches and Scan / Loop bodies are checked like the graph itself."""
    out = helper.make_tensor_value_info("u", TensorProto.INT64, None)
    then = helper.make_graph([helper.make_node("Unique", ["input_ids"], ["u"])], "then", [], [out])
    other = helper.make_graph([helper.make_node("Identity", ["input_ids"], ["u"])], "else", [], [out])
    path = _graph(
        tmp_path,
        [
            helper.make_node("Constant", [], ["c"], value=helper.make_tensor("c", TensorProto.BOOL, [], [True])),
            helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other),
        ],
        [_ids_input()],
        [helper.make_tensor_value_info("y", TensorProto.INT64, ["n"])],
    )
    report = check_trt(path)
    assert report.unsupported == {"Unique": 1} and not report.ok


def test_a_hybrid_portable_artifact_passes(tmp_path):
    """A Qwen3.5-shaped tiny hybrid: the step form's Scan inside an If, state_index rows within
    the profiles' seq range."""
    from tiny import build_tiny_artifact

    root = build_tiny_artifact(tmp_path, "noisy", arch="qwen3_5_text", max_context=256)
    report = check_artifact(root)
    assert report.ok, report.lines()
    assert {"If", "Scan"} <= set(report.graphs["target"].op_counts)


def test_custom_domain_op_needs_a_plugin(tmp_path):
    node = helper.make_node("FancyOp", ["input_ids"], ["y"], domain="my.domain")
    graph = helper.make_graph(
        [node], "g", [_ids_input()], [helper.make_tensor_value_info("y", TensorProto.INT64, None)]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("my.domain", 1)])
    onnx.save(model, str(tmp_path / "m.onnx"))
    report = check_trt(tmp_path / "m.onnx")
    assert "my.domain::FancyOp" in report.unsupported
    assert any("plugin" in e for e in report.errors)


def test_op_support_is_version_aware():
    assert op_support("", "RMSNormalization", (10, 3)) is not None
    assert op_support("", "RMSNormalization", (10, 15)) is None
    assert op_support("", "Attention", (10, 13)) is not None and op_support("", "Attention", (10, 14)) is None
    assert op_support("", "MatMul", (8, 6)) is None
    assert op_support("com.microsoft", "MatMulNBits", (10, 15)) is not None
    assert not SUPPORTED_OPS & set(UNSUPPORTED_OPS)


def test_opset_range_per_version(tmp_path):
    node = helper.make_node("Identity", ["input_ids"], ["y"])
    out = [helper.make_tensor_value_info("y", TensorProto.INT64, [1, "seq"])]
    path = _graph(tmp_path, [node], [_ids_input()], out, opset=19)
    assert check_trt(path, "10.3").ok
    old = check_trt(path, "8.6")
    assert not old.ok and any("opset 19" in e for e in old.errors)


def test_dims_must_be_profile_dims_and_batch_fixed(tmp_path):
    node = helper.make_node("Identity", ["x"], ["y"])
    path = _graph(
        tmp_path,
        [node],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "tokens", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "tokens", 8])],
    )
    report = check_trt(path)
    assert not report.ok
    assert any("dynamic batch" in e for e in report.errors)
    assert any("'tokens'" in e and "no engine profile defines" in e for e in report.errors)


def test_types(tmp_path):
    nodes = [
        helper.make_node("Cast", ["x"], ["d"], to=TensorProto.DOUBLE),
        helper.make_node("Cast", ["d"], ["y"], to=TensorProto.FLOAT),
    ]
    path = _graph(
        tmp_path,
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "seq"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "seq"])],
    )
    report = check_trt(path)
    assert report.ok and any("float64" in w for w in report.warnings)
    path = _graph(
        tmp_path,
        [helper.make_node("Identity", ["s"], ["t"])],
        [helper.make_tensor_value_info("s", TensorProto.STRING, [1])],
        [helper.make_tensor_value_info("t", TensorProto.STRING, [1])],
        name="str.onnx",
    )
    assert any("string" in e for e in check_trt(path).errors)


def test_nonzero_qdq_zero_point_is_an_error(tmp_path):
    scale = helper.make_tensor("scale", TensorProto.FLOAT, [], [0.1])
    zp = helper.make_tensor("zp", TensorProto.INT8, [], [3])
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "scale", "zp"], ["q"], name="q"),
        helper.make_node("DequantizeLinear", ["q", "scale", "zp"], ["y"], name="dq"),
    ]
    path = _graph(
        tmp_path,
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "seq"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "seq"])],
        initializers=[scale, zp],
    )
    report = check_trt(path)
    assert not report.ok and any("zero point" in e for e in report.errors)


def test_unknown_version_and_unreadable_file(tmp_path, graphs):
    with pytest.raises(TrtCheckError, match="8.6"):
        check_trt(graphs["fp32"], "7.1")
    with pytest.raises(TrtCheckError, match="MAJOR.MINOR"):
        check_trt(graphs["fp32"], "ten")
    newer = check_trt(graphs["fp32"], "11.2")
    assert newer.ok and any("newer than the support matrix" in w for w in newer.warnings)
    (tmp_path / "bad.onnx").write_bytes(b"not a graph")
    with pytest.raises(TrtCheckError, match="cannot read"):
        check_trt(tmp_path / "bad.onnx")


def test_custom_profiles_are_accepted(graphs):
    profiles = [
        Profile("decode", (1, 1, 1), (0, 10, 63), (1, 1, 1)),
        Profile("prefill", (1, 8, 64), (0, 0, 63), (1, 1, 1)),
    ]
    assert check_trt(graphs["fp32"], profiles=profiles).ok


# --------------------------------------------------------------------------- artifact level and CLI


@pytest.fixture(scope="module")
def artifact(graphs, tmp_path_factory) -> Path:
    """A manifest over the exported graphs: fp32 target, int4 draft (no tokenizer needed here)."""
    import shutil

    root = tmp_path_factory.mktemp("artifact")
    for role, key in (("target", "fp32"), ("draft", "int4")):
        shutil.copytree(graphs[key].parent, root / role)
    spec = graphs["spec"]

    def entry(role, precision):
        return ModelEntry(
            graph=f"{role}/model.onnx",
            source="tiny",
            architecture="llama",
            num_layers=spec.num_layers,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            vocab_size=300,
            embedding_rows=spec.embedding_rows,
            precision=precision,
        )

    write_manifest(
        root,
        Manifest(
            name="tiny",
            max_context=256,
            target=entry("target", "fp32"),
            draft=entry("draft", "int4"),
            tokenizer=TokenizerEntry(),
        ),
    )
    return root


def test_check_artifact_runs_every_graph(artifact):
    report = check_artifact(artifact, "10.3")
    assert set(report.graphs) == {"target", "draft"}
    assert report.graphs["target"].ok and not report.graphs["draft"].ok
    assert not report.ok
    assert any(e.startswith("draft: unsupported operator com.microsoft::MatMulNBits") for e in report.errors)
    assert json.loads(json.dumps(report.to_dict()))["graphs"]["target"]["ok"] is True


def test_cli_check_trt(artifact, graphs):
    group = _Group(commands={"check-trt": check_trt_cmd})
    runner = CliRunner()
    bad = runner.invoke(group, ["check-trt", str(artifact)])
    assert bad.exit_code == 1 and "MatMulNBits" in bad.output
    good = runner.invoke(group, ["check-trt", str(graphs["fp32"]), "--json", "--trt-version", "10.3"])
    assert good.exit_code == 0, good.output
    assert json.loads(good.output)["ok"] is True
    assert isinstance(check_trt_cmd, click.Command) and check_trt_cmd.name == "check-trt"
