"""GGUF files streamed tensor by tensor (specexport/models/gguf_source.py, formats/gguf_config.py).

Every family the fused writer supports is converted here (tests/build/gguf_support.py: gguf-py's
name table, llama.cpp's q/k permutation and Gemma's 1 + w norms, written independently of the
reader) from a tiny random-init model, then read back. References are the original transformers
model (float files) or that model holding gguf-py's own dequantization of the file's blocks
(quantized files); tolerances are explicit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf_support import CONVERTED, T, dequantized_reference, gguf_model, write_model_gguf

from specexport.build.validate import FeedRunner, reference_logits
from specexport.formats.blocks import FormatError
from specexport.formats.gguf_config import hf_config, read_header
from specexport.graphs.decoder import build_decoder
from specexport.graphs.quantized_target import QuantizedWeights
from specexport.models.config import normalize
from specexport.models.gguf_source import open_gguf
from specexport.models.streaming import source_of

FAMILIES = sorted(CONVERTED)
MAX_CONTEXT = 128
GRAPH_TOL = 2e-4  # |logit| diff of an fp32 graph from transformers' fp32 forward, relative to max |logit|
NORM_SHIFT_TOL = 1e-5  # Gemma: (1 + w) - 1 + 1 in float32 is w's own (1 + w) to an ulp or two


def _ids(n: int = 20, seed: int = 0) -> list[int]:
    return [int(i) for i in np.random.default_rng(seed).integers(3, 300, n)]


def _graph_logits(model, out, ids, weights=None) -> np.ndarray:
    """Rows of a prefill and a 5-token verify call of the fused graph: [len(ids), V]."""
    result = build_decoder(model, out, MAX_CONTEXT, weights=weights)
    runner = FeedRunner(result.path, result.spec)
    n0 = len(ids) - 5
    return np.concatenate([runner.run(ids[:n0], list(range(n0))), runner.run(ids[n0:], list(range(5)))])


@pytest.mark.parametrize("family", FAMILIES)
def test_config_from_metadata_normalizes_like_the_original(tmp_path, family):
    model = gguf_model(family)
    path, _ = write_model_gguf(model, tmp_path / "m.gguf")
    header = read_header(path)
    assert normalize(hf_config(header), MAX_CONTEXT) == normalize(model.config, MAX_CONTEXT)


@pytest.mark.parametrize("family", FAMILIES)
def test_float_file_streams_the_original_model(tmp_path, family):
    """An F32 file: every parameter reads back as the original's (bitwise; Gemma's norms to an
    ulp), the streamed reference gives its logits, the fused graph of the stream matches them."""
    model = gguf_model(family)
    path, _ = write_model_gguf(model, tmp_path / "m.gguf")
    streamed = open_gguf(read_header(path))
    source = source_of(streamed)
    shifted = CONVERTED[family][2]
    for name, p in model.named_parameters(remove_duplicate=False):
        got, want = source.get(name), p.detach()
        if shifted and name.endswith("norm.weight"):
            assert (got - want).abs().max() <= NORM_SHIFT_TOL, name
        else:
            assert torch.equal(got, want), name
    ids = _ids()
    ref = reference_logits(model, ids)
    got = reference_logits(streamed, ids)
    scale = max(1.0, float(np.abs(ref).max()))
    if shifted:
        assert np.abs(got - ref).max() <= GRAPH_TOL * scale
    else:
        assert np.array_equal(got, ref)
    graph = _graph_logits(streamed, tmp_path / "g", ids)
    assert np.abs(graph - ref).max() <= GRAPH_TOL * scale
    assert all(p.device.type == "meta" for p in streamed.parameters())  # nothing stayed loaded


# legacy types gguf.quants writes, spread over the weights; 1-D and odd shapes stay F32
_TYPES = (T.Q8_0, T.Q4_1, T.Q4_0, T.Q5_0, T.Q5_1)


def _mixed(name: str, w: np.ndarray) -> T:
    if w.shape[1] % 32:
        return T.F32
    return _TYPES[sum(map(ord, name)) % len(_TYPES)]


@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_file_keeps_its_blocks(tmp_path, family):
    """Every 2-D weight quantized (Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1): the blocks stream out exactly
    (gguf-py's dequantization of the file, bit for bit, q/k rows in HF order) and the fused graph
    of them (MatMulNBits, accuracy_level 1: float32 sums) computes the model gguf-py reads."""
    model = gguf_model(family)
    path, held = write_model_gguf(model, tmp_path / "m.gguf", _mixed)
    streamed = open_gguf(read_header(path))
    source = source_of(streamed)
    for name, value in held.items():
        np.testing.assert_array_equal(source.blocks.get(name).dequantize(), value, err_msg=name)
        assert torch.equal(source.get(name), torch.from_numpy(value)), name
    reference = dequantized_reference(model, held)
    weights = QuantizedWeights("gguf", 32, 1, "checkpoint", "checkpoint", source.blocks)
    ids = _ids()
    ref = reference_logits(reference, ids)
    got = _graph_logits(streamed, tmp_path / "g", ids, weights)
    assert np.abs(got - ref).max() <= GRAPH_TOL * max(1.0, float(np.abs(ref).max()))
    assert (got.argmax(-1) == ref.argmax(-1)).all()
    summary = weights.describe()["checkpoint_tensors"]
    assert (
        "dequantized" not in summary and sum(summary["exact"].values()) >= len(held) - 1
    )  # (a tied head is the embedding)


def _q4_k_m(name: str, w: np.ndarray) -> T:
    """llama.cpp's Q4_K_M mix: Q6_K for the embedding, attn_v and ffn_down, Q4_K elsewhere."""
    return T.Q6_K if name.endswith(("embed_tokens.weight", "v_proj.weight", "down_proj.weight")) else T.Q4_K


def test_a_gemma3_q4_k_m_file_keeps_its_k_quant_blocks(tmp_path):
    """Gemma 3 as llama.cpp's Q4_K_M stores it (random Q4_K / Q6_K blocks, K a multiple of 256):
    every weight MatMulNBits from its own blocks (Q4_K: 4-bit + offset, Q6_K: 8-bit block 16),
    the embedding and the tied head included, computing the model gguf-py reads."""
    model = gguf_model("gemma3_text", hidden_size=256, intermediate_size=512, head_dim=64, query_pre_attn_scalar=64)
    path, held = write_model_gguf(model, tmp_path / "m.gguf", _q4_k_m)
    streamed = open_gguf(read_header(path))
    source = source_of(streamed)
    for name, value in held.items():
        np.testing.assert_array_equal(source.get(name).numpy(), value, err_msg=name)
    weights = QuantizedWeights("gguf", 32, 1, "checkpoint", "checkpoint", source.blocks)
    ids = _ids()
    ref = reference_logits(dequantized_reference(model, held), ids)
    got = _graph_logits(streamed, tmp_path / "g", ids, weights)
    assert np.abs(got - ref).max() <= GRAPH_TOL * max(1.0, float(np.abs(ref).max()))
    assert (got.argmax(-1) == ref.argmax(-1)).all()
    n_q6 = sum(_q4_k_m(n, None) == T.Q6_K for n in held)
    assert weights.describe()["checkpoint_tensors"] == {"exact": {"Q4_K": len(held) - n_q6, "Q6_K": n_q6}}


def _q3_k_raw(rows: int, cols: int, rng) -> np.ndarray:
    """uint8 [rows, cols / 256 * 110]: random Q3_K blocks (ggml-common.h block_q3_K: 32 B hmask,
    64 B low bits, 12 B scales, fp16 d), d drawn finite."""
    nsb = cols // 256
    d = rng.normal(0, 1e-2, (rows, nsb)).astype("<f2")[..., None].view(np.uint8)
    body = rng.integers(0, 256, (rows, nsb, 108), dtype=np.uint8)
    return np.concatenate([body, d], axis=-1).reshape(rows, -1)


def test_a_type_without_a_block_form_is_dequantized_and_recorded(tmp_path):
    """A Q3_K weight (no MatMulNBits form here) reads as gguf-py's dequantization, the plan keeps
    it float (None), and the summary says which type was dequantized and which kept."""
    from gguf.quants import dequantize

    model = gguf_model("llama", hidden_size=256, intermediate_size=256, head_dim=64)
    up = "model.layers.0.mlp.up_proj.weight"
    raw = _q3_k_raw(256, 256, np.random.default_rng(1))
    path, _ = write_model_gguf(
        model, tmp_path / "m.gguf", lambda n, w: T.Q8_0, extra={"blk.0.ffn_up.weight": (raw, T.Q3_K)}, skip=(up,)
    )
    source = source_of(open_gguf(read_header(path)))
    assert source.blocks.get(up) is None
    np.testing.assert_array_equal(source.get(up).numpy(), dequantize(raw, T.Q3_K))
    assert source.blocks.get("model.layers.0.mlp.down_proj.weight") is not None
    assert source.blocks.summary() == {"exact": {"Q8_0": 1}, "dequantized": {"Q3_K": 1}}


# --------------------------------------------------------------------------- refusals


def _refused(path, match: str, monkeypatch) -> str:
    """read_header's one-line FormatError, with every tensor read made to fail."""
    import os

    def no_read(*args, **kwargs):
        raise AssertionError("a tensor was read before the refusal")

    monkeypatch.setattr(os, "preadv", no_read)
    with pytest.raises(FormatError, match=match) as info:
        read_header(path)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_unsupported_architecture_is_refused_from_the_header(tmp_path, monkeypatch):
    from gguf import GGUFWriter

    writer = GGUFWriter(str(tmp_path / "f.gguf"), "falcon")
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        step()
    writer.close()
    message = _refused(tmp_path / "f.gguf", "architecture 'falcon' is not supported", monkeypatch)
    assert "gemma3" in message and "llama" in message  # the supported ones are named


def test_unreadable_type_and_rope_factors_are_refused_from_the_header(tmp_path, monkeypatch):
    model = gguf_model("llama")
    bad = np.zeros((4, 8), np.int32)
    path, _ = write_model_gguf(model, tmp_path / "i.gguf", extra={"blk.0.attn_q.scale": (bad, T.I32)})
    _refused(path, "has type I32, which cannot be read", monkeypatch)
    freqs = np.ones(16, np.float32)
    path, _ = write_model_gguf(model, tmp_path / "r.gguf", extra={"rope_freqs.weight": (freqs, T.F32)})
    _refused(path, "rope_freqs.weight", monkeypatch)


def test_a_tensor_with_no_parameter_is_refused_before_reading(tmp_path, monkeypatch):
    model = gguf_model("llama")
    path, _ = write_model_gguf(
        model, tmp_path / "x.gguf", extra={"blk.0.mystery.weight": (np.ones(4, np.float32), T.F32)}
    )
    header = read_header(path)
    monkeypatch.setattr("os.preadv", lambda *a: (_ for _ in ()).throw(AssertionError("read")))
    with pytest.raises(FormatError, match="'blk.0.mystery.weight' has no Hugging Face name for llama"):
        open_gguf(header)


# --------------------------------------------------------------------------- builds


def _q8(name: str, w: np.ndarray) -> T:
    return T.Q8_0 if w.shape[1] % 32 == 0 else T.F32


@pytest.mark.parametrize("precision, graph", [("gguf", "fused"), ("fp32", "fused"), ("fp32", "portable")])
def test_a_gemma3_gguf_builds_streamed(tmp_path, monkeypatch, precision, graph):
    """A Gemma 3 GGUF (Q8_0 blocks, tokenizer in the metadata) builds from its recipe without
    transformers' loader (made to fail): precision gguf keeps every block exactly, fp32 streams
    the dequantized weights (the traced portable form: loaded from the same source); all pass
    validation (build_artifact raises if not)."""
    import json

    from tiny import make_tokenizer, write_recipe

    from specexport.build import load as build_load
    from specexport.build.artifact import build_artifact
    from specexport.recipe.load import load_recipe

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded whole")

    monkeypatch.setattr(build_load, "load_model", refuse)
    path, held = write_model_gguf(gguf_model("gemma3_text"), tmp_path / "g3.gguf", _q8, tokenizer=make_tokenizer())
    draft = {"proposer": "ngram", "ngram_sizes": [3, 2, 1]}
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", path, draft, graph=graph, precision=precision))
    build_artifact(recipe, tmp_path / "a")
    target = json.loads((tmp_path / "a" / "manifest.json").read_text())["target"]
    assert target["precision"] == precision
    if precision == "gguf":  # every linear (and the tied embedding / head) as the file's Q8_0 blocks
        assert target["validation"]["weights"]["checkpoint_tensors"] == {"exact": {"Q8_0": len(held)}}


def test_the_cache_keeps_the_first_reads_within_its_budget(tmp_path):
    """Off (the default): every read dequantizes anew. With a budget: the first tensors read stay
    (the same object again), a tensor past the budget is read each time, values unchanged."""
    from specexport.models.gguf_source import GGUFSource

    model = gguf_model("llama")
    path, _ = write_model_gguf(model, tmp_path / "m.gguf", _mixed)
    header = read_header(path)
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    tied = {"lm_head.weight": "model.embed_tokens.weight"}
    up, down = "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight"
    off = GGUFSource(header, names, tied)
    assert off.get(up) is not off.get(up) and torch.equal(off.get(up), off.get(up))
    budget = off.get(up).nbytes  # room for exactly one [128, 64] float32 weight
    on = GGUFSource(header, names, tied, cache_bytes=budget)
    first = on.get(up)
    assert on.get(up) is first and on.get(down) is not on.get(down)
    assert torch.equal(on.get(down), off.get(down))
