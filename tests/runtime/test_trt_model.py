"""trt_backend.TrtModel through a CPU stand-in for TensorRT and cuda-python (tests/trt_fake.py):
its bindings of caches, ids, logits and the EAGLE-3 tensors (a target's hidden_states, a head's
features / draft_hidden inputs and hidden_out output), its profile choice and prefill chunks,
checked against engine.OrtModel on the same graphs and through the speculative loop. The fake
runs the ONNX graph on ONNX Runtime's CPU provider: this checks the backend's logic, not
TensorRT, and nothing here ran on a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import trt_fake

from specexport_runtime import contract
from specexport_runtime.api import SpecGenerator, load, open_artifact
from specexport_runtime.contract import GraphSpec
from specexport_runtime.engine import OrtModel, SessionConfig
from specexport_runtime.errors import ContractError, InvalidArgument
from specexport_runtime.manifest import read_manifest
from specexport_runtime.model import Model
from specexport_runtime.trt_backend import TrtModel, plan_row_tensors, prefill_chunks, prefill_limit
from specexport_runtime.trt_engines import default_profiles, input_shapes, profile_shapes

TOL = 1e-4  # the same float32 graph, prompt fed in chunks here and whole there
IDS = [17, 88, 203, 5, 61, 144, 9, 250, 33, 71, 120, 8, 199, 42, 66, 3, 91, 27, 150, 64]
HEAD = GraphSpec(1, 2, 16, 160, kind=contract.EAGLE3_HEAD, feature_width=96, hidden_width=32)
TARGET = GraphSpec(2, 2, 16, 320, feature_width=96)


# --------------------------------------------------------------------------- pure parts


def test_row_tensors_are_the_eagle3_names_of_the_contract():
    plain = GraphSpec(2, 2, 16, 320)
    core = set(plain.input_names()) | set(plain.output_names())
    for spec in (plain, TARGET, HEAD):
        tensors = plan_row_tensors(spec, max_seq=40, max_rows=9)
        names = set(spec.input_names()) | set(spec.output_names())
        layer_names = {n for n in names if n.endswith("_0") or n.endswith("_1")}
        assert {t.name for t in tensors} == names - core - layer_names
        for t in tensors:
            assert t.is_input == (t.name in spec.input_names())
            assert t.capacity == (9 if t.per_logits_row else 40)
    head = {t.name: t for t in plan_row_tensors(HEAD, 40, 9)}
    assert (head[contract.HEAD_FEATURES].width, head[contract.HEAD_HIDDEN].width) == (96, 32)
    assert head[contract.HEAD_HIDDEN_OUT].per_logits_row and head[contract.HEAD_HIDDEN_OUT].width == 32
    assert plan_row_tensors(TARGET, 40, 9)[0].width == 96


def test_head_engine_profiles_cover_its_row_inputs():
    assert input_shapes(HEAD, 5, 1, 7)[contract.HEAD_FEATURES] == (1, 5, 96)
    assert input_shapes(HEAD, 5, 1, 7)[contract.HEAD_HIDDEN] == (1, 5, 32)
    for profile in default_profiles(64, max_prompt=16):
        assert set(profile_shapes(HEAD, profile)) == set(HEAD.input_names())
        assert set(profile_shapes(TARGET, profile)) == set(TARGET.input_names())


def test_padded_graphs_get_a_two_row_prefill_profile():
    """A graph with min_rows 2 asks every prefill call for 2 logits rows (contract 1.2)."""
    decode, verify, prefill = default_profiles(256, max_prompt=64, max_gamma=8, min_rows=2)
    assert (decode.rows, verify.rows, prefill.rows) == ((1, 1, 1), (1, 5, 9), (1, 2, 2))
    assert prefill_limit([decode, verify, prefill], rows=2) == 64
    assert prefill_limit(default_profiles(256, 64, 8), rows=2) == 9  # engines built unpadded: verify's S
    assert prefill_limit(default_profiles(256, 64, 8)) == 64


def test_fused_layout_is_refused_before_tensorrt_is_imported():
    fused = GraphSpec(2, 2, 16, 320, kv_layout=contract.HEAD_MAJOR_INPLACE)
    with pytest.raises(ContractError, match="time_major"):
        TrtModel("unused.engine", fused, 64, default_profiles(64))


# --------------------------------------------------------------------------- through the fake


def _trt(monkeypatch, tmp_path, root, role: str, max_prompt: int = 8):
    """TrtModel of the artifact's `role` graph on the fake; prompts over max_prompt are chunked."""
    trt, cudart = trt_fake.install(monkeypatch)
    manifest = read_manifest(root)
    entry = getattr(manifest, role)
    spec, profiles = entry.graph_spec(), default_profiles(manifest.max_context, max_prompt, max_gamma=8)
    engine = trt_fake.write_engine(tmp_path / f"{role}.engine", root / entry.graph, spec, profiles)
    model = TrtModel(engine, spec, manifest.max_context, profiles, min_rows=entry.min_rows)
    return model, trt, cudart


def _ort(root, role: str) -> OrtModel:
    manifest = read_manifest(root)
    entry = getattr(manifest, role)
    return OrtModel(
        root / entry.graph,
        entry.graph_spec(),
        manifest.max_context,
        SessionConfig(threads=1),
        min_rows=entry.min_rows,
        cache_pad=entry.cache_pad,
    )


@pytest.fixture(scope="module")
def portable(tiny_artifacts):
    """A time_major target with hidden_states and a portable EAGLE-3 head."""
    return tiny_artifacts["eagle3-portable"]


def test_target_logits_and_features_match_ort(monkeypatch, tmp_path, portable):
    """A 20-token prompt in chunks of 8 (features of every chunk kept), a 4-row verify, rollback."""
    model, trt, _ = _trt(monkeypatch, tmp_path, portable, "target")
    ref = _ort(portable, "target")
    assert isinstance(model, Model) and isinstance(ref, Model)
    np.testing.assert_allclose(model.forward(IDS), ref.forward(IDS), atol=TOL, rtol=0)
    chunks = prefill_chunks(len(IDS), model.prefill_limit)
    assert len(chunks) > 1 and [c[contract.INPUT_IDS][1] for c in trt.engines[0].calls] == chunks
    assert model.features.shape == ref.features.shape == (20, model.spec.feature_width)
    np.testing.assert_allclose(model.features, ref.features, atol=TOL, rtol=0)
    assert model.last_start == ref.last_start == 0
    for m in (model, ref):
        m.truncate(15)
    got, want = model.forward(IDS[15:19], last_rows=4), ref.forward(IDS[15:19], last_rows=4)
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
    np.testing.assert_allclose(model.features, ref.features, atol=TOL, rtol=0)
    assert model.last_start == 15 and model.length == ref.length == 19 and model.free == ref.free
    model.close()


def test_head_rows_match_ort(monkeypatch, tmp_path, portable):
    """Catch-up from features (chunked), chained steps from hidden_out, truncate: logits and
    hidden_out equal OrtModel's on the same head graph."""
    target = _ort(portable, "target")
    target.forward(IDS)
    feats = target.features.copy()  # [20, F]
    model, _, cudart = _trt(monkeypatch, tmp_path, portable, "draft")
    ref = _ort(portable, "draft")
    for m in (model, ref):
        m.forward(IDS[1:13], features=feats[:12])  # 12 catch-up rows, in chunks
    np.testing.assert_allclose(model.hidden_out, ref.hidden_out, atol=TOL, rtol=0)
    assert model.hidden_out.shape == ref.hidden_out.shape == (1, model.spec.hidden_width)
    first = prefill_chunks(12, model.prefill_limit)[0]
    assert first < 12 and ("h2d", first * model.spec.feature_width * 4) in cudart.copies  # a chunk's features
    for token in (5, 9, 77):
        got = model.forward([token], hidden=model.hidden_out.copy())
        want = ref.forward([token], hidden=ref.hidden_out.copy())
        np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
        np.testing.assert_allclose(model.hidden_out, ref.hidden_out, atol=TOL, rtol=0)
    for m in (model, ref):
        m.truncate(12)
    got = model.forward(IDS[13:16], last_rows=3, features=feats[12:15])
    want = ref.forward(IDS[13:16], last_rows=3, features=feats[12:15])
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
    np.testing.assert_allclose(model.hidden_out, ref.hidden_out, atol=TOL, rtol=0)
    assert model.hidden_out.shape == (3, ref.hidden_out.shape[1]) and model.length == 15
    with pytest.raises(InvalidArgument, match="features must hold 2 rows"):
        model.forward([1, 2], features=feats[:3])
    model.close()


def test_eagle_generation_on_trt_models_equals_target_only(monkeypatch, tmp_path, portable):
    """The speculative loop and the eagle proposer on TrtModel target and head (the Model
    protocol): greedy output equals OrtModel target-only decoding."""
    want = load(portable).generate(IDS[:12], max_new_tokens=24, speculative=False).token_ids
    target, trt, _ = _trt(monkeypatch, tmp_path, portable, "target")
    head, _, _ = _trt(monkeypatch, tmp_path, portable, "draft")
    manifest, codec, calibration = open_artifact(portable)
    gen = SpecGenerator(
        root=portable, manifest=manifest, codec=codec, target=target, draft=head, calibration=calibration
    )
    result = gen.generate(IDS[:12], max_new_tokens=24, proposer="eagle", gamma=3)
    assert result.token_ids == want
    assert result.stats.rounds > 0 and result.stats.drafted > 0
    assert any(c["profile"] == 1 for c in trt.engines[0].calls)  # the target verified on the verify profile
    with pytest.raises(TypeError, match="model.Model"):
        SpecGenerator(root=portable, manifest=manifest, codec=codec, target=object(), calibration=calibration)


@pytest.mark.parametrize("prompt", [12, 20, 17])  # one prefill call; chunks of 16 + 4; 16 + 1
def test_padded_prefill_matches_ort(monkeypatch, tmp_path, portable, prompt):
    """A target with min_rows 2 (contract 1.2): every prefill call, each chunk too, gets >= 2 rows
    and asks for 2 logits rows, as OrtModel's are; the prefill profile covers them."""
    model, trt, _ = _trt(monkeypatch, tmp_path, portable, "target", max_prompt=16)
    ref = _ort(portable, "target")
    assert model.min_rows == ref.min_rows == 2
    np.testing.assert_allclose(model.forward(IDS[:prompt]), ref.forward(IDS[:prompt]), atol=TOL, rtol=0)
    np.testing.assert_allclose(model.features, ref.features, atol=TOL, rtol=0)
    calls = trt.engines[0].calls
    assert all(c[contract.INPUT_IDS][1] >= 2 and c[contract.LOGITS_INDEX] == (2,) for c in calls)
    assert model.length == prompt
    np.testing.assert_allclose(model.forward([42]), ref.forward([42]), atol=TOL, rtol=0)  # decode: [t, t], row 0 kept
