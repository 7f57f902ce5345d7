"""GPTQ / AWQ folders streamed tensor by tensor (specexport/models/quantized_source.py).

The checkpoints are quantized and packed by the tests (tests/quantized_checkpoints.py, from the
format descriptions); the reference weight of each Linear is the test's own float32
scale * (q - zero), which the streamed source must give exactly, and the reference model the
tiny model holding those weights. Nothing may read the folder whole.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from quantized_checkpoints import VARIANTS, write_checkpoint
from tiny import make_model, make_tokenizer

from specexport.build.validate import reference_logits
from specexport.errors import BuildError
from specexport.formats.blocks import FormatError
from specexport.models import sources
from specexport.models.quantized_source import open_quantized
from specexport.models.streaming import is_streamed, source_of


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Checkpoints by variant name, written once each."""
    model, tok = make_model("llama"), make_tokenizer()

    class Lazy(dict):
        def __missing__(self, name: str):
            self[name] = write_checkpoint(tmp_path_factory.mktemp(name) / "hf", model, tok, VARIANTS[name])
            return self[name]

    return Lazy()


@pytest.fixture
def no_whole_reads(monkeypatch):
    """Reading a whole safetensors file (the loaded path) fails the test."""
    import safetensors.torch

    from specexport.formats import hf_quantized

    def refuse(*args, **kwargs):
        raise AssertionError("the folder was read whole")

    monkeypatch.setattr(safetensors.torch, "load_file", refuse)
    monkeypatch.setattr(hf_quantized, "read_safetensors", refuse)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_streamed_weights_and_logits_are_the_checkpoints(written, name, no_whole_reads):
    ckpt = written[name]
    model = open_quantized(ckpt.folder)
    source = source_of(model)
    assert is_streamed(model) and sorted(source.blocks) == sorted(ckpt.refs)
    for pname, ref in ckpt.refs.items():
        np.testing.assert_array_equal(source.blocks[pname].dequantize(), ref.weight(), err_msg=pname)
        assert torch.equal(source.get(pname), torch.from_numpy(ref.weight())), pname
    ids = [int(i) for i in np.random.default_rng(0).integers(3, 300, 16)]
    ref = reference_logits(ckpt.reference, ids)
    got = reference_logits(model, ids)
    assert np.abs(got - ref).max() <= 1e-5 * max(1.0, float(np.abs(ref).max()))
    assert all(p.device.type == "meta" for p in model.parameters())


def test_load_blocks_streams_a_gptq_folder(written, no_whole_reads):
    ckpt = written["gptq-v1-4bit-g32"]
    model, blocks = sources.load_blocks(sources.ModelSource("folder", str(ckpt.folder)), "gptq")
    assert is_streamed(model) and len(blocks) == len(ckpt.refs)


def test_a_tensor_with_no_place_is_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    ckpt = write_checkpoint(tmp_path / "hf", make_model("llama"), make_tokenizer(), VARIANTS["awq-gemm-4bit-g32"])
    tensors = load_file(str(ckpt.folder / "model.safetensors"))
    tensors["model.layers.0.mlp.extra.weight"] = np.ones(4, np.float32)
    save_file(tensors, str(ckpt.folder / "model.safetensors"))
    with pytest.raises(FormatError, match="no place for: \\['model.layers.0.mlp.extra.weight'\\]"):
        open_quantized(ckpt.folder)
    del tensors["model.layers.0.mlp.extra.weight"], tensors["model.norm.weight"]
    save_file(tensors, str(ckpt.folder / "model.safetensors"))
    with pytest.raises(BuildError, match="no tensor for parameter 'model.norm.weight'"):
        open_quantized(ckpt.folder)
