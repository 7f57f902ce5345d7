"""`specexport build` end to end on tiny models: what the artifact holds, atomicity, bad input.

The three artifacts of the session fixture `tiny_artifacts` (conftest.py: draft 'self', 'ngram',
'int8', built once and shared with the runtime tests) are inspected read-only; the atomicity and
bad-input tests build their own (n-gram recipes, well under a second each).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import yaml
from tiny import CHAT_TEMPLATE, make_model, make_tokenizer, save_hf_folder, write_recipe
from tokenizers import Tokenizer

import specexport.build.graphs as build_graphs
from specexport.build.artifact import OutputExists, build_artifact
from specexport.errors import BuildError, RecipeError, SpecExportError, TokenizerMismatch
from specexport.models.architectures import ARCHITECTURES, UnsupportedArchitecture
from specexport.models.sources import ModelSourceError
from specexport.models.tokcheck import tokenizer_hash
from specexport.recipe.load import load_recipe, parse_recipe
from specexport.recipe.reader import with_overrides
from specexport_runtime import contract
from specexport_runtime.manifest import SCHEMA_VERSION, read_manifest

NGRAM = {"proposer": "ngram", "ngram_sizes": [3, 2, 1]}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _session(path: Path) -> ort.InferenceSession:
    from specexport_runtime import engine

    opts = ort.SessionOptions()
    if getattr(engine, "_shared_pool_threads", None) is not None:  # see test_parity.plain_session
        opts.use_per_session_threads = False
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def _run_graph(path: Path, spec: contract.GraphSpec, ids: list[int]) -> np.ndarray:
    feeds = {
        contract.INPUT_IDS: np.asarray([ids], np.int64),
        contract.LOGITS_INDEX: np.asarray([len(ids) - 1], np.int64),
    }
    empty = np.zeros((1, 0, spec.num_kv_heads, spec.head_dim), np.float32)
    for name in spec.input_names()[2:]:
        feeds[name] = empty
    logits, *_ = _session(path).run(spec.output_names(), feeds)
    return logits


def _other_tokenizer():
    """Same specials and size as tiny.make_tokenizer, trained on other text: other ids."""
    corpus = [
        "Lorem ipsum dolor sit amet, consectetur adipiscing elit.",
        "SELECT * FROM t WHERE x > 10;",
        "Zebras quietly graze beside jagged volcanic mountains.",
    ]
    return make_tokenizer(corpus)


def _listing(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*"))


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return save_hf_folder(make_model("llama"), tmp_path_factory.mktemp("hf") / "target")


@pytest.fixture
def ngram_recipe(tmp_path, target_dir):
    return load_recipe(write_recipe(tmp_path / "recipe.yaml", target_dir, NGRAM))


# --------------------------------------------------------------------------- artifact contents


@pytest.mark.parametrize("kind", ["self", "ngram", "int8", "int8-fused", "ngram-numerical", "int8-fused-numerical"])
def test_manifest_and_files(kind, tiny_artifacts):
    root = tiny_artifacts[kind]
    raw = json.loads((root / "manifest.json").read_text(encoding="utf-8"))
    manifest = read_manifest(root)
    # the lowest contract version defining the artifact's layouts and fields: an unpadded target
    # (exactness numerical) keeps its layout's (portable 1.0, fused 1.1); a padded one needs 1.2
    layout = contract.HEAD_MAJOR_INPLACE if "-fused" in kind else contract.TIME_MAJOR
    numerical = kind.endswith("-numerical")
    expected = contract.version_for(layout) if numerical else contract.ROW_PADDING_VERSION
    assert raw["contract_version"] == manifest.contract_version == expected
    assert manifest.target.padded != numerical
    if not numerical:  # bitwise: the fused graph pads its attention, the portable one measured its calls
        assert manifest.target.exactness == "bitwise"
        assert (manifest.target.cache_pad == 1) == (layout == contract.HEAD_MAJOR_INPLACE)
    assert raw["target"]["kv_layout"] == manifest.target.kv_layout == layout
    if manifest.draft is not None:
        assert manifest.draft.kv_layout == layout
    assert raw["schema_version"] == manifest.schema_version == SCHEMA_VERSION
    assert manifest.name == f"tiny-{kind}" and manifest.max_context == 256

    # every file but the manifest is listed with its sha256 (recomputed here)
    on_disk = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and p.name != "manifest.json"}
    assert set(manifest.files) == on_disk
    for rel, digest in manifest.files.items():
        assert _sha256(root / rel) == digest, rel
    expected = {"tokenizer.json", "chat_template.jinja", "recipe.json", "target/model.onnx", "target/model.onnx.data"}
    if not kind.startswith("ngram"):
        expected |= {"draft/model.onnx", "draft/model.onnx.data"}
    assert on_disk == expected

    # models
    t = manifest.target
    assert (t.graph, t.architecture, t.num_layers, t.num_kv_heads, t.head_dim) == (
        "target/model.onnx",
        "llama",
        2,
        2,
        16,
    )
    assert (t.vocab_size, t.embedding_rows, t.precision, t.kv_dtype) == (300, 320, "fp32", "float32")
    assert t.source == str(root.parent / "target-hf")
    assert t.validation["max_abs_diff"] <= 1e-4 and t.validation["argmax_agreement"] == 1.0
    assert [s["step"] for s in t.validation["steps"]] == ["prefill", "verify", "rollback"]

    # tokenizer: the shipped file, its hash, the chat template, eos/bos
    tok = manifest.tokenizer
    assert tok.file == "tokenizer.json" and tok.chat_template == "chat_template.jinja"
    assert (root / "chat_template.jinja").read_text(encoding="utf-8") == CHAT_TEMPLATE
    assert tok.sha256 == tokenizer_hash(Tokenizer.from_file(str(root / "tokenizer.json")))
    assert tok.eos_token_ids == (2,) and tok.bos_token_id == 1 and tok.add_bos is False

    # the recipe, fully explicit, reads back to the one built from
    recipe = parse_recipe(json.loads((root / "recipe.json").read_text(encoding="utf-8")))
    assert recipe == load_recipe(root.parent / "recipe.yaml")
    assert set(manifest.tools) >= {"specexport", "torch", "transformers", "onnx", "onnxruntime"}


def test_draft_matches_the_recipe(tiny_artifacts):
    # 'self': a separate fp32 model (here the target's own folder), exported like a target
    m = read_manifest(tiny_artifacts["self"])
    assert m.speculation.proposer == "draft" and m.draft is not None
    assert (m.draft.precision, m.draft.kv_dtype, m.draft.source) == ("fp32", "float32", m.target.source)
    assert m.draft.validation["max_abs_diff"] <= 1e-4
    ops = {
        n.op_type
        for n in onnx.load(str(tiny_artifacts["self"] / "draft/model.onnx"), load_external_data=False).graph.node
    }
    assert not ops & {"MatMulNBits", "MatMulInteger", "DynamicQuantizeLinear"}

    # 'ngram': no draft graph at all
    root = tiny_artifacts["ngram"]
    m = read_manifest(root)
    assert m.draft is None and m.speculation.proposer == "ngram" and m.speculation.ngram_sizes == (3, 2, 1)
    assert not (root / "draft").exists()

    # 'int8': a weight-only 8-bit copy of the target; agreement reported, not required
    root = tiny_artifacts["int8"]
    m = read_manifest(root)
    assert m.speculation.proposer == "draft" and m.draft.precision == "int8"
    assert (m.draft.num_layers, m.draft.num_kv_heads, m.draft.embedding_rows) == (2, 2, 320)
    assert "note" in m.draft.validation and m.draft.validation["argmax_agreement"] > 0.5
    ops = {n.op_type for n in onnx.load(str(root / "draft/model.onnx"), load_external_data=False).graph.node}
    assert "MatMulNBits" in ops
    assert (root / "draft/model.onnx.data").stat().st_size < (root / "target/model.onnx.data").stat().st_size


@pytest.mark.parametrize("kind", ["self", "ngram", "int8"])
def test_graphs_run(kind, tiny_artifacts):
    from specexport_runtime.api import load

    root = tiny_artifacts[kind]
    m = read_manifest(root)
    entries = [m.target] + ([m.draft] if m.draft else [])
    outs = [_run_graph(root / e.graph, e.graph_spec(), [5, 17, 40]) for e in entries]
    for out in outs:
        assert out.shape == (1, 1, 320) and np.isfinite(out).all()
    # through the runtime: speculative greedy decoding gives the target-only tokens
    gen = load(root)
    spec = gen.generate("def add(a, b):", max_new_tokens=6)
    base = gen.generate("def add(a, b):", max_new_tokens=6, speculative=False)
    assert 1 <= len(spec.token_ids) <= 6 and spec.token_ids == base.token_ids


# --------------------------------------------------------------------------- atomicity


def test_existing_output_without_force(ngram_recipe, tmp_path):
    out = tmp_path / "artifact"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    before = _listing(tmp_path)
    with pytest.raises(OutputExists) as info:
        build_artifact(ngram_recipe, out)
    assert str(out) in str(info.value) and "--force" in str(info.value)
    assert _listing(tmp_path) == before and (out / "keep.txt").read_text() == "mine"


def test_force_replaces_the_output(ngram_recipe, tmp_path):
    out = tmp_path / "artifact"
    out.mkdir()
    (out / "old.txt").write_text("old")
    report = build_artifact(ngram_recipe, out, force=True)
    assert report.output == out
    assert not (out / "old.txt").exists() and (out / "manifest.json").is_file()
    read_manifest(out)
    # nothing but the recipe and the artifact in the parent: no temp, no '.artifact.old'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["artifact", "recipe.yaml"]
    # an existing *file* at the output path is refused even with force
    (tmp_path / "file").write_text("x")
    with pytest.raises(BuildError, match="not a folder"):
        build_artifact(ngram_recipe, tmp_path / "file", force=True)


@pytest.mark.parametrize("fail_in", ["validate_export", "build_decoder", "interrupt"])
def test_failure_midway_leaves_nothing(fail_in, tmp_path, target_dir, monkeypatch):
    """After the target export: validation fails / the draft export fails / Ctrl-C."""
    recipe = load_recipe(write_recipe(tmp_path / "recipe.yaml", target_dir, {"from_target": {"precision": "int8"}}))
    calls = {"build_decoder": 0, "validate_export": 0}
    real = {"build_decoder": build_graphs.build_decoder, "validate_export": build_graphs.validate_export}

    def wrap(name):
        def fn(*args, **kwargs):
            calls[name] += 1
            if fail_in == name and calls["build_decoder"] >= (1 if name == "validate_export" else 2):
                raise RuntimeError(f"injected failure in {name}")
            if fail_in == "interrupt" and name == "validate_export":
                raise KeyboardInterrupt
            return real[name](*args, **kwargs)

        return fn

    monkeypatch.setattr(build_graphs, "build_decoder", wrap("build_decoder"))
    monkeypatch.setattr(build_graphs, "validate_export", wrap("validate_export"))
    before = _listing(tmp_path)
    with pytest.raises(KeyboardInterrupt if fail_in == "interrupt" else RuntimeError):
        build_artifact(recipe, tmp_path / "artifact")
    assert calls["build_decoder"] >= 1  # the target was exported before the failure
    assert _listing(tmp_path) == before  # no output folder, no temp folder


def test_failure_with_force_keeps_the_old_artifact(ngram_recipe, tmp_path, monkeypatch):
    out = tmp_path / "artifact"
    build_artifact(ngram_recipe, out)
    digests = {rel: _sha256(out / rel) for rel in _listing(out) if (out / rel).is_file()}

    def boom(*args, **kwargs):
        raise RuntimeError("injected")

    monkeypatch.setattr(build_graphs, "validate_export", boom)
    with pytest.raises(RuntimeError):
        build_artifact(ngram_recipe, out, force=True)
    assert {rel: _sha256(out / rel) for rel in _listing(out) if (out / rel).is_file()} == digests
    assert sorted(p.name for p in tmp_path.iterdir()) == ["artifact", "recipe.yaml"]


# --------------------------------------------------------------------------- bad input


def _assert_clean(parent: Path, before: list[str]) -> None:
    assert _listing(parent) == before, "a failed build left files behind"


def test_missing_model_path(tmp_path):
    missing = tmp_path / "no-such-model"
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", missing, NGRAM))
    before = _listing(tmp_path)
    with pytest.raises(ModelSourceError) as info:
        build_artifact(recipe, tmp_path / "out")
    assert str(missing) in str(info.value) and "does not exist" in str(info.value)
    _assert_clean(tmp_path, before)


def test_folder_without_config(tmp_path):
    folder = tmp_path / "empty-model"
    folder.mkdir()
    (folder / "README.md").write_text("not a model")
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", folder, NGRAM))
    before = _listing(tmp_path)
    with pytest.raises(ModelSourceError) as info:
        build_artifact(recipe, tmp_path / "out")
    assert str(folder) in str(info.value) and "config.json" in str(info.value)
    _assert_clean(tmp_path, before)


def test_unsupported_architecture(tmp_path):
    import torch
    from transformers import OPTConfig, OPTForCausalLM

    config = OPTConfig(
        vocab_size=320,
        hidden_size=64,
        ffn_dim=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=512,
        word_embed_proj_dim=64,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    folder = save_hf_folder(OPTForCausalLM(config).eval(), tmp_path / "opt")
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", folder, NGRAM))
    before = _listing(tmp_path)
    with pytest.raises(UnsupportedArchitecture) as info:
        build_artifact(recipe, tmp_path / "out")
    message = str(info.value)
    assert "'opt'" in message and all(name in message for name in ARCHITECTURES)
    _assert_clean(tmp_path, before)


def test_incompatible_tokenizers(tmp_path, target_dir):
    draft = save_hf_folder(make_model("llama", seed=3), tmp_path / "draft", tokenizer=_other_tokenizer())
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", target_dir, {"model": str(draft), "precision": "fp32"}))
    before = _listing(tmp_path)
    with pytest.raises(TokenizerMismatch) as info:
        build_artifact(recipe, tmp_path / "out")
    message = str(info.value)
    assert message.startswith("tokenizers incompatible") and "vocab" in message
    _assert_clean(tmp_path, before)


def test_output_under_a_file_fails_cleanly(ngram_recipe, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    out = blocker / "artifact"
    before = _listing(tmp_path)
    with pytest.raises(BuildError) as info:
        build_artifact(ngram_recipe, out)
    assert str(out) in str(info.value) and "not writable" in str(info.value)
    _assert_clean(tmp_path, before)


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root can write into a 0o500 folder")
def test_unwritable_parent(ngram_recipe, tmp_path):
    parent = tmp_path / "locked"
    parent.mkdir()
    parent.chmod(0o500)
    try:
        with pytest.raises(BuildError, match="not writable"):
            build_artifact(ngram_recipe, parent / "artifact")
        assert list(parent.iterdir()) == []
    finally:
        parent.chmod(0o700)


def _recipe_file(tmp_path: Path, model: Path, **changes) -> Path:
    data = {"name": "tiny", "max_context": 256, "target": {"model": str(model), "precision": "fp32"}, "draft": NGRAM}
    data.update(changes)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def test_recipe_typo(tmp_path, target_dir):
    path = _recipe_file(tmp_path, target_dir, max_contxt=256)
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert "'max_contxt'" in str(info.value) and "did you mean 'max_context'" in str(info.value)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    "section,value,bad",
    [("target", {"precision": "int3"}, "int3"), ("draft", {"from_target": {"precision": "fp8"}}, "fp8")],
)
def test_unsupported_precision(section, value, bad, tmp_path, target_dir):
    changes = {"target": {"model": str(target_dir), **value}} if section == "target" else {"draft": value}
    with pytest.raises(RecipeError) as info:
        load_recipe(_recipe_file(tmp_path, target_dir, **changes))
    assert repr(bad) in str(info.value) and "allowed values" in str(info.value)
    assert isinstance(info.value, SpecExportError)


def test_fp16_target_with_fp16_self_draft(tmp_path, target_dir):
    """A recipe with an fp16 target and an fp16 self-draft builds (validated against the fp32
    reference at the fp16 tolerance), records float16 caches, and greedy speculation equals
    target-only decoding on the fp16 graphs (fp16 without dynamic quantization is batch-invariant
    enough here; the runtime binds float16 KV buffers)."""
    from specexport_runtime.api import load

    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", target_dir, {"from_target": {"precision": "fp16"}}))
    recipe = with_overrides(recipe, {"target.precision": "fp16"})
    build_artifact(recipe, tmp_path / "art")
    manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
    assert manifest["target"]["precision"] == "fp16" and manifest["target"]["kv_dtype"] == "float16"
    assert manifest["draft"]["kv_dtype"] == "float16"
    assert manifest["target"]["validation"]["max_abs_diff"] <= 5e-2
    gen = load(tmp_path / "art")
    assert gen.target._buffers[0].dtype == np.float16
    base = gen.generate("def add(a, b):", max_new_tokens=40, speculative=False)
    spec = gen.generate("def add(a, b):", max_new_tokens=40, gamma=4)
    assert spec.token_ids == base.token_ids
    assert spec.stats.accepted == spec.stats.drafted > 0  # the draft is the same fp16 graph
