"""GGUF blocks (specexport/formats/gguf.py): every supported type against gguf-py's dequantize,
names / orientation / q-k row order against transformers' own GGUF loader, the real SmolLM2 file.

The reference everywhere is independent of the module under test: raw bytes come from
gguf.quants.quantize (legacy types) or are assembled here field by field (K-quants), values
from gguf.quants.dequantize, and whole-model weights from transformers loading the same file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize
from quantized_checkpoints import (
    HEAD_DIM,
    HEADS,
    HF,
    HIDDEN,
    K_QUANTS,
    KV_HEADS,
    LEGACY,
    _f16_bytes,
    raw_of,
    unpermute,
    write_gguf,
    write_tiny_gguf,
)

from specexport.errors import SpecExportError
from specexport.formats.blocks import BlockQuantized, FormatError
from specexport.formats.gguf import decode_blocks
from specexport.models.gguf_source import read_gguf_blocks

# type -> (bits, block, zero point, has an offset) promised by the module docstring
FORM = {
    T.Q4_0: (4, 32, 8, False),
    T.Q4_1: (4, 32, 0, True),
    T.Q5_0: (8, 32, 16, False),
    T.Q5_1: (8, 32, 0, True),
    T.Q8_0: (8, 32, 128, False),
    T.Q4_K: (4, 32, 0, True),
    T.Q5_K: (8, 32, 0, True),
    T.Q6_K: (8, 16, 32, False),
}

# --- 1. every type, tensor level ------------------------------------------------------------


@pytest.mark.parametrize("qtype", LEGACY + K_QUANTS, ids=lambda t: t.name)
def test_type_matches_gguf_dequantize(qtype):
    """dequantize() equals gguf-py's reference bit for bit: scale = d or d * sc (fp16 times an
    integer < 256, exact in float32) and offset = m or -(dmin * m) (exact), so both sides round
    the same single product and the same single sum."""
    rng = np.random.default_rng(int(qtype))
    raw = raw_of(qtype, 24, 512, rng)
    w = decode_blocks(raw, qtype)
    bits, block, zero, has_offset = FORM[qtype]
    assert (w.shape, w.bits, w.block, w.offset is not None) == ((24, 512), bits, block, has_offset)
    assert np.all(w.zeros() == zero) and w.scale.dtype == np.float32
    np.testing.assert_array_equal(w.dequantize(), gguf_dequantize(raw, qtype))


@pytest.mark.parametrize("qtype", LEGACY + K_QUANTS, ids=lambda t: t.name)
def test_codes_cover_their_range(qtype):
    """Codes are the format's own (5- and 6-bit codes widened to 8 bits, not rescaled)."""
    w = decode_blocks(raw_of(qtype, 64, 512, np.random.default_rng(7)), qtype)
    width = {T.Q5_0: 5, T.Q5_1: 5, T.Q5_K: 5, T.Q6_K: 6}.get(qtype, w.bits)
    top = int(w.q.max())
    assert top < 1 << width and top >= (1 << width) - 2


# --- 2. a tiny llama GGUF file against transformers' loader ---------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    """(tiny llama GGUF, expected HF-order float32 weights by HF name): quantized_checkpoints."""
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf"))


def test_file_names_orientation_and_rows(tiny):
    path, expected = tiny
    blocks = read_gguf_blocks(path)
    assert sorted(blocks) == sorted(expected)  # F32 norms left out, output -> lm_head
    for name, value in expected.items():
        assert blocks[name].shape == value.shape, name  # [out, in]
        np.testing.assert_array_equal(blocks[name].dequantize(), value, err_msg=name)


def test_file_matches_transformers(tiny):
    """transformers' GGUF loader (gguf-py dequantize + its own _reverse_permute_weights)
    produces the same fp32 weights, q / k rows included."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    path, expected = tiny
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    params = dict(model.named_parameters())
    blocks = read_gguf_blocks(path)
    for name, w in blocks.items():
        np.testing.assert_array_equal(w.dequantize(), params[name].detach().numpy(), err_msg=name)
    assert len(blocks) == len(expected)


def test_names_filter(tiny):
    path, _ = tiny
    wanted = ["model.layers.1.self_attn.k_proj.weight", "lm_head.weight", "model.norm.weight", "not.a.weight"]
    blocks = read_gguf_blocks(path, names=wanted)
    assert sorted(blocks) == ["lm_head.weight", "model.layers.1.self_attn.k_proj.weight"]


def test_qk_rows_are_unpermuted_only_for_llama(tmp_path):
    rng = np.random.default_rng(3)
    q = raw_of(T.Q8_0, HIDDEN, HIDDEN, rng)
    k = raw_of(T.Q4_1, KV_HEADS * HEAD_DIM, HIDDEN, rng)
    tensors = {"blk.0.attn_q.weight": (q, T.Q8_0), "blk.0.attn_k.weight": (k, T.Q4_1)}
    file_q, file_k = gguf_dequantize(q, T.Q8_0), gguf_dequantize(k, T.Q4_1)
    for arch, permuted in (("llama", True), ("qwen2", False), ("qwen3", False)):
        blocks = read_gguf_blocks(write_gguf(tmp_path / f"{arch}.gguf", arch, tensors))
        got_q = blocks["model.layers.0.self_attn.q_proj.weight"].dequantize()
        got_k = blocks["model.layers.0.self_attn.k_proj.weight"].dequantize()
        np.testing.assert_array_equal(got_q, unpermute(file_q, HEADS) if permuted else file_q, err_msg=arch)
        np.testing.assert_array_equal(got_k, unpermute(file_k, KV_HEADS) if permuted else file_k, err_msg=arch)
        assert permuted != np.array_equal(got_q, file_q)


# --- 4. bad input ---------------------------------------------------------------------------


def test_unsupported_architecture(tmp_path):
    raw = raw_of(T.Q8_0, 8, 64, np.random.default_rng(0))
    path = write_gguf(tmp_path / "gpt2.gguf", "gpt2", {"token_embd.weight": (raw, T.Q8_0)})
    message = r"architecture 'gpt2' is not supported \(supported: falcon-h1, gemma, gemma2, gemma3, granite, "
    with pytest.raises(FormatError, match=message) as info:
        read_gguf_blocks(path)
    assert isinstance(info.value, SpecExportError) and "\n" not in str(info.value)


def test_unsupported_type(tmp_path):
    rng = np.random.default_rng(0)
    q2k = rng.integers(0, 256, (8, 84), dtype=np.uint8)  # one Q2_K super-block per row; its values are not read
    q2k[:, 80:84] = _f16_bytes(np.full((8, 2), 1e-3)).reshape(8, 4)
    tensors = {"blk.0.attn_v.weight": (q2k, T.Q2_K), "blk.0.attn_q.weight": (raw_of(T.Q8_0, 256, 256, rng), T.Q8_0)}
    path = write_gguf(tmp_path / "q2k.gguf", "llama", tensors)
    with pytest.raises(FormatError, match=r"'blk\.0\.attn_v\.weight' has type Q2_K.*supported: Q4_0, .*Q6_K") as info:
        read_gguf_blocks(path)
    assert "\n" not in str(info.value)
    # a type the caller does not ask for is not an error
    assert list(read_gguf_blocks(path, names=["model.layers.0.self_attn.q_proj.weight"])) == [
        "model.layers.0.self_attn.q_proj.weight"
    ]
    with pytest.raises(FormatError, match="GGUF type Q2_K has no exact block form"):
        decode_blocks(q2k, T.Q2_K)


def test_unknown_quantized_tensor(tmp_path):
    raw = raw_of(T.Q8_0, 8, 64, np.random.default_rng(0))
    path = write_gguf(tmp_path / "fused.gguf", "llama", {"blk.0.attn_qkv.weight": (raw, T.Q8_0)})
    with pytest.raises(FormatError, match=r"'blk\.0\.attn_qkv\.weight' has no Hugging Face name for llama"):
        read_gguf_blocks(path)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(FormatError, match="is not a readable GGUF file"):
        read_gguf_blocks(path)


# --- 3. the real SmolLM2 file ---------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2() -> tuple[dict[str, BlockQuantized], dict[str, np.ndarray], int]:
    """(all blocks of the builtin Q4_1 GGUF, transformers' fp32 parameters, layer count)."""
    from specexport.models.sources import ModelSourceError, fetch_builtin, load_model, resolve_source

    try:
        fetch_builtin("smollm2-135m-instruct")
    except ModelSourceError as exc:
        pytest.skip(f"default model unavailable: {exc}")
    source = resolve_source("builtin:smollm2-135m-instruct")
    blocks = read_gguf_blocks(Path(source.location) / source.gguf_file)
    model = load_model(source, "float32")
    params = {name: p.detach().numpy() for name, p in model.named_parameters()}
    return blocks, params, model.config.num_hidden_layers


@pytest.mark.real
@pytest.mark.slow  # ~40 s: transformers reads the whole GGUF; the real artifact tests read the same blocks
def test_smollm2_blocks_equal_transformers(smollm2):
    blocks, params, layers = smollm2
    assert len(blocks) == 7 * layers + 1  # Q4_1 projections + the Q8_0 embedding
    assert "lm_head.weight" not in blocks  # tied: the file has no output.weight
    assert {(w.bits, w.block, w.offset is not None) for w in blocks.values()} == {(4, 32, True), (8, 32, False)}
    for i in (0, layers - 1):
        for part in HF.values():
            name = f"model.layers.{i}.{part}.weight"
            np.testing.assert_array_equal(blocks[name].dequantize(), params[name], err_msg=name)
    np.testing.assert_array_equal(blocks["model.embed_tokens.weight"].dequantize(), params["model.embed_tokens.weight"])
