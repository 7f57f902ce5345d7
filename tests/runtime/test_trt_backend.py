"""The TensorRT path: pure-Python parts here; the GPU parts skip without TensorRT and a GPU.

Nothing GPU-side has run in this project so far (docs/gpu.md): the skipped tests at the end are
what a GPU machine runs (with scripts/device-check, tested in tests/scripts/)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from specexport_runtime import contract
from specexport_runtime.contract import GraphSpec
from specexport_runtime.errors import ArtifactError, InvalidArgument, ProviderUnavailable
from specexport_runtime.manifest import Manifest, ModelEntry, SpeculationDefaults, TokenizerEntry, write_manifest
from specexport_runtime.trt_backend import (
    ALIGNMENT,
    needs_staging,
    plan_kv_bindings,
    prefill_chunks,
    prefill_limit,
    slot_address,
)
from specexport_runtime.trt_build import (
    BuildOptions,
    EngineBuildError,
    TensorRTUnavailable,
    precision_flags,
    refuse_quantized,
    resolve_max_gamma,
)
from specexport_runtime.trt_build import main as build_main
from specexport_runtime.trt_engines import (
    EngineMismatch,
    EngineRecord,
    GpuInfo,
    Profile,
    check_record,
    default_profiles,
    engine_dir_name,
    find_record,
    input_shapes,
    profile_shapes,
    read_records,
    rebuild_command,
    select_profile,
    write_records,
)

REPO = Path(__file__).resolve().parents[2]
HAVE_TRT = importlib.util.find_spec("tensorrt") is not None
HAVE_CUDA_PY = importlib.util.find_spec("cuda") is not None
HAVE_GPU = shutil.which("nvidia-smi") is not None or os.path.exists("/etc/nv_tegra_release")
GPU_REASON = "TensorRT/CUDA not available on this machine"
needs_gpu = pytest.mark.skipif(not (HAVE_TRT and HAVE_CUDA_PY and HAVE_GPU), reason=GPU_REASON)

SPEC = GraphSpec(num_layers=2, num_kv_heads=3, head_dim=64, embedding_rows=320)  # fp32 rows: 768 bytes
ORIN = GpuInfo("Orin", "8.7")


def _record(**over) -> EngineRecord:
    data = dict(
        model="target",
        graph="target/model.onnx",
        graph_sha256="a" * 64,
        engine="engines/orin-10.3.0/target.engine",
        gpu_name="Orin",
        compute_capability="8.7",
        tensorrt_version="10.3.0",
        precision_flags=("fp16",),
        max_context=256,
        max_prompt=128,
        max_gamma=8,
        profiles=tuple(default_profiles(256, 128)),
    )
    data.update(over)
    return EngineRecord(**data)


# --------------------------------------------------------------------------- profiles


def test_default_profiles_cover_the_three_uses():
    decode, verify, prefill = default_profiles(2048, max_prompt=512, max_gamma=8, gamma=4)
    assert (decode.seq, decode.rows) == ((1, 1, 1), (1, 1, 1))
    assert verify.seq == (2, 5, 9) and verify.rows == (1, 5, 9)
    assert prefill.seq == (1, 128, 512) and prefill.rows == (1, 1, 1)
    assert all(p.past == (0, p.past[1], 2047) for p in (decode, verify, prefill))
    assert default_profiles(64, max_prompt=512)[2].seq[2] == 64  # capped at max_context


@pytest.mark.parametrize(
    "seq,rows,expected",
    [(1, 1, "decode"), (5, 5, "verify"), (9, 9, "verify"), (3, 1, "verify"), (10, 1, "prefill"), (512, 1, "prefill")],
)
def test_profile_selection_by_s(seq, rows, expected):
    profiles = default_profiles(2048, 512, 8)
    assert profiles[select_profile(profiles, seq, rows, past=100)].name == expected


def test_profile_selection_errors_name_the_limits():
    profiles = default_profiles(2048, 512, 8)
    with pytest.raises(InvalidArgument, match="--max-gamma"):
        select_profile(profiles, 12, 12)
    with pytest.raises(InvalidArgument, match="S=513"):
        select_profile(profiles, 513, 1)
    with pytest.raises(InvalidArgument):
        Profile("bad", (0, 1, 1), (0, 0, 0), (1, 1, 1))
    with pytest.raises(InvalidArgument):
        default_profiles(256, max_gamma=256)


def test_profile_shapes_follow_the_contract():
    shapes = profile_shapes(SPEC, default_profiles(256, 64, 4, 2)[1])  # verify
    assert shapes[contract.INPUT_IDS] == ((1, 2), (1, 3), (1, 5))
    assert shapes[contract.LOGITS_INDEX] == ((1,), (3,), (5,))
    assert shapes[contract.past_key(1)] == ((1, 0, 3, 64), (1, 128, 3, 64), (1, 255, 3, 64))
    assert set(shapes) == set(SPEC.input_names())
    assert input_shapes(SPEC, 4, 2, 7)[contract.past_value(0)] == (1, 7, 3, 64)


def test_prefill_chunks():
    assert prefill_chunks(1300, 512) == [512, 512, 276]
    assert prefill_chunks(512, 512) == [512]
    assert prefill_chunks(1, 512) == [1]
    assert prefill_limit(default_profiles(2048, 300)) == 300
    with pytest.raises(InvalidArgument):
        prefill_chunks(0, 4)


# --------------------------------------------------------------------------- address arithmetic


def test_slot_offsets_aligned_rows():
    spec = GraphSpec(num_layers=2, num_kv_heads=4, head_dim=64, embedding_rows=320, kv_dtype="float16")  # 512 B rows
    assert not needs_staging(spec)
    buffers = [0x10000 * (i + 1) for i in range(4)]
    bindings, copies = plan_kv_bindings(spec, buffers, past=7, seq=3)
    assert copies == []
    by_name = {b.name: b for b in bindings}
    assert by_name["past_key_0"].address == buffers[0] and by_name["past_key_0"].shape == (1, 7, 4, 64)
    assert by_name["past_value_1"].address == buffers[3] and by_name["past_value_1"].is_input
    assert by_name["new_key_0"].address == buffers[0] + 7 * 512 and by_name["new_key_0"].shape == (1, 3, 4, 64)
    assert by_name["new_value_1"].address == buffers[3] + 7 * 512 and not by_name["new_value_1"].is_input
    assert [b.name for b in bindings][:4] == ["past_key_0", "new_key_0", "past_value_0", "new_value_0"]
    assert slot_address(0x1000, 0, 512) == 0x1000


def test_unaligned_slots_go_through_staging():
    spec = GraphSpec(num_layers=1, num_kv_heads=3, head_dim=64, embedding_rows=320, kv_dtype="float16")  # 384 B rows
    assert needs_staging(spec) and needs_staging(SPEC) is False  # 768 = 3 * 256
    buffers, staging = [0x100000, 0x200000], [0x900000, 0xA00000]
    bindings, copies = plan_kv_bindings(spec, buffers, past=2, seq=4, staging=staging)  # 768: aligned
    assert copies == []
    bindings, copies = plan_kv_bindings(spec, buffers, past=1, seq=4, staging=staging)  # 384: not aligned
    by_name = {b.name: b.address for b in bindings}
    assert by_name["new_key_0"] == staging[0] and by_name["new_value_0"] == staging[1]
    assert by_name["past_key_0"] == buffers[0]
    assert copies == [(buffers[0] + 384, staging[0], 4 * 384), (buffers[1] + 384, staging[1], 4 * 384)]
    assert all(dst % ALIGNMENT for dst, _, _ in copies)
    with pytest.raises(InvalidArgument, match="aligned"):
        plan_kv_bindings(spec, buffers, past=1, seq=4)
    with pytest.raises(InvalidArgument):
        plan_kv_bindings(spec, buffers[:1], past=0, seq=1)


# --------------------------------------------------------------------------- engine records


def test_record_check_accepts_the_same_machine():
    check_record(_record(), ORIN, "10.3.0", "art", graph_sha256="a" * 64)


@pytest.mark.parametrize(
    "gpu,version,sha,needle",
    [
        (ORIN, "10.7.0", "a" * 64, "built with TensorRT 10.3.0, this machine has TensorRT 10.7.0"),
        (GpuInfo("NVIDIA GeForce RTX 4090", "8.9"), "10.3.0", "a" * 64, "compute capability 8.7, this GPU has 8.9"),
        (GpuInfo("Orin (nvgpu)", "8.7"), "10.3.0", "a" * 64, "this GPU is 'Orin (nvgpu)'"),
        (ORIN, "10.3.0", "b" * 64, "different target/model.onnx"),
    ],
)
def test_record_mismatch_says_how_to_rebuild(gpu, version, sha, needle):
    with pytest.raises(EngineMismatch) as info:
        check_record(_record(), gpu, version, "/data/my-artifact", graph_sha256=sha)
    message = str(info.value)
    assert needle in message
    assert "python -m specexport_runtime.trt_build /data/my-artifact --fp16 --max-prompt 128" in message
    assert isinstance(info.value, ArtifactError)


def test_find_record_and_missing_engines():
    records = [
        _record(),
        _record(model="draft", graph="draft/model.onnx", engine="engines/orin-10.3.0/draft.engine"),
        _record(gpu_name="NVIDIA H200", compute_capability="9.0", engine="engines/nvidia-h200-10.3.0/target.engine"),
    ]
    assert find_record(records, "draft", ORIN, "10.3.0", "art").model == "draft"
    assert find_record(records, "target", GpuInfo("NVIDIA H200", "9.0"), "10.3.0", "art").compute_capability == "9.0"
    with pytest.raises(EngineMismatch, match="engines exist for: Orin / TensorRT 10.3.0; NVIDIA H200"):
        find_record(records, "target", GpuInfo("NVIDIA A100", "8.0"), "10.3.0", "art")
    with pytest.raises(EngineMismatch, match="Build it here: python -m specexport_runtime.trt_build art"):
        find_record([], "target", ORIN, "10.3.0", "art")


def test_records_round_trip_and_replace(tmp_path):
    assert read_records(tmp_path) == []
    write_records(tmp_path, [_record(), _record(model="draft")])
    write_records(tmp_path, [_record(build_seconds=12.5)])  # same model/GPU/version: replaced
    records = read_records(tmp_path)
    assert [(r.model, r.build_seconds) for r in records] == [("target", 12.5), ("draft", 0.0)]
    assert records[0].profiles == _record().profiles
    data = json.loads((tmp_path / "engines.json").read_text())
    assert data["schema_version"] == 1 and data["engines"][0]["profiles"][0]["name"] == "decode"
    (tmp_path / "engines.json").write_text(json.dumps({"schema_version": 99, "engines": []}))
    with pytest.raises(ArtifactError, match="schema_version"):
        read_records(tmp_path)


def test_folder_names_and_flags():
    assert engine_dir_name("NVIDIA GeForce RTX 4090", "10.3.0") == "nvidia-geforce-rtx-4090-10.3.0"
    assert engine_dir_name("Orin", "10.3.0.30") == "orin-10.3.0.30"
    assert precision_flags("fp16", BuildOptions()) == ["fp16"]
    assert precision_flags("fp32", BuildOptions()) == []
    assert precision_flags("fp32", BuildOptions(fp16=True, bf16=True), {"int8", "fp8"}) == [
        "fp16",
        "bf16",
        "int8",
        "fp8",
    ]
    assert precision_flags("fp16", BuildOptions(strongly_typed=True), {"int8"}) == []
    assert rebuild_command("a") == "python -m specexport_runtime.trt_build a"
    assert rebuild_command("a", _record(precision_flags=(), max_prompt=512, max_gamma=12)) == (
        "python -m specexport_runtime.trt_build a --max-gamma 12"
    )


def test_quantized_graphs_are_refused_with_a_reason():
    with pytest.raises(EngineBuildError, match="MatMulNBits"):
        refuse_quantized("draft", "int4")
    refuse_quantized("target", "fp16")


# --------------------------------------------------------------------------- without TensorRT


@pytest.fixture
def fake_artifact(tmp_path) -> Path:
    """A manifest-only artifact (no graphs needed before TensorRT is imported)."""
    entry = ModelEntry(
        graph="target/model.onnx",
        source="tiny",
        architecture="llama",
        num_layers=2,
        num_kv_heads=3,
        head_dim=64,
        vocab_size=300,
        embedding_rows=320,
        precision="fp32",
    )
    write_manifest(
        tmp_path,
        Manifest(
            name="fake",
            max_context=256,
            target=entry,
            tokenizer=TokenizerEntry(),
            speculation=SpeculationDefaults(proposer="ngram"),
        ),
    )  # no draft graph
    return tmp_path


@pytest.mark.parametrize(
    "generation, gamma, runtime_max, profile_max",
    [
        ({}, 4, 8, 8),  # no max_gamma recorded: the default
        ({"max_gamma": 12}, 4, 12, 12),
        ({"max_gamma": 6}, 4, 6, 8),  # engines still cover the default longest draft
        ({"max_gamma": 6}, 10, 10, 10),  # never below the manifest's gamma
    ],
)
def test_max_gamma_one_definition(generation, gamma, runtime_max, profile_max):
    """Manifest.max_gamma bounds what the runtime drafts (controller, lookup); engine profiles
    take it, at least DEFAULT_MAX_GAMMA, unless the build options name one."""
    from specexport_runtime.manifest import SpeculationDefaults

    entry = ModelEntry(
        graph="t.onnx",
        source="tiny",
        architecture="llama",
        num_layers=2,
        num_kv_heads=3,
        head_dim=64,
        vocab_size=300,
        embedding_rows=320,
        precision="fp32",
    )
    manifest = Manifest(
        name="m",
        max_context=256,
        target=entry,
        tokenizer=TokenizerEntry(),
        speculation=SpeculationDefaults(gamma=gamma),
        generation=generation,
    )
    assert manifest.max_gamma == runtime_max
    assert resolve_max_gamma(manifest, BuildOptions()) == profile_max
    assert resolve_max_gamma(manifest, BuildOptions(max_gamma=3)) == 3


def test_build_entry_point_help():
    proc = subprocess.run(
        [sys.executable, "-m", "specexport_runtime.trt_build", "--help"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0
    for option in ("--fp16", "--max-prompt", "--max-gamma", "ARTIFACT".lower()):
        assert option in proc.stdout.lower()


@pytest.mark.skipif(HAVE_TRT, reason="tensorrt is installed here")
def test_build_without_tensorrt_fails_clearly(fake_artifact, capsys):
    assert build_main([str(fake_artifact), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "tensorrt Python package is not installed" in err and "specexport-runtime[tensorrt]" in err


@pytest.mark.skipif(HAVE_TRT, reason="tensorrt is installed here")
def test_native_backend_without_tensorrt_fails_clearly(fake_artifact):
    from specexport_runtime.api import load
    from specexport_runtime.trt_backend import TrtModel

    with pytest.raises(TensorRTUnavailable, match="docs/gpu.md") as info:
        TrtModel.from_artifact(fake_artifact)
    assert isinstance(info.value, ProviderUnavailable)
    with pytest.raises(TensorRTUnavailable):  # before the signature check that would refuse these keys
        load(fake_artifact, backend="tensorrt", trusted_keys=[b"not a key"])


# scripts/device-check (install from wheel parts, CPU stand-in, skip without a GPU): tests/scripts/


# --------------------------------------------------------------------------- GPU (skipped here)


@needs_gpu
def test_native_backend_matches_cpu_logits(tiny_artifacts):  # pragma: no cover - needs a GPU
    from specexport_runtime.api import load
    from specexport_runtime.trt_backend import TrtModel
    from specexport_runtime.trt_build import build_artifact_engines

    artifact = tiny_artifacts["noisy"]
    build_artifact_engines(artifact, BuildOptions(max_prompt=16, quiet=True), echo=lambda _m: None)
    cpu = load(artifact)
    model = TrtModel.from_artifact(artifact, "target")
    ids = list(range(3, 40))  # 37 tokens: three prefill chunks of <= 16
    want = np.array(cpu.target.forward(ids))
    got = np.array(model.forward(ids))
    assert np.abs(want - got).max() < 1e-2
    cpu.target.truncate(30)
    model.truncate(30)
    want = np.array(cpu.target.forward([5, 6, 7, 8], last_rows=4))  # verify profile, P=30
    got = np.array(model.forward([5, 6, 7, 8], last_rows=4))
    assert np.abs(want - got).max() < 1e-2
    model.close()


@needs_gpu
def test_native_generation_equals_ort(tiny_artifacts):  # pragma: no cover - needs a GPU
    from specexport_runtime.api import load
    from specexport_runtime.trt_build import build_artifact_engines

    artifact = tiny_artifacts["noisy"]
    build_artifact_engines(artifact, BuildOptions(max_prompt=64, quiet=True), echo=lambda _m: None)
    prompt = list(range(3, 20))
    want = load(artifact).generate(prompt, max_new_tokens=24, speculative=False).token_ids
    native = load(artifact, backend="tensorrt")
    assert native.generate(prompt, max_new_tokens=24, speculative=False).token_ids == want
    assert native.generate(prompt, max_new_tokens=24).token_ids == want
