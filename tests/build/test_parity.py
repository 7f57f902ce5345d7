"""Parity of exported graphs with transformers, for every registered architecture.

Each family's tiny random model (tests/tiny.TINY_CONFIGS) is exported once per module and checked
  * with specexport.build.validate.validate_export at the FP32 tolerance (prefill, multi-token verify on
    the past, 1-token step after a 2-position rollback), and
  * independently of all specexport code paths that run graphs: a plain onnxruntime session fed
    with numpy arrays, a prompt in 3 uneven chunks, every row compared with transformers' logits.
Plus: the graph interface against the contract (names, dtypes, symbolic S/P/R), grouped-query
attention kept in the cache, a tied embedding stored once, Mistral's sliding window, negative
tests (a perturbed graph or a different reference model must fail validation), an fp16 export.

`pytest -s tests/build/test_parity.py` prints the measured max |diff| per architecture.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, numpy_helper
from tiny import TINY_CONFIGS, export_portable, fp32_bound, make_model, perturbed_copy, tiny_names

from specexport.build.validate import FP16, FP32, ExportValidationError, FeedRunner, validate_export
from specexport.graphs.writer import DATA_NAME, GRAPH_NAME
from specexport.models.architectures import ARCHITECTURES
from specexport.models.config import text_config
from specexport_runtime import contract

ARCHS = sorted(TINY_CONFIGS)
NAMES = tiny_names()  # families and their feature variants (tests/tiny.TINY_VARIANTS)
N_PROBE = 40  # > the tiny Mistral window (16), so windowed attention is exercised
CHUNKS = (13, 1, 26)  # uneven: a prefill, a single-token step, a long step on a 14-row past
MEASURED: dict[str, dict[str, float]] = {}  # arch -> step -> max |diff|, printed at module end


def probe_ids(n: int = N_PROBE, seed: int = 0) -> list[int]:
    """Deterministic token ids inside the tokenizer range (3..299; 0-2 are specials)."""
    return np.random.default_rng(seed).integers(3, 300, size=n).tolist()


def hf_logits(model, ids: list[int]) -> np.ndarray:
    """transformers full-sequence forward without a cache: [len(ids), V] float32."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float().numpy()


def plain_session(path: Path) -> ort.InferenceSession:
    """An onnxruntime CPU session made here, not by specexport_runtime.

    Once specexport_runtime has created its process-wide thread pool, onnxruntime refuses any
    session with per-session threads (see test_plain_session_after_runtime_pool), so such a
    session has to join that pool."""
    from specexport_runtime import engine

    opts = ort.SessionOptions()
    if getattr(engine, "_shared_pool_threads", None) is not None:
        opts.use_per_session_threads = False
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def empty_past(spec: contract.GraphSpec, dtype=np.float32) -> list[np.ndarray]:
    return [np.zeros((1, 0, spec.num_kv_heads, spec.head_dim), dtype) for _ in range(2 * spec.num_layers)]


def run_plain(session, spec, past, ids, rows, states=None):
    """One call with numpy feeds -> (logits, the new K/V rows); a hybrid's (feature
    recurrent_state) `states` dict position -> state tensors is read at the past's length and
    gets the state after each of the call's rows."""
    feeds = {contract.INPUT_IDS: np.asarray([ids], np.int64), contract.LOGITS_INDEX: np.asarray(rows, np.int64)}
    for i in range(spec.num_layers):
        feeds[contract.past_key(i)] = past[2 * i]
        feeds[contract.past_value(i)] = past[2 * i + 1]
    P = past[0].shape[1]
    if spec.states:
        feeds[contract.STATE_INDEX] = np.arange(len(ids), dtype=np.int64)
        before = states.get(P) if states else [np.zeros((1, *shape), np.float32) for shape in spec.states]
        for j, state in enumerate(before):
            feeds[contract.past_state(j)] = state
    names = spec.output_names()
    out = dict(zip(names, session.run(names, feeds)))
    new = [out[n] for n in names[1:] if not n.startswith("new_state_")]
    if spec.states and states is not None:
        for r in range(len(ids)):
            states[P + r + 1] = [out[contract.new_state(j)][:, r] for j in range(len(spec.states))]
    return out[contract.LOGITS], new


def _states_of(config, layer_type: str) -> list[tuple[int, ...]]:
    """The recurrent state shapes of one layer, from the transformers config: LFM2's conv window
    [L - 1, hidden]; a Gated DeltaNet's conv window [L - 1, 2 Hk dk + Hv dv] and state [Hv, dk, dv];
    a Mamba2 mixer's conv window [L - 1, I + 2 G N] and scan state [H, P, N]."""
    if layer_type == "conv":
        return [(config.conv_L_cache - 1, config.hidden_size)]
    if layer_type == "linear_attention" and hasattr(config, "linear_num_key_heads"):  # Gated DeltaNet
        hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
        dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
        return [(config.linear_conv_kernel_dim - 1, 2 * hk * dk + hv * dv), (hv, dk, dv)]
    if layer_type in ("linear_attention", "hybrid"):  # Mamba2, by Granite 4.0-H's / Falcon-H1's or Nemotron-H's names

        def get(*names):
            return next(getattr(config, n) for n in names if getattr(config, n, None) is not None)

        heads, head_dim = get("mamba_n_heads", "mamba_num_heads"), get("mamba_d_head", "mamba_head_dim")
        # inner width heads x head_dim (Falcon-H1's mamba_d_ssm, Granite's expand x hidden agree with it)
        gn = get("mamba_n_groups", "n_groups") * get("mamba_d_state", "ssm_state_size")
        state = get("mamba_d_state", "ssm_state_size")
        return [(get("mamba_d_conv", "conv_kernel") - 1, heads * head_dim + 2 * gn), (heads, head_dim, state)]
    return []


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """arch -> (transformers model, ExportResult); each arch exported once (lazily)."""
    cache: dict = {}

    def get(arch: str):
        if arch not in cache:
            model = make_model(arch)
            cache[arch] = (model, export_portable(model, tmp_path_factory.mktemp(f"parity-{arch}")))
        return cache[arch]

    yield get
    if MEASURED:
        print("\n\nFP32 parity with transformers, max |logit diff| (tolerance 1e-4):")
        print(f"{'arch':<11}{'prefill':>11}{'verify':>11}{'rollback':>11}{'3 chunks':>11}")
        for arch in sorted(MEASURED):
            m = MEASURED[arch]
            print(
                f"{arch:<11}"
                + "".join(f"{m.get(k, float('nan')):>11.2e}" for k in ("prefill", "verify", "rollback", "chunks"))
            )


def test_every_registered_architecture_has_a_parity_test():
    missing = sorted(set(ARCHITECTURES) - set(TINY_CONFIGS))
    assert not missing, (
        f"architectures {missing} are registered in specexport.models.architectures.ARCHITECTURES but have no tiny "
        "config in tests/tiny.TINY_CONFIGS, so no parity test: add one"
    )
    unknown = sorted(set(TINY_CONFIGS) - set(ARCHITECTURES))
    assert not unknown, f"TINY_CONFIGS has entries for unregistered architectures {unknown}"


@pytest.mark.parametrize("arch", NAMES)
def test_validate_export_fp32(arch, exported):
    model, res = exported(arch)
    report = validate_export(model, res.path, res.spec, probe_ids(), FP32)
    assert [s.step for s in report.steps] == ["prefill", "verify", "rollback"]
    assert [s.rows for s in report.steps] == [N_PROBE - 5, 5, 1]
    for step in report.steps:
        assert step.max_abs_diff <= FP32.max_abs, step
        assert step.argmax_agreement == 1.0, step
        MEASURED.setdefault(arch, {})[step.step] = step.max_abs_diff


@pytest.mark.parametrize("arch", ARCHS)
def test_plain_onnxruntime_three_uneven_chunks(arch, exported):
    """Independent of specexport's runners: numpy feeds, cache grown by concatenation."""
    model, res = exported(arch)
    ids = probe_ids(seed=1)
    assert sum(CHUNKS) == len(ids)
    session, spec = plain_session(res.path), res.spec
    past, got, start, states = empty_past(spec), [], 0, {}
    for n in CHUNKS:
        logits, new = run_plain(session, spec, past, ids[start : start + n], list(range(n)), states)
        assert logits.shape == (1, n, spec.embedding_rows) and logits.dtype == np.float32
        for t in new:
            assert t.shape == (1, n, spec.num_kv_heads, spec.head_dim)
        past = [np.concatenate([p, t], axis=1) for p, t in zip(past, new)]
        got.append(logits[0])
        start += n
    got = np.concatenate(got)
    ref = hf_logits(model, ids)
    diff = float(np.abs(got.astype(np.float64) - ref).max())
    MEASURED.setdefault(arch, {})["chunks"] = diff
    bound = fp32_bound(arch)
    assert diff <= bound, f"{arch}: max |diff| {diff:.3g} over {len(ids)} rows in chunks {CHUNKS}"
    assert np.array_equal(got.argmax(-1), ref.argmax(-1))

    # a subset of rows, in a non-sorted order, on a non-empty past: rows come back in index order
    rows = [3, 0, 2]
    logits, _ = run_plain(session, spec, [p[:, :30] for p in past], ids[30:35], rows, states)
    assert np.abs(logits[0] - ref[[30 + r for r in rows]]).max() <= bound


@pytest.mark.parametrize("arch", ARCHS)
def test_graph_interface_follows_the_contract(arch, exported):
    model, res = exported(arch)
    spec = res.spec
    config = text_config(model.config)  # a multimodal wrapper's decoder config
    heads = config.num_attention_heads
    # Gemma 4's layers have their own head_dim (per_layer_config): the caches take the widest
    layer_configs = config.per_layer_config if getattr(config, "is_heterogeneous", False) else [config]
    kv_heads = {getattr(c, "num_key_value_heads", None) or heads for c in layer_configs}.pop()
    head_dim = max(getattr(c, "head_dim", None) or config.hidden_size // heads for c in layer_configs)
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    owning = len(types) - (getattr(config, "num_kv_shared_layers", 0) or 0)  # Gemma 4: the last layers own no K/V
    kv_types = ("full_attention", "sliding_attention", "hybrid")  # hybrid: Falcon-H1
    attention = [t for t in types[:owning] if t in kv_types]
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (len(attention), kv_heads, head_dim)
    assert spec.states == tuple(s for t in types for s in _states_of(config, t))
    assert spec.embedding_rows == model.get_output_embeddings().weight.shape[0] == config.vocab_size
    assert spec.kv_dtype == "float32"

    assert sorted(p.name for p in res.path.parent.iterdir()) == [GRAPH_NAME, DATA_NAME]  # no temp left
    assert res.bytes == res.path.stat().st_size + (res.path.parent / DATA_NAME).stat().st_size
    proto = onnx.load(str(res.path), load_external_data=False)
    assert (
        {p.key: p.value for p in proto.metadata_props}["specexport.contract_version"]
        == contract.version_for(spec.kv_layout, states=bool(spec.states))
        == ("1.11" if spec.states else "1.0")
    )
    assert [i.name for i in proto.graph.input] == spec.input_names()
    assert [o.name for o in proto.graph.output] == spec.output_names()

    def sig(value_info):
        t = value_info.type.tensor_type
        return t.elem_type, [d.dim_param if d.dim_param else d.dim_value for d in t.shape.dim]

    inputs = {i.name: sig(i) for i in proto.graph.input}
    outputs = {o.name: sig(o) for o in proto.graph.output}
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    elem, (one, S) = inputs[contract.INPUT_IDS]
    assert (elem, one) == (i64, 1)
    elem, (R,) = inputs[contract.LOGITS_INDEX]
    assert elem == i64
    elem, (_, P, _, _) = inputs[contract.past_key(0)]
    # S, P, R are symbolic and distinct: nothing is frozen to one call's sizes
    assert all(isinstance(d, str) and d for d in (S, P, R)) and len({S, P, R}) == 3, (S, P, R)
    assert outputs[contract.LOGITS] == (f32, [1, R, spec.embedding_rows])
    for i in range(spec.num_layers):
        for name in (contract.past_key(i), contract.past_value(i)):
            assert inputs[name] == (f32, [1, P, kv_heads, head_dim]), name
        for name in (contract.new_key(i), contract.new_value(i)):
            elem, dims = outputs[name]
            assert elem == f32 and len(dims) == 4 and dims[1] == S, (name, dims)
            # the static dims 1, H_kv, D are not declared: see test_new_kv_outputs_declare_static_dims
    for j, shape in enumerate(spec.states):  # feature recurrent_state: float32 [1, *s_j] in, [1, Rs, *s_j] out
        assert inputs[contract.past_state(j)] == (f32, [1, *shape])
        elem, dims = outputs[contract.new_state(j)]
        assert elem == f32 and dims[0] == 1 and dims[2:] == list(shape) and isinstance(dims[1], str)


def test_new_kv_outputs_declare_static_dims(exported):
    _, res = exported("llama")
    spec = res.spec
    proto = onnx.load(str(res.path), load_external_data=False)
    for out in proto.graph.output[1:]:
        dims = [d.dim_param or d.dim_value for d in out.type.tensor_type.shape.dim]
        assert [dims[0], dims[2], dims[3]] == [1, spec.num_kv_heads, spec.head_dim], (out.name, dims)


@pytest.mark.parametrize(
    "arch",
    [
        a
        for a in ARCHS
        if (TINY_CONFIGS[a].get("num_key_value_heads") or 0)
        and TINY_CONFIGS[a]["num_key_value_heads"] < TINY_CONFIGS[a]["num_attention_heads"]
    ],
)
def test_grouped_query_attention_is_preserved(arch, exported):
    model, res = exported(arch)
    H, Hkv = model.config.num_attention_heads, model.config.num_key_value_heads
    assert Hkv < H
    spec = res.spec
    assert spec.num_kv_heads == Hkv
    session = plain_session(res.path)
    _, new = run_plain(session, spec, empty_past(spec), probe_ids(7), list(range(7)))
    for t in new:
        assert t.shape == (1, 7, Hkv, spec.head_dim)  # unrepeated: H_kv heads, not H
    # and a past of H_kv heads is accepted
    logits, new = run_plain(session, spec, new, probe_ids(3, seed=5), [2])
    assert logits.shape == (1, 1, spec.embedding_rows) and new[0].shape == (1, 3, Hkv, spec.head_dim)


def _vocab_matrices(proto: onnx.ModelProto, rows: int, hidden: int) -> list[onnx.TensorProto]:
    return [t for t in proto.graph.initializer if sorted(t.dims) == sorted([rows, hidden])]


@pytest.mark.parametrize("arch", ARCHS)
def test_tied_embedding_is_stored_once(arch, exported, tmp_path):
    model, res = exported(arch)
    rows, hidden = res.spec.embedding_rows, text_config(model.config).hidden_size
    tied = model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert tied == bool(text_config(model.config).tie_word_embeddings)
    proto = onnx.load(str(res.path))
    mats = _vocab_matrices(proto, rows, hidden)
    assert len(mats) == (1 if tied else 2), [(t.name, list(t.dims)) for t in mats]
    if tied:
        # the output projection reads the embedding initializer itself
        (emb,) = mats
        assert list(emb.dims) == [rows, hidden]
        users = [n.op_type for n in proto.graph.node if emb.name in n.input]
        assert sorted(users) == ["Gather", "Gemm"], users
        # an untied export (drafts) carries the second [hidden, V] copy: the tied one saves it
        untied = export_portable(model, tmp_path / "untied", tie_lm_head=False)
        assert untied.bytes - res.bytes >= 0.95 * rows * hidden * 4, (untied.bytes, res.bytes)
        assert len(_vocab_matrices(onnx.load(str(untied.path)), rows, hidden)) == 2


def test_mistral_sliding_window_matters(exported, tmp_path):
    model, res = exported("mistral")
    window = model.config.sliding_window
    assert window == 16 and N_PROBE > window
    ids = probe_ids()
    # the reference itself depends on the window: same weights, no window -> other logits past it
    unwindowed = make_model("mistral", sliding_window=None)
    assert unwindowed.config.sliding_window is None
    for (name, a), b in zip(model.state_dict().items(), unwindowed.state_dict().values()):
        assert torch.equal(a, b), name  # same seed, same weights
    ref, ref_full = hf_logits(model, ids), hf_logits(unwindowed, ids)
    per_row = np.abs(ref - ref_full).max(-1)
    assert per_row[:window].max() < 1e-5  # identical while the window covers everything
    assert per_row[window + 1 :].min() > 1e-2, per_row  # different once it does not

    # the graph follows the window on every step (prefill/verify/rollback all past position 16)
    report = validate_export(model, res.path, res.spec, ids, FP32)
    assert report.max_abs_diff <= FP32.max_abs
    # a graph exported without the window is caught by validation against the windowed model
    wrong = export_portable(unwindowed, tmp_path / "nowindow")
    with pytest.raises(ExportValidationError) as info:
        validate_export(model, wrong.path, wrong.spec, ids, FP32)
    assert info.value.step == "prefill" and info.value.output == contract.LOGITS
    # ... and it is right for the unwindowed model (so the difference is the window alone)
    validate_export(unwindowed, wrong.path, wrong.spec, ids, FP32)


def test_perturbed_graph_weight_fails_validation(exported, tmp_path):
    model, res = exported("llama")
    proto = onnx.load(str(res.path))
    # the largest 2-D initializer that is not the (tied) vocabulary matrix: a layer weight
    rows = res.spec.embedding_rows
    init = max(
        (t for t in proto.graph.initializer if len(t.dims) == 2 and rows not in t.dims),
        key=lambda t: t.dims[0] * t.dims[1],
    )
    weights = numpy_helper.to_array(init).copy()
    weights.flat[7] += 0.5
    init.CopyFrom(numpy_helper.from_array(weights, init.name))
    out = tmp_path / "perturbed"
    out.mkdir()
    onnx.save_model(proto, str(out / GRAPH_NAME), save_as_external_data=True, location=DATA_NAME)
    with pytest.raises(ExportValidationError) as info:
        validate_export(model, out / GRAPH_NAME, res.spec, probe_ids(), FP32)
    err = info.value
    assert (err.step, err.output) == ("prefill", "logits")
    assert "'prefill'" in str(err) and "'logits'" in str(err) and "tolerance" in str(err)


def test_different_reference_model_fails_validation(exported):
    model, res = exported("qwen2")
    other = perturbed_copy(model, 0.05)
    with pytest.raises(ExportValidationError) as info:
        validate_export(other, res.path, res.spec, probe_ids(), FP32)
    assert (info.value.step, info.value.output) == ("prefill", "logits")
    assert "max abs diff" in info.value.detail


def test_validation_error_names_a_later_step(exported, monkeypatch):
    """A graph right on an empty cache but wrong with a past is reported at step 'verify'."""
    import specexport.build.validate as validate_mod

    model, res = exported("llama")
    real_run = validate_mod.FeedRunner.run

    def corrupt_past(self, ids, rows):
        if self.past_len:
            self.cache = [c + 0.1 for c in self.cache]
        return real_run(self, ids, rows)

    monkeypatch.setattr(validate_mod.FeedRunner, "run", corrupt_past)
    with pytest.raises(ExportValidationError) as info:
        validate_export(model, res.path, res.spec, probe_ids(), FP32)
    assert (info.value.step, info.value.output) == ("verify", "logits")


def test_fp16_export_within_fp16_tolerance(tmp_path):
    model = make_model("llama")
    res = export_portable(copy.deepcopy(model).half(), tmp_path / "fp16")
    assert res.spec.kv_dtype == "float16"
    proto = onnx.load(str(res.path), load_external_data=False)
    elem = {v.name: v.type.tensor_type.elem_type for v in [*proto.graph.input, *proto.graph.output]}
    assert elem[contract.past_key(0)] == elem[contract.new_value(1)] == TensorProto.FLOAT16
    assert elem[contract.LOGITS] == TensorProto.FLOAT  # logits are always float32
    try:
        FeedRunner(res.path, res.spec).run(probe_ids(4), [3])
    except Exception as exc:  # onnxruntime: NOT_IMPLEMENTED / no kernel for an fp16 op on CPU
        pytest.skip(f"onnxruntime CPU cannot run this fp16 graph: {exc}")
    # compared with the fp32 transformers model (the reference the build uses)
    report = validate_export(model, res.path, res.spec, probe_ids(), FP16)
    assert 0 < report.max_abs_diff <= FP16.max_abs
    MEASURED.setdefault("llama-fp16", {}).update({s.step: s.max_abs_diff for s in report.steps})


def test_plain_session_after_runtime_defaults(exported):
    """The library's defaults leave other onnxruntime users of the process alone: after
    validate_export and load() with default options, a plain InferenceSession still works.
    Run in a fresh interpreter, since the CLIs (tested in-process elsewhere) opt into the
    process-wide pool."""
    import subprocess
    import sys

    model, res = exported("llama")
    spec = (res.spec.num_layers, res.spec.num_kv_heads, res.spec.head_dim, res.spec.embedding_rows)
    code = (
        "import sys, onnxruntime as ort\n"
        "from specexport.build.validate import FeedRunner\n"
        "from specexport_runtime.contract import GraphSpec\n"
        f"FeedRunner({str(res.path)!r}, GraphSpec{spec!r})\n"
        f"ort.InferenceSession({str(res.path)!r}, providers=['CPUExecutionProvider'])\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]


@pytest.mark.slow  # a whole collection in a subprocess (~25 s); CI collects every module anyway
def test_default_pytest_run_collects_tests_build():
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "tests/build/test_parity.py::" in proc.stdout, proc.stdout[-2000:]
