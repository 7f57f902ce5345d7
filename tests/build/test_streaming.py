"""Streamed builds: a safetensors checkpoint read tensor by tensor gives the same graph, byte for
byte, as the same checkpoint loaded whole by transformers, and its lazy reference the same logits;
a tied head reads the embedding whatever the file holds; the data file is written as the graph is
(big tensors external, mmap-aligned); a checkpoint whose names are not the model's is loaded whole."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import onnx
import pytest
import torch
from tiny import make_model, make_tokenizer, save_hf_folder, tiny_config, write_recipe

from specexport.build.artifact import build_artifact
from specexport.build.validate import reference_logits
from specexport.errors import BuildError
from specexport.graphs.decoder import build_decoder
from specexport.graphs.quantized_target import QuantizedWeights
from specexport.graphs.writer import ALIGN, ALIGN_FROM, INLINE_BYTES
from specexport.models.config import read_config
from specexport.models.streaming import SafetensorsSource, open_streamed, source_of
from specexport.recipe.load import load_recipe

MAX_CONTEXT = 128
FAMILIES = ["llama", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3_text", "smollm3", "granite", "olmo2"]


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _loaded(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_graph_is_the_loaded_models_byte_for_byte(tmp_path, family):
    folder = save_hf_folder(make_model(family), tmp_path / "hf")
    streamed = open_streamed(folder, read_config(str(folder)))
    a = build_decoder(streamed, tmp_path / "s", MAX_CONTEXT, pad_attention=True)
    b = build_decoder(_loaded(folder), tmp_path / "l", MAX_CONTEXT, pad_attention=True)
    assert _sha(a.path.with_name("model.onnx.data")) == _sha(b.path.with_name("model.onnx.data"))
    assert _sha(a.path) == _sha(b.path)
    assert all(p.device.type == "meta" for p in streamed.parameters())  # nothing stayed loaded


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "phi3"])
def test_streamed_reference_gives_the_loaded_models_logits(tmp_path, family):
    folder = save_hf_folder(make_model(family), tmp_path / "hf")
    ids = [int(i) for i in np.random.default_rng(0).integers(3, 300, 24)]
    streamed = open_streamed(folder, read_config(str(folder)))
    got = reference_logits(streamed, ids)
    assert np.array_equal(got, reference_logits(_loaded(folder), ids))
    assert all(p.device.type == "meta" for p in streamed.parameters())


def test_quantized_weights_stream_like_loaded_ones(tmp_path):
    folder = save_hf_folder(make_model("llama"), tmp_path / "hf")
    plan = QuantizedWeights("int4", 32, 4, "int8", "fp32", {})
    a = build_decoder(open_streamed(folder, read_config(str(folder))), tmp_path / "s", MAX_CONTEXT, weights=plan)
    b = build_decoder(_loaded(folder), tmp_path / "l", MAX_CONTEXT, weights=plan)
    assert _sha(a.path.with_name("model.onnx.data")) == _sha(b.path.with_name("model.onnx.data"))


def test_a_tied_head_is_the_embedding_unless_the_file_holds_its_own(tmp_path):
    """tie_word_embeddings: a head the checkpoint lacks reads the embedding; one it holds with other
    values is used untied, as transformers 5 loads it; the streamed graph and reference follow."""
    from safetensors.torch import load_file, save_file

    folder = save_hf_folder(make_model("llama"), tmp_path / "hf")  # tie_word_embeddings: true
    tensors = load_file(folder / "model.safetensors")
    assert "lm_head.weight" not in tensors
    assert source_of(open_streamed(folder, read_config(str(folder)))).canonical("lm_head.weight") == (
        "model.embed_tokens.weight"
    )
    tensors["lm_head.weight"] = torch.randn_like(tensors["model.embed_tokens.weight"])
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    streamed = open_streamed(folder, read_config(str(folder)))
    assert source_of(streamed).canonical("lm_head.weight") == "lm_head.weight"
    loaded = _loaded(folder)
    a = build_decoder(streamed, tmp_path / "s", MAX_CONTEXT)  # a fresh skeleton: its head is tied to the table
    b = build_decoder(loaded, tmp_path / "l", MAX_CONTEXT)
    assert _sha(a.path.with_name("model.onnx.data")) == _sha(b.path.with_name("model.onnx.data"))
    ids = [5, 17, 42, 99, 7, 3]
    assert np.array_equal(reference_logits(streamed, ids), reference_logits(loaded, ids))


def test_the_writer_streams_big_tensors_to_aligned_offsets(tmp_path):
    folder = save_hf_folder(make_model("llama", vocab_size=4096, hidden_size=128), tmp_path / "hf")
    result = build_decoder(open_streamed(folder, read_config(str(folder))), tmp_path / "g", MAX_CONTEXT)
    proto = onnx.load(str(result.path), load_external_data=False)
    sizes = {}
    for t in proto.graph.initializer:
        n = int(np.prod(t.dims)) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
        external = t.data_location == onnx.TensorProto.EXTERNAL
        assert external == (n > INLINE_BYTES), t.name
        if external:
            info = {e.key: e.value for e in t.external_data}
            sizes[t.name] = (int(info["offset"]), int(info["length"]))
            assert int(info["length"]) == n
            if n >= ALIGN_FROM:
                assert int(info["offset"]) % ALIGN == 0, t.name
    assert any(n >= ALIGN_FROM for _, n in sizes.values())  # the [4096, 128] fp32 embedding
    end = max(o + n for o, n in sizes.values())
    assert end == result.path.with_name("model.onnx.data").stat().st_size


def test_unmatched_names_are_refused_for_streaming(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = save_hf_folder(make_model("llama"), tmp_path / "hf")
    tensors = {f"language_model.{k}": v for k, v in load_file(folder / "model.safetensors").items()}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(BuildError, match="cannot be streamed"):
        open_streamed(folder, read_config(str(folder)))


def test_sharded_checkpoints_are_read_through_their_index(tmp_path):
    model = make_model("qwen3")
    folder = tmp_path / "hf"
    model.save_pretrained(folder, max_shard_size="100KB")
    make_tokenizer().save_pretrained(folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    source = SafetensorsSource(folder)
    for name, p in model.named_parameters():
        assert torch.equal(source.get(name), p.detach())


def test_a_fused_folder_build_streams_and_validates(tmp_path):
    """A fused recipe over a safetensors folder streams its target (the build says so), and the
    manifest's validation equals that of the same checkpoint loaded whole (the portable form)."""
    tok = make_tokenizer()
    folder = save_hf_folder(make_model("qwen3"), tmp_path / "hf", tok)
    recipe = load_recipe(
        write_recipe(
            tmp_path / "r.yaml", folder, {"from_target": {"precision": "int8"}}, graph="fused", max_context=MAX_CONTEXT
        )
    )
    lines: list[str] = []
    build_artifact(recipe, tmp_path / "a", progress=lines.append)
    assert any("streaming the weights" in line for line in lines)
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["target"]["validation"]["max_abs_diff"] < 1e-4
    assert manifest["draft"]["validation"]["argmax_agreement"] > 0.5
    assert tiny_config("qwen3").num_hidden_layers == manifest["target"]["num_layers"]


@pytest.mark.parametrize("bits, symmetric", [(4, True), (8, True), (4, False)])
def test_round_to_nearest_in_row_chunks_equals_one_pass(monkeypatch, bits, symmetric):
    """rtn_quantize bounds its temporaries by quantizing a big weight in row chunks; the codes,
    scales and zero points are those of one pass over the whole weight."""
    from specexport.formats import blocks

    w = np.random.default_rng(bits).standard_normal((300, 256)).astype(np.float32)
    whole = blocks.rtn_quantize(w, bits, 32, symmetric)
    monkeypatch.setattr(blocks, "CHUNK_VALUES", 256 * 7)  # 7 rows at a time, a ragged last chunk
    chunked = blocks.rtn_quantize(w, bits, 32, symmetric)
    assert np.array_equal(whole.q, chunked.q) and np.array_equal(whole.scale, chunked.scale)
    assert (whole.zero is None) == (chunked.zero is None)
    if whole.zero is not None:
        assert np.array_equal(whole.zero, chunked.zero)


def _wide_phi3():
    """Phi-4-mini's head shape (head_dim 128, rotary 96) at hidden 512: wide enough that
    transformers' own fp32 logits are ~2e-4 from float64, past the fixed 1e-4 floor."""
    return make_model(
        "phi3",
        hidden_size=512,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=128,
        intermediate_size=1024,
        num_hidden_layers=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75},
    )


def test_the_fp32_bound_follows_the_references_own_error(tmp_path):
    """A wide model's fp32 graph differs from the fp32 reference by more than a fixed 1e-4 but by
    no more than a few times transformers' own fp32 error against float64: the derived bound
    passes it, the fixed one would refuse it, and a graph off by a real error still fails."""
    from specexport.build.validate import FP32, ExportValidationError, Tolerance, validate_export

    model = _wide_phi3()
    ids = [int(i) for i in np.random.default_rng(0).integers(3, 300, 40)]
    graph = build_decoder(model, tmp_path / "g", MAX_CONTEXT)
    report = validate_export(model, graph.path, graph.spec, ids, FP32)
    assert all(s.reference_error > 0 and s.max_abs_diff <= s.bound for s in report.steps)
    assert max(s.bound for s in report.steps) > 1e-4  # the reference's own error is past the fixed floor
    fixed = Tolerance(max_abs=1e-4, rel=5e-6)
    if report.max_abs_diff > max(fixed.bound(s.reference_scale, 0.0) for s in report.steps):
        with pytest.raises(ExportValidationError):  # 3.3e-4 on the AMD EPYC here: the floor alone refuses it
            validate_export(model, graph.path, graph.spec, ids, fixed)
    with torch.no_grad():  # a graph 1% off in one weight: a bug the bound must still catch
        model.model.layers[1].mlp.down_proj.weight.mul_(1.01)
    broken = build_decoder(model, tmp_path / "b", MAX_CONTEXT)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.div_(1.01)
    with pytest.raises(ExportValidationError, match="fp32 reference's error"):
        validate_export(model, broken.path, broken.spec, ids, FP32)


def test_float64_forwards_leave_the_reference_as_it_was(tmp_path):
    from specexport.build.validate import float64_logits

    folder = save_hf_folder(make_model("llama"), tmp_path / "hf")
    ids = [5, 17, 42, 99, 7, 3]
    for model in (_loaded(folder), open_streamed(folder, read_config(str(folder)))):
        before = reference_logits(model, ids)
        exact = float64_logits(model, ids)
        assert exact.dtype == np.float64 and 0 < np.abs(exact - before).max() < 1e-4
        assert np.array_equal(reference_logits(model, ids), before)  # back to float32, bit for bit


@pytest.mark.slow  # ~11 s: the benchmark script end to end
def test_random_checkpoint_script_writes_a_streamable_folder_that_builds(tmp_path):
    """benchmarks/random_checkpoint.py, dry: its tiny shape's folder (fp16 shards, the default
    model's tokenizer, recipes) builds with its fp32 + int8 recipe, streamed."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "random_checkpoint.py"
    spec = importlib.util.spec_from_file_location("bench_random_checkpoint", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "ckpt"
    assert script.main(["tiny", "-o", str(out)]) == 0
    with pytest.raises(SystemExit, match="not empty"):
        script.main(["tiny", "-o", str(out)])
    lines: list[str] = []
    build_artifact(load_recipe(out / "fp32-int8.yaml"), tmp_path / "a", progress=lines.append)
    assert any("streaming the weights" in line for line in lines)
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["target"]["embedding_rows"] == 49152 and manifest["draft"]["precision"] == "int8"


def test_build_memory_script_places_the_peak_in_a_stage(tmp_path, capsys):
    """benchmarks/build_memory.py, dry, on a tiny folder recipe: one line per progress message
    with its RSS and the peak so far, ending with done."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "build_memory.py"
    spec = importlib.util.spec_from_file_location("bench_build_memory", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    folder = save_hf_folder(make_model("llama"), tmp_path / "hf")
    recipe = write_recipe(tmp_path / "r.yaml", folder, {"proposer": "ngram"}, graph="fused", max_context=MAX_CONTEXT)
    assert script.main([str(recipe), "-o", str(tmp_path / "a"), "--no-validate"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert any("streaming the weights" in line for line in lines) and lines[-1].endswith("done")
    peaks = [float(line.split("peak")[1].split("GB")[0]) for line in lines]
    assert peaks == sorted(peaks) and peaks[-1] > 0
    with pytest.raises(SystemExit, match="--interval"):
        script.main([str(recipe), "-o", str(tmp_path / "b"), "--interval", "0"])


def _counting(model) -> dict[str, int]:
    """Count the source's reads by name (the writer reads every weight through source.get)."""
    source, reads = source_of(model), {}
    real = source.get

    def get(name):
        reads[name] = reads.get(name, 0) + 1
        return real(name)

    source.get = get
    return reads


def test_each_weight_is_read_once_and_a_tied_head_never(tmp_path):
    folder = save_hf_folder(make_model("llama"), tmp_path / "hf")  # tied: the file has no lm_head
    streamed = open_streamed(folder, read_config(str(folder)))
    reads = _counting(streamed)
    build_decoder(streamed, tmp_path / "g", MAX_CONTEXT)
    assert reads["model.embed_tokens.weight"] == 1  # the head is a Gemm on the stored table
    assert "lm_head.weight" not in reads
    assert set(reads.values()) == {1}


def test_a_checkpoint_plan_reads_no_float_copy_of_the_blocks_it_keeps(tmp_path):
    folder = save_hf_folder(make_model("llama"), tmp_path / "hf")
    streamed = open_streamed(folder, read_config(str(folder)))
    kept = "model.layers.0.mlp.down_proj.weight"
    blocks = {kept: QuantizedWeights("int4", 32, 4, "fp32", "fp32", {})._rtn(_part(streamed, kept), 4)}
    reads = _counting(streamed)
    plan = QuantizedWeights("gptq", 32, 4, "fp32", "fp32", blocks)  # a checkpoint plan: blocks as given
    build_decoder(streamed, tmp_path / "g", MAX_CONTEXT, weights=plan)
    assert kept not in reads  # MatMulNBits from the blocks; no dequantized float read
    assert reads["model.layers.0.mlp.up_proj.weight"] == 1  # the others are read as floats, once


def _part(model, name: str):
    from specexport.models.streaming import Part

    return Part(name, tuple(source_of(model).get(name).shape), lambda: source_of(model).get(name))


def test_a_hub_id_streams_from_its_snapshot_folder(tmp_path, monkeypatch):
    """A float hub checkpoint is read from huggingface_hub's snapshot (safetensors and json
    only), tensor by tensor; the download is replaced here (no network)."""
    import huggingface_hub

    from specexport.build.load import _load_float
    from specexport.build.progress import quiet
    from specexport.models import sources
    from specexport.models.streaming import is_streamed

    folder = save_hf_folder(make_model("llama"), tmp_path / "hf")
    asked = {}

    def fake_download(repo_id, revision=None, allow_patterns=None):
        asked.update(repo_id=repo_id, patterns=allow_patterns)
        return str(folder)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", "org/tiny", {"proposer": "ngram"}))
    model = _load_float(sources.resolve_source("org/tiny"), recipe.target, recipe, quiet)
    assert is_streamed(model) and all(p.device.type == "meta" for p in model.parameters())
    assert asked == {"repo_id": "org/tiny", "patterns": sources.SNAPSHOT_FILES}  # no pickles fetched
