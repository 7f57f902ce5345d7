"""GPTQ / AWQ checkpoint loaders (specexport/formats/gptq.py, awq.py, hf_quantized.py).

The checkpoints are quantized and packed here, from the format descriptions, without the
modules under test: GPTQ packs codes low-first into int32 words along K (qweight [K / per, N])
and zero points along N (qzeros [groups, N / per]), storing zero - 1 in the v1 "gptq" format;
AWQ GEMM packs codes and zero points along N, nibble i of word c holding column
8c + [0, 2, 4, 6, 1, 3, 5, 7][i]. The test's reference weight is
float32(scale)[g(k), n] * (q[k, n] - zero[g(k), n]) in float32, computed from its own codes;
the product of an fp16 scale (11 significant bits) and an integer below 256 (8 bits) is exact
in float32, so loaded weights must match it exactly (no ulp tolerance needed).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from quantized_checkpoints import VARIANTS, RefLayer, awq_interleave, gptq_tensors, pack, write_checkpoint
from safetensors.numpy import load_file, save_file
from tiny import make_model, make_tokenizer

from specexport.formats.awq import awq_blocks
from specexport.formats.blocks import FormatError
from specexport.formats.gptq import gptq_blocks
from specexport.formats.hf_quantized import load_quantized_folder, quantization_method


@pytest.fixture(scope="module")
def tiny():
    return make_model("llama")  # hidden 64, intermediate 128, tied embeddings


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny, tokenizer):
    """Lazily written and loaded checkpoints by variant name: (Checkpoint, QuantizedCheckpoint)."""

    class Lazy(dict):
        def __missing__(self, name: str):
            ckpt = write_checkpoint(tmp_path_factory.mktemp(name) / "hf", tiny, tokenizer, VARIANTS[name])
            self[name] = (ckpt, load_quantized_folder(ckpt.folder))
            return self[name]

    return Lazy()


# ---------------------------------------------------------------- (a) blocks, (b) logits


@pytest.mark.parametrize("name", list(VARIANTS))
def test_blocks_equal_reference(checkpoints, name):
    ckpt, loaded = checkpoints[name]
    variant = VARIANTS[name]
    assert (loaded.method, loaded.bits, loaded.group_size) == (variant.method, variant.bits, variant.group)
    assert sorted(loaded.blocks) == sorted(ckpt.refs)
    for param, ref in ckpt.refs.items():
        block = loaded.blocks[param]
        np.testing.assert_array_equal(block.dequantize(), ref.weight(), err_msg=param)
        np.testing.assert_array_equal(block.q, ref.q.T, err_msg=param)  # the checkpoint's codes, unchanged
        assert block.block == (ref.q.shape[0] if variant.group == -1 else variant.group)
        if variant.sym:
            assert block.zero is None  # all 2**(bits-1): MatMulNBits's default
        if not variant.act_order:
            assert block.g_idx is None
        torch.testing.assert_close(loaded.model.get_parameter(param), torch.from_numpy(ref.weight()), rtol=0, atol=0)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_equal_reference_model(checkpoints, name):
    ckpt, loaded = checkpoints[name]
    ids = torch.tensor([[1, 17, 42, 99, 5, 250, 7, 3]])
    with torch.no_grad():
        got = loaded.model(ids).logits
        want = ckpt.reference.eval()(ids).logits
    assert loaded.model.dtype == torch.float32
    assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight  # tied
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


# ---------------------------------------------------------------- (c) act-order


def test_act_order_in_order_is_the_same_product(checkpoints):
    ckpt, loaded = checkpoints["gptq-v1-4bit-g16-actorder"]
    x = np.random.default_rng(1).standard_normal((3, 128)).astype(np.float32)
    for param, ref in ckpt.refs.items():
        block = loaded.blocks[param]
        np.testing.assert_array_equal(block.g_idx, ref.g_idx)
        ordered, perm = block.in_order()
        assert perm is not None and ordered.g_idx is None
        xk = x[:, : block.shape[1]]
        np.testing.assert_allclose(xk[:, perm] @ ordered.dequantize().T, xk @ ref.weight().T, rtol=0, atol=1e-5)


# ---------------------------------------------------------------- (d) bad inputs


def _rewrite(folder: Path, qconfig: dict | None = None, drop: str | None = None) -> None:
    if qconfig is not None:
        config = json.loads((folder / "config.json").read_text())
        config["quantization_config"].update(qconfig)
        (folder / "config.json").write_text(json.dumps(config))
    if drop is not None:
        tensors = load_file(str(folder / "model.safetensors"))
        del tensors[drop]
        save_file(tensors, str(folder / "model.safetensors"))


def _fresh(tmp_path, tiny, tokenizer, name: str) -> Path:
    return write_checkpoint(tmp_path / name, tiny, tokenizer, VARIANTS[name]).folder


def test_bits_3_is_refused(tmp_path, tiny, tokenizer):
    folder = _fresh(tmp_path, tiny, tokenizer, "gptq-v1-4bit-g32")
    _rewrite(folder, {"bits": 3})
    with pytest.raises(FormatError, match="bits 3"):
        load_quantized_folder(folder)


def test_awq_gemv_is_refused(tmp_path, tiny, tokenizer):
    folder = _fresh(tmp_path, tiny, tokenizer, "awq-gemm-4bit-g32")
    _rewrite(folder, {"version": "GEMV"})
    with pytest.raises(FormatError, match="'gemv'"):
        load_quantized_folder(folder)


@pytest.mark.parametrize("name", ["gptq-v1-4bit-g32", "awq-gemm-4bit-g32"])
def test_missing_qzeros_is_named(tmp_path, tiny, tokenizer, name):
    folder = _fresh(tmp_path, tiny, tokenizer, name)
    _rewrite(folder, drop="model.layers.1.mlp.up_proj.qzeros")
    with pytest.raises(FormatError, match=r"model\.layers\.1\.mlp\.up_proj\.qzeros"):
        load_quantized_folder(folder)


def test_missing_plain_tensor_is_named(tmp_path, tiny, tokenizer):
    folder = _fresh(tmp_path, tiny, tokenizer, "gptq-v1-4bit-g32")
    _rewrite(folder, drop="model.layers.0.input_layernorm.weight")
    with pytest.raises(FormatError, match=r"model\.layers\.0\.input_layernorm\.weight"):
        load_quantized_folder(folder)


def test_quantization_method(tmp_path, tiny, tokenizer, checkpoints):
    assert quantization_method(checkpoints["gptq-v1-4bit-g32"][0].folder) == "gptq"
    assert quantization_method(checkpoints["awq-gemm-4bit-g32"][0].folder) == "awq"
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert quantization_method(plain) is None


def _one_layer(K: int, N: int = 16, bits: int = 4, group: int = 16, zero: int = 3, fmt: str = "gptq") -> dict:
    """Tensors of a single GPTQ layer "l" with constant codes and zero points."""
    G = 1 if group == -1 else K // group
    ref = RefLayer(
        q=np.full((K, N), 5, np.uint8),
        zero=np.full((G, N), zero, np.int64),
        scale=np.full((G, N), 0.5, np.float16),
        g_idx=np.zeros(K, np.int32),
    )
    return {f"l.{k}": v for k, v in gptq_tensors(ref, bits, fmt, with_g_idx=False).items()}


def test_gptq_group_all_of_k_needs_a_power_of_two():
    config = {"bits": 4, "group_size": -1, "checkpoint_format": "gptq"}
    assert gptq_blocks(_one_layer(64, group=-1), config)["l.weight"].block == 64
    with pytest.raises(FormatError, match="K = 48"):
        gptq_blocks(_one_layer(48, group=-1), config)


def test_gptq_v1_zero_point_overflow_and_sym_mismatch():
    # zero 16 cannot be stored (stored 15 = all ones under v1 would mean zero 16)
    overflow = _one_layer(32)
    overflow["l.qzeros"] = np.full_like(overflow["l.qzeros"], -1)  # every stored nibble 0xF
    with pytest.raises(FormatError, match=r"l\.qzeros"):
        gptq_blocks(overflow, {"bits": 4, "group_size": 16})
    # a v2 checkpoint (zero 8 stored as 8) mislabelled v1 reads zero 9: sym catches it
    v2 = _one_layer(32, zero=8, fmt="gptq_v2")
    with pytest.raises(FormatError, match="sym is true"):
        gptq_blocks(v2, {"bits": 4, "group_size": 16, "sym": True, "checkpoint_format": "gptq"})
    assert (
        gptq_blocks(v2, {"bits": 4, "group_size": 16, "sym": True, "checkpoint_format": "gptq_v2"})["l.weight"].zero
        is None
    )


def test_awq_unpacks_the_interleaved_order():
    codes = np.arange(16, dtype=np.uint8)[None].repeat(16, 0) % 16  # [K=16, N=16]: column n holds code n
    tensors = {
        "l.qweight": pack(awq_interleave(codes), 4, axis=1),
        "l.qzeros": pack(awq_interleave(np.zeros((1, 16), np.uint8)), 4, axis=1),
        "l.scales": np.ones((1, 16), np.float16),
    }
    block = awq_blocks(tensors, {"bits": 4, "group_size": 16, "version": "gemm"})["l.weight"]
    np.testing.assert_array_equal(block.q[:, 0], np.arange(16))  # row n = output n: code n
    with pytest.raises(FormatError, match="bits 8"):
        awq_blocks(tensors, {"bits": 8, "group_size": 16})


def test_packing_conventions_on_a_literal_word():
    """0x76543210 holds nibble i = i: GPTQ reads it low-first along K, AWQ as columns in AWQ_ORDER."""
    word = np.array([[0x76543210]], np.int32)
    scales = np.ones((1, 8), np.float16)
    gptq = gptq_blocks(
        {
            "l.qweight": np.repeat(word, 2, 0).repeat(8, 1),  # [K/8 = 2, N = 8]: K = 16
            "l.qzeros": np.array([[0x77777777]], np.int32),
            "l.scales": scales,
        },
        {"bits": 4, "group_size": 16, "sym": True},
    )["l.weight"]
    np.testing.assert_array_equal(gptq.q[0], [0, 1, 2, 3, 4, 5, 6, 7] * 2)  # output 0, inputs k = 0..15
    awq = awq_blocks(
        {
            "l.qweight": np.repeat(word, 16, 0),  # [K = 16, N / 8 = 1]
            "l.qzeros": np.zeros((1, 1), np.int32),
            "l.scales": scales,
        },
        {"bits": 4, "group_size": 16, "version": "gemm"},
    )["l.weight"]
    np.testing.assert_array_equal(awq.q[:, 0], [0, 4, 1, 5, 2, 6, 3, 7])  # outputs n = 0..7, input 0


def test_unexpected_tensor_is_named(tmp_path, tiny, tokenizer):
    folder = _fresh(tmp_path, tiny, tokenizer, "awq-gemm-4bit-g32")
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.0.mlp.extra.weight"] = np.zeros(4, np.float16)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(FormatError, match=r"model\.layers\.0\.mlp\.extra\.weight"):
        load_quantized_folder(folder)
