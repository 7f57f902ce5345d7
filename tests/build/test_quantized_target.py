"""Quantized targets (specexport/graphs/quantized_target.py, nbits.py): graphs holding a checkpoint's
own blocks compute what the checkpoint holds, and greedy speculation on them equals target-only
decoding bit for bit.

References are independent of the code under test: the GGUF file's weights are dequantized by
gguf-py and loaded by transformers; the GPTQ / AWQ checkpoints are packed and dequantized by
the test (tests/quantized_checkpoints.py). With accuracy_level 1 MatMulNBits computes in
float32, so the graph matches the reference to float32 summation noise (FP32_TOL); with level 4
its activations are quantized to 8 bits per block and only agreement is reported.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from quantized_checkpoints import VARIANTS, write_checkpoint, write_tiny_gguf
from tiny import make_model, make_tokenizer, save_hf_folder, write_recipe

from specexport.build.artifact import build_artifact
from specexport.build.graphs import BITWISE_FUSED
from specexport.build.validate import FeedRunner, reference_logits
from specexport.formats.hf_quantized import load_quantized_folder
from specexport.graphs.decoder import build_decoder
from specexport.graphs.quantized_target import QuantizedWeights
from specexport.models.gguf_source import read_gguf_blocks
from specexport.recipe.load import RecipeError, load_recipe, parse_recipe
from specexport.recipe.reader import with_overrides
from specexport_runtime.manifest import read_manifest

FP32_TOL = 2e-4  # |logit| diff bound at accuracy_level 1 (float32 sums in another order)


def graph_logits(
    model, weights: QuantizedWeights, out: Path, ids: list[int], pad_attention: bool = False
) -> np.ndarray:
    """Rows of a prefill and a 5-token verify call of the fused graph: [len(ids), V]."""
    result = build_decoder(model, out, 128, weights=weights, pad_attention=pad_attention)
    runner = FeedRunner(result.path, result.spec)
    n0 = len(ids) - 5
    return np.concatenate([runner.run(ids[:n0], list(range(n0))), runner.run(ids[n0:], list(range(5)))])


# --------------------------------------------------------------------------- GGUF blocks


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory):
    """(tiny llama GGUF with every supported type, transformers' float32 model of it)."""
    from transformers import AutoModelForCausalLM

    path, _ = write_tiny_gguf(tmp_path_factory.mktemp("gguf"))
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    return path, model


@pytest.mark.parametrize("embedding, pad_attention", [("checkpoint", False), ("fp32", False), ("fp32", True)])
def test_gguf_blocks_compute_the_file(gguf_model, tmp_path, embedding, pad_attention):
    """All GGUF types (Q4_0/1, Q5_0/1, Q8_0, Q4_K, Q5_K, Q6_K; offsets, 8-bit zero points,
    block 16) as MatMulNBits at accuracy_level 1, the Q6_K head and the Q8_0 embedding
    (GatherBlockQuantized) from the checkpoint: the logits of transformers' model of the file,
    with and without padded attention (contract 1.2)."""
    path, model = gguf_model
    blocks = read_gguf_blocks(path)
    weights = QuantizedWeights("gguf", 32, 1, "checkpoint", embedding, blocks)
    ids = [int(i) for i in np.random.default_rng(0).integers(0, model.config.vocab_size, 20)]
    got = graph_logits(model, weights, tmp_path / "g", ids, pad_attention)
    ref = reference_logits(model, ids)
    assert np.abs(got - ref).max() < FP32_TOL * max(1.0, np.abs(ref).max())
    assert (got.argmax(-1) == ref.argmax(-1)).all()


def test_gguf_int8_activations_agree(gguf_model, tmp_path):
    """accuracy_level 4 quantizes activations: close to the file's model, not equal."""
    path, model = gguf_model
    weights = QuantizedWeights("gguf", 32, 4, "checkpoint", "fp32", read_gguf_blocks(path))
    ids = [int(i) for i in np.random.default_rng(1).integers(0, model.config.vocab_size, 20)]
    got, ref = graph_logits(model, weights, tmp_path / "g", ids), reference_logits(model, ids)
    scale = np.abs(ref).max()
    assert 0 < np.abs(got - ref).max() < 0.1 * scale
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.8


# --------------------------------------------------------------------------- GPTQ / AWQ


@pytest.mark.parametrize("name", list(VARIANTS))
def test_gptq_awq_blocks_compute_the_checkpoint(tmp_path, name):
    """Each checkpoint variant (GPTQ v1/v2, 4/8-bit, one group over K, act-order; AWQ GEMM) as
    MatMulNBits at accuracy_level 1: the logits of the test's own dequantized model."""
    checkpoint = write_checkpoint(tmp_path / "ckpt", make_model("llama"), make_tokenizer(), VARIANTS[name])
    loaded = load_quantized_folder(checkpoint.folder)
    weights = QuantizedWeights(loaded.method, 32, 1, "fp32", "fp32", loaded.blocks)
    ids = [int(i) for i in np.random.default_rng(2).integers(0, 300, 20)]
    got = graph_logits(loaded.model, weights, tmp_path / "g", ids)
    ref = reference_logits(checkpoint.reference.float().eval(), ids)
    assert np.abs(got - ref).max() < FP32_TOL * max(1.0, np.abs(ref).max())
    assert (got.argmax(-1) == ref.argmax(-1)).all()


def test_gptq_recipe_builds_with_the_checkpoint_blocks(tmp_path):
    """A recipe with precision gptq builds from the folder (no optimum / auto-gptq) and its
    manifest records the precision, the weights' storage and bitwise exactness."""
    checkpoint = write_checkpoint(
        tmp_path / "ckpt", make_model("llama"), make_tokenizer(), VARIANTS["gptq-v1-4bit-g32"]
    )
    recipe = load_recipe(
        write_recipe(
            tmp_path / "r.yaml",
            checkpoint.folder,
            {"proposer": "ngram", "ngram_sizes": [3, 2, 1]},
            name="tiny-gptq",
            graph="fused",
            precision="gptq",
        )
    )
    build_artifact(recipe, tmp_path / "a")
    target = json.loads((tmp_path / "a" / "manifest.json").read_text())["target"]
    assert target["precision"] == "gptq" and target["exactness"] == "bitwise"
    # the cheapest padding that measures bitwise on this CPU: padded attention (1-row calls) where
    # GroupQueryAttention's 1-row path agrees with its many-row one, else padded calls
    assert (target["min_rows"], target["cache_pad"]) in [(p.min_rows, p.cache_pad) for p in BITWISE_FUSED]
    assert target["validation"]["rows"]["max_abs_diff"] == 0.0
    assert target["validation"]["weights"] == {
        "accuracy_level": 4,
        "block_size": None,
        "embedding": "fp32",
        "head": "checkpoint",
    }


# --------------------------------------------------------------------------- exactness


PROMPTS = ["def add(a, b):", "The quick brown fox", "for i in range(10):\n", '{"name": "spec']


@pytest.mark.parametrize("kind", ["int4-target", "int8-target"])
def test_greedy_speculation_equals_target_only_bit_for_bit(gens, kind):
    gen = gens(kind)
    assert gen.manifest.target.exactness == "bitwise"
    for prompt in PROMPTS:
        off = gen.generate(prompt, max_new_tokens=48, speculative=False)
        for gamma in (None, 3, 8):
            on = gen.generate(prompt, max_new_tokens=48, proposer="ngram", gamma=gamma)
            assert on.token_ids == off.token_ids, (prompt, gamma)


def test_numerical_exactness_keeps_one_row_calls(tmp_path):
    """exactness numerical: no padding, and the row check still runs and records what it
    measured."""
    target = save_hf_folder(make_model("llama"), tmp_path / "hf")
    recipe = load_recipe(
        write_recipe(
            tmp_path / "r.yaml",
            target,
            {"proposer": "ngram", "ngram_sizes": [3, 2, 1]},
            name="tiny-int4-numerical",
            graph="fused",
            precision="int4",
        )
    )
    recipe = with_overrides(recipe, {"target.exactness": "numerical"})
    build_artifact(recipe, tmp_path / "a")
    data = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert "min_rows" not in data["target"] and "cache_pad" not in data["target"]
    assert data["contract_version"] == "1.1"  # unpadded: a 1.1 artifact
    rows = data["target"]["validation"]["rows"]
    assert rows["min_rows"] == 1 and read_manifest(tmp_path / "a").target.exactness == rows["exactness"]


def test_fp16_quantized_target(tmp_path):
    """dtype fp16 (for the CUDA provider): fp16 activations, scales and cache around the int4
    weights; close to the float32 model, padded rows bitwise, greedy on == off."""
    from specexport_runtime.api import load

    target = save_hf_folder(make_model("llama"), tmp_path / "hf")
    recipe = load_recipe(
        write_recipe(
            tmp_path / "r.yaml",
            target,
            {"proposer": "ngram", "ngram_sizes": [3, 2, 1]},
            name="tiny-int4-fp16",
            graph="fused",
            precision="int4",
        )
    )
    report = build_artifact(with_overrides(recipe, {"target.quantization": {"dtype": "fp16"}}), tmp_path / "a")
    entry = report.manifest.target
    assert entry.kv_dtype == "float16" and entry.exactness == "bitwise"
    assert entry.validation["argmax_agreement"] >= 0.5  # int4 weights on a random tiny model
    gen = load(tmp_path / "a")
    for prompt in PROMPTS[:2]:
        off = gen.generate(prompt, max_new_tokens=32, speculative=False)
        assert gen.generate(prompt, max_new_tokens=32, proposer="ngram").token_ids == off.token_ids


# --------------------------------------------------------------------------- recipes


def _recipe(target: dict, graph: str = "fused") -> dict:
    return {
        "name": "q",
        "max_context": 256,
        "graph": graph,
        "target": {"model": "org/m", **target},
        "draft": {"proposer": "ngram"},
    }


def test_recipe_defaults_for_quantized_targets():
    r = parse_recipe(_recipe({"precision": "int4"}))
    assert r.target.quantization.to_dict() == {
        "block_size": 32,
        "accuracy_level": 4,
        "head": "int8",
        "embedding": "fp32",
        "dtype": "fp32",
    }
    assert r.target.exactness == "bitwise"
    g = parse_recipe(_recipe({"model": "m.gguf", "precision": "gguf"}))
    assert g.target.quantization.head == "checkpoint" and g.target.quantization.block_size is None
    f = parse_recipe(_recipe({"precision": "fp32"}))
    assert f.target.quantization is None and f.target.exactness == "bitwise"
    assert parse_recipe(r.to_dict()) == r and parse_recipe(g.to_dict()) == g


@pytest.mark.parametrize(
    "target, graph, needles",
    [
        (
            {"precision": "int4", "quantization": {"block_size": 24}},
            "fused",
            ["block_size = 24", "16, 32, 64, 128, 256"],
        ),
        ({"precision": "int4", "quantization": {"accuracy_level": 5}}, "fused", ["accuracy_level = 5", "0..4"]),
        (
            {"precision": "int4", "quantization": {"head": "checkpoint"}},
            "fused",
            ["head = 'checkpoint'", "fp32, int8, int4"],
        ),
        ({"precision": "int4", "quantization": {"bits": 4}}, "fused", ["unknown key 'bits'", "block_size"]),
        ({"precision": "fp32", "quantization": {}}, "fused", ["target.quantization is set", "'fp32'"]),
        (
            {"model": "m.gguf", "precision": "gguf", "quantization": {"block_size": 32}},
            "fused",
            ["block_size is set", "gguf"],
        ),
        ({"precision": "gguf"}, "fused", ["'gguf'", "not a GGUF source"]),
        ({"model": "m.gguf", "precision": "gptq"}, "fused", ["'gptq'", "Hugging Face folder"]),
        ({"precision": "int8"}, "portable", ["needs graph: fused", "'portable'"]),
        ({"precision": "int8", "exactness": "exact"}, "fused", ["exactness = 'exact'", "bitwise, numerical"]),
        ({"precision": "int8", "quantization": {"dtype": "bf16"}}, "fused", ["dtype = 'bf16'", "fp32, fp16"]),
    ],
)
def test_recipe_errors(target, graph, needles):
    with pytest.raises(RecipeError) as info:
        parse_recipe(_recipe(target, graph), "bad.yaml")
    message = str(info.value)
    assert message.startswith("bad.yaml:") and "\n" not in message
    for needle in needles:
        assert needle in message, (needle, message)


# --------------------------------------------------------------------------- the real model


@pytest.mark.real
@pytest.mark.slow  # two real Q4 builds, ~90 s: the tiny int4 targets cover the padding by default
def test_real_q4_recipe_is_bitwise_exact(tmp_path_factory):
    """smollm2-135m-q4: the GGUF's own Q4_1 / Q8_0 blocks; greedy n-gram speculation equals
    target-only decoding token for token on chat prompts, and the manifest says bitwise. The
    same recipe unpadded (exactness numerical) measures rows that differ between call sizes:
    the padding is what makes it exact."""
    from specexport.recipe.load import resolve_recipe
    from specexport_runtime.api import load

    recipe = load_recipe(resolve_recipe("smollm2-135m-q4"))
    unpadded = build_artifact(
        with_overrides(recipe, {"target.exactness": "numerical"}), tmp_path_factory.mktemp("q4n") / "a"
    ).manifest.target
    assert unpadded.exactness == "numerical" and unpadded.validation["rows"]["max_abs_diff"] > 0.1
    out = tmp_path_factory.mktemp("q4") / "a"
    report = build_artifact(recipe, out)
    target = report.manifest.target
    assert (target.precision, target.exactness) == ("gguf", "bitwise")
    assert (target.min_rows, target.cache_pad) in [(p.min_rows, p.cache_pad) for p in BITWISE_FUSED]
    assert target.validation["argmax_agreement"] >= 0.9  # int8 activations vs the float32 model of the file
    gen = load(out)
    for text in [
        "Write a Python function that reverses a string.",
        "What is the capital of France?",
        "List three uses of a paperclip.",
    ]:
        ids = gen.codec.encode_chat([{"role": "user", "content": text}])
        off = gen.generate(ids, max_new_tokens=64, speculative=False)
        on = gen.generate(ids, max_new_tokens=64, proposer="ngram")
        assert on.token_ids == off.token_ids, text


def test_hub_checkpoint_is_fetched_as_a_snapshot(tmp_path, monkeypatch):
    """A hub id with precision awq is read from huggingface_hub's snapshot folder (safetensors
    and json only); the download itself is replaced here (no network)."""
    import huggingface_hub

    from specexport.models import sources

    checkpoint = write_checkpoint(
        tmp_path / "ckpt", make_model("llama"), make_tokenizer(), VARIANTS["awq-gemm-4bit-g32"]
    )
    asked = {}

    def fake_download(repo_id, revision=None, allow_patterns=None):
        asked.update(repo_id=repo_id, revision=revision, patterns=allow_patterns)
        return str(checkpoint.folder)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    model, blocks = sources.load_blocks(sources.resolve_source("org/tiny-awq", revision="main"), "awq")
    assert asked == {"repo_id": "org/tiny-awq", "revision": "main", "patterns": sources.SNAPSHOT_FILES}
    assert not any(p.endswith((".bin", ".pt", ".pth")) for p in asked["patterns"])
    assert len(blocks) == 14 and model.config.model_type == "llama"
    with pytest.raises(sources.ModelSourceError, match="holds awq"):
        sources.load_blocks(sources.resolve_source("org/tiny-awq"), "gptq")
