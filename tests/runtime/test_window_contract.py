"""Contract 1.4: fused graphs with GroupQueryAttention windows need ONNX Runtime >= 1.24.1, whose
local_window_size counts the query's own key (transformers' sliding_window); older ones see one
key more on every row past the window, so the runtime refuses the graph there."""

from __future__ import annotations

import pytest

from specexport_runtime import contract, engine
from specexport_runtime.contract import GraphSpec
from specexport_runtime.errors import ProviderUnavailable
from specexport_runtime.manifest import ModelEntry

WINDOWED = GraphSpec(2, 2, 16, 320, kv_layout=contract.HEAD_MAJOR_INPLACE, windows=(16,))


@pytest.mark.parametrize(
    "version, refused",
    [
        ("1.18.0", True),
        ("1.23.2", True),
        ("1.24.0", True),
        ("1.24.1", False),
        ("1.32.0", False),
        ("1.24.1+cu128", False),
        ("1.23.2+cpu", True),
    ],
)
def test_window_semantics_need_onnxruntime_1_24_1(version, refused):
    problem = contract.window_runtime_error(WINDOWED, version)
    assert (problem is not None) == refused
    if refused:
        assert version in problem and "1.24.1" in problem and "[16]" in problem and "portable" in problem


def test_unwindowed_and_portable_graphs_run_anywhere():
    assert (
        contract.window_runtime_error(GraphSpec(2, 2, 16, 320, kv_layout=contract.HEAD_MAJOR_INPLACE), "1.18.0") is None
    )
    assert contract.window_runtime_error(GraphSpec(2, 2, 16, 320, windows=(16,)), "1.18.0") is None  # mask, no GQA


def test_the_engine_refuses_a_windowed_graph_on_an_old_onnxruntime(monkeypatch):
    monkeypatch.setattr(engine.ort, "__version__", "1.23.2")
    with pytest.raises(ProviderUnavailable, match="1.24.1"):
        engine.check_layout_provider(WINDOWED, "cpu")
    monkeypatch.setattr(engine.ort, "__version__", "1.24.1")
    engine.check_layout_provider(WINDOWED, "cpu")  # no error


def test_a_windowed_entry_declares_contract_1_4_and_round_trips():
    entry = ModelEntry(
        graph="target/model.onnx",
        source="x",
        architecture="gemma2",
        num_layers=2,
        num_kv_heads=2,
        head_dim=16,
        vocab_size=300,
        embedding_rows=320,
        precision="fp32",
        kv_layout=contract.HEAD_MAJOR_INPLACE,
        attention_windows=(16,),
    )
    assert entry.required_version == "1.4" and contract.is_supported("1.4")
    data = entry.json_dict()
    assert data["attention_windows"] == (16,)
    back = ModelEntry.from_json(data)
    assert back == entry and back.graph_spec().windows == (16,)
    plain = ModelEntry(**{**data, "attention_windows": ()})
    assert "attention_windows" not in plain.json_dict() and plain.required_version == "1.1"
