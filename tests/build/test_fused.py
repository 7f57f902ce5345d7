"""The fused graph (head_major_inplace layout, contract 1.1) against transformers.

For every registered rotary family (tests/tiny.TINY_CONFIGS), the graph written by
specexport.graphs.decoder (the fused operators) is checked
  * with validate_export at the FP32 tolerance (prefill, verify on the past, rollback), which runs
    ONNX Runtime's non-shared mode (a P-row past in, a P+S-row cache out), and
  * in the runtime's shared in-place mode: one [1, H_kv, T_max, D] buffer bound as both past and
    present, a prompt in uneven chunks, a rollback over rows that hold stale K/V of other tokens,
    every row compared with transformers' logits.
Plus the interface (names, dtypes, fixed/symbolic dims), the node budget that is the point of the
fused graph, a tied embedding stored once, and typed errors for what it does not reproduce.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto
from tiny import TINY_CONFIGS, TINY_VARIANTS, fp32_bound, make_model, tiny_names

from specexport.build.validate import FP16, FP32, validate_export
from specexport.graphs.decoder import build_decoder, fused_supported
from specexport.models.architectures import ARCHITECTURES
from specexport.models.config import UnsupportedConfig
from specexport_runtime import contract
from specexport_runtime.engine import OrtModel, SessionConfig

FUSED_ARCHS = sorted(a for a in TINY_CONFIGS if fused_supported(a))
FUSED_NAMES = [n for n in tiny_names() if fused_supported(TINY_VARIANTS.get(n, (n,))[0])]  # with feature variants
MAX_CONTEXT = 64
N_PROBE = 40  # > the tiny Mistral window (16)


def probe_ids(n: int = N_PROBE, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, 300, size=n).tolist()


def hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float().numpy()


@pytest.fixture(scope="module")
def fused(tmp_path_factory):
    cache: dict = {}

    def get(arch: str):
        if arch not in cache:
            model = make_model(arch)
            cache[arch] = (model, build_decoder(model, tmp_path_factory.mktemp(f"fused-{arch}"), MAX_CONTEXT))
        return cache[arch]

    return get


def test_every_rotary_family_has_a_fused_parity_test():
    fusable = sorted(a for a, spec in ARCHITECTURES.items() if spec.positions != "learned")  # rotary or none
    assert fusable == FUSED_ARCHS, f"families without a fused parity test: {sorted(set(fusable) - set(FUSED_ARCHS))}"
    assert "gpt2" not in FUSED_ARCHS


@pytest.mark.parametrize("arch", FUSED_NAMES)
def test_fused_validates_fp32(arch, fused):
    model, res = fused(arch)
    assert res.spec.kv_layout == contract.HEAD_MAJOR_INPLACE
    report = validate_export(model, res.path, res.spec, probe_ids(), FP32)
    for step in report.steps:
        assert step.max_abs_diff <= FP32.max_abs, (arch, step)
        assert step.argmax_agreement == 1.0, (arch, step)


@pytest.mark.parametrize("arch", FUSED_NAMES)
def test_fused_in_place_chunks_and_rollback_over_stale_rows(arch, fused):
    """The runtime's binding: one buffer per K/V as past and present, written at the cursor."""
    model, res = fused(arch)
    ids = probe_ids(seed=1)
    ref = hf_logits(model, ids)
    m = OrtModel(res.path, res.spec, MAX_CONTEXT, SessionConfig())
    got, start = [], 0
    for n in (13, 1, 26):
        got.append(m.forward(ids[start : start + n], last_rows=n).copy())
        start += n
    got = np.concatenate(got)
    bound = fp32_bound(arch)
    assert float(np.abs(got - ref).max()) <= bound
    assert np.array_equal(got.argmax(-1), ref.argmax(-1))
    # rows 20..39 now hold K/V of ids[20:]; roll back to 20 and feed other tokens: the stale rows
    # past the new write must not be read
    other = [(t * 7 + 11) % 297 + 3 for t in ids[20:25]]
    m.truncate(20)
    after = m.forward(other, last_rows=5).copy()
    ref2 = hf_logits(model, ids[:20] + other)[20:]
    assert float(np.abs(after - ref2).max()) <= bound, arch
    one = m.forward([ids[0]]).copy()  # a decode step after the rollback
    assert float(np.abs(one - hf_logits(model, ids[:20] + other + [ids[0]])[-1:]).max()) <= bound


@pytest.mark.parametrize("arch", FUSED_ARCHS)
def test_fused_interface_follows_the_contract(arch, fused):
    model, res = fused(arch)
    spec = res.spec
    proto = onnx.load(str(res.path), load_external_data=False)
    props = {p.key: p.value for p in proto.metadata_props}
    # 1.1, or 1.4 with GroupQueryAttention windows (their ONNX Runtime floor), 1.11 with recurrent state
    expected = contract.version_for(contract.HEAD_MAJOR_INPLACE, windowed=bool(spec.windows), states=bool(spec.states))
    want = "1.11" if spec.states else "1.4" if spec.windows else "1.1"
    assert props["specexport.contract_version"] == expected == want
    assert props["specexport.kv_layout"] == contract.HEAD_MAJOR_INPLACE
    assert [i.name for i in proto.graph.input] == spec.input_names()
    assert [o.name for o in proto.graph.output] == spec.output_names()

    def sig(v):
        t = v.type.tensor_type
        return t.elem_type, [d.dim_param or d.dim_value for d in t.shape.dim]

    inputs = {i.name: sig(i) for i in proto.graph.input}
    outputs = {o.name: sig(o) for o in proto.graph.output}
    assert inputs[contract.SEQLENS_K] == (TensorProto.INT32, [1])
    assert inputs[contract.TOTAL_SEQUENCE_LENGTH] == (TensorProto.INT32, [])
    _, (_, H, T, D) = inputs[contract.past_key(0)]
    assert (H, D) == (spec.num_kv_heads, spec.head_dim) and isinstance(T, str)
    for i in range(spec.num_layers):
        assert outputs[contract.present_key(i)] == inputs[contract.past_key(i)]
    assert outputs[contract.LOGITS][1][2] == spec.embedding_rows


def test_fused_node_budget_and_tied_embedding_once(fused):
    """The fused graph's point: a dozen nodes per layer, attention in one node."""
    model, res = fused("llama")
    proto = onnx.load(str(res.path))
    ops = [n.op_type for n in proto.graph.node]
    L = model.config.num_hidden_layers
    assert ops.count("GroupQueryAttention") == L
    assert len(ops) <= 11 * L + 8, ops
    V, hidden = model.config.vocab_size, model.config.hidden_size
    big = [i for i in proto.graph.initializer if V * hidden in (np.prod(i.dims),)]
    assert len(big) == 1, "a tied embedding must be stored once"


def test_fused_rejects_learned_positions(tmp_path):
    with pytest.raises(UnsupportedConfig, match="gpt2.*portable"):
        build_decoder(make_model("gpt2"), tmp_path, MAX_CONTEXT)


def test_fused_rejects_unknown_activation(tmp_path):
    with pytest.raises(UnsupportedConfig, match="'hidden_act' = 'relu6'"):
        build_decoder(make_model("llama", hidden_act="relu6"), tmp_path, MAX_CONTEXT)


def test_fused_fp16_within_fp16_tolerance(tmp_path):
    model = make_model("llama")
    res = build_decoder(make_model("llama").half(), tmp_path, MAX_CONTEXT)
    assert res.spec.kv_dtype == "float16"
    report = validate_export(model, res.path, res.spec, probe_ids(), FP16)
    assert report.max_abs_diff <= FP16.max_abs


def test_perturbed_fused_graph_fails_validation(tmp_path):
    """The parity check can fail: a graph built from another model is rejected."""
    from specexport.build.validate import ExportValidationError

    res = build_decoder(make_model("llama", seed=1), tmp_path, MAX_CONTEXT)
    with pytest.raises(ExportValidationError):
        validate_export(make_model("llama"), res.path, res.spec, probe_ids(), FP32)
