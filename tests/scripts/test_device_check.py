"""scripts/device-check without a GPU: the install from wheel parts (a fake wheel), the skip, the
whole check with the CPU standing in for the GPU, and the pieces of its logic."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

from devicecheck import checks, probe  # noqa: E402
from devicecheck.report import Budget, Report, summary_markdown  # noqa: E402

HAVE_GPU = shutil.which("nvidia-smi") is not None or os.path.exists("/etc/nv_tegra_release")
no_gpu = pytest.mark.skipif(HAVE_GPU, reason="a GPU is present: run scripts/device-check by hand")


def device_check(
    *args, provider: str | None = "cpu", timeout: float = 300, tmpdir: Path | None = None
) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    if tmpdir is not None:  # where tempfile puts the script's work folders
        env["TMPDIR"] = str(tmpdir)
    env.pop("DEVICE_CHECK_PROVIDER", None)
    if provider:
        env["DEVICE_CHECK_PROVIDER"] = provider
    return subprocess.run(
        [str(REPO / "scripts" / "device-check"), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


# --------------------------------------------------------------------------- install from parts


def fake_wheel(folder: Path, dist: str, version: str, files: dict[str, str]) -> Path:
    """A minimal valid wheel: the files plus dist-info METADATA, WHEEL and RECORD."""
    info = f"{dist}-{version}.dist-info"
    entries = {
        **files,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist.replace('_', '-')}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for name, text in entries.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(text.encode())}")
    entries[f"{info}/RECORD"] = "\n".join(record + [f"{info}/RECORD,,"]) + "\n"
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in entries.items():
            z.writestr(name, text)
    return path


@pytest.fixture
def parts(tmp_path) -> Path:
    """Parts of three fake wheels: an onnxruntime (always installed), a package the host lacks
    (installed) and one it has (yaml: not installed, so it cannot shadow the host's)."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    made = [
        fake_wheel(wheels, "onnxruntime_gpu", "0.0.1", {"onnxruntime/__init__.py": "__version__ = '0.0.1+fake'\n"}),
        fake_wheel(wheels, "dc_fake_extra", "1.0", {"dc_fake_extra/__init__.py": "VALUE = 42\n"}),
        fake_wheel(wheels, "PyYAML", "0.0.1", {"yaml/__init__.py": "raise ImportError('fake yaml')\n"}),
    ]
    for wheel in made:
        proc = subprocess.run(
            [sys.executable, str(REPO / "scripts" / "wheel-parts"), "split", str(wheel), str(tmp_path / "parts")],
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stderr
    return tmp_path / "parts"


def test_install_from_parts_puts_the_private_folder_first(parts, tmp_path):
    site, out = tmp_path / "site", tmp_path / "dc.json"
    proc = device_check("--install-parts", parts, "--site", site, "--install-only", "--out", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert (data["status"], data["reason"]) == ("ok", "installed (--install-only)")
    wheels = {w["name"]: w for w in data["install"]["wheels"]}
    assert wheels["onnxruntime_gpu-0.0.1-py3-none-any.whl"]["installed"] is True
    assert wheels["onnxruntime_gpu-0.0.1-py3-none-any.whl"]["reason"] == "always"
    assert wheels["dc_fake_extra-1.0-py3-none-any.whl"]["reason"] == "missing on the host"
    assert wheels["PyYAML-0.0.1-py3-none-any.whl"]["installed"] is False
    assert wheels["PyYAML-0.0.1-py3-none-any.whl"]["reason"].startswith("host has it (")
    assert data["install"]["pythonpath_first"] == str(site)
    assert data["install"]["imports"]["onnxruntime"] == str(site / "onnxruntime" / "__init__.py")
    assert not (site / "yaml").exists()
    # the venv's real onnxruntime is shadowed by the one installed first on PYTHONPATH
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    check = subprocess.run(
        [
            sys.executable,
            "-c",
            "import onnxruntime, dc_fake_extra, yaml;"
            " print(onnxruntime.__version__, dc_fake_extra.VALUE, yaml.__file__)",
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    version, value, yaml_file = check.stdout.split()
    assert (version, value) == ("0.0.1+fake", "42") and not yaml_file.startswith(str(site))
    assert "- install (" in (tmp_path / "dc.md").read_text()


def test_install_refuses_a_corrupted_part(parts, tmp_path):
    part = parts / "onnxruntime_gpu-0.0.1-py3-none-any.whl.part001"
    part.write_bytes(part.read_bytes()[:-1] + b"!")
    out = tmp_path / "dc.json"
    proc = device_check("--install-parts", parts, "--site", tmp_path / "site", "--install-only", "--out", out)
    assert proc.returncode == 2
    data = json.loads(out.read_text())
    assert data["status"] == "error"
    assert data["install"]["error"].startswith(
        "wheel-parts: corrupted part onnxruntime_gpu-0.0.1-py3-none-any.whl.part001: sha256 "
    )
    assert data["reason"] == f"install from {parts} failed: {data['install']['error']}"
    assert not (tmp_path / "site").exists()


# --------------------------------------------------------------------------- whole runs


@no_gpu
def test_skips_without_gpu(tmp_path):
    out = tmp_path / "dc.json"
    proc = device_check("--out", out, provider=None, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "no NVIDIA GPU" in proc.stdout
    data = json.loads(out.read_text())
    assert data["status"] == "skipped" and data["simulated"] is False
    assert data["versions"]["onnxruntime"] and "CPUExecutionProvider" in data["providers"]
    assert (tmp_path / "dc.md").read_text().startswith("# device-check: skipped")


@pytest.mark.slow  # ~15 s: every stage of the device check on the CPU
@no_gpu
def test_whole_check_with_cpu_standing_in(tiny_artifacts, tmp_path):
    """DEVICE_CHECK_PROVIDER=cpu: every section runs with the CPU as the device (tests the script)."""
    out, summary, scratch = tmp_path / "dc.json", tmp_path / "summary.md", tmp_path / "tmp"
    scratch.mkdir()
    proc = device_check(
        "--artifact", tiny_artifacts["noisy"], "--out", out, "--summary", summary, "--tokens", "16", tmpdir=scratch
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    left = sorted(p.name for p in scratch.iterdir() if p.name.startswith("device-check"))
    assert left == []  # its built artifacts, profiles and the probe's graph are removed
    data = json.loads(out.read_text())
    assert data["status"] == "ok" and data["simulated"] is True and data["skipped_for_time"] == []
    assert data["checks"]["smoke"]["session_providers"][0] == "CPUExecutionProvider"
    for kind, (precision, layout) in {
        "fp32": ("fp32", "time_major"),
        "fp16": ("fp16", "time_major"),
        "fused": ("fp16", "head_major_inplace"),
    }.items():
        c = data["checks"][kind]
        assert (c["precision"], c["graph"], c["ok"]) == (precision, layout, True)
        assert c["parity"]["target"]["max_abs_diff"] == 0.0 and c["parity"]["draft"]["max_abs_diff"] == 0.0
        runs = c["greedy"]["runs"]
        assert [(r["proposer"], r["gamma"]) for r in runs] == [
            (p, g) for p in ("draft", "ngram", "hybrid") for g in (1, 4, 8)
        ]
        assert all(r["equal"] for r in runs)
        kv = c["kv_residency"]
        assert kv["device"] == "cpu" and set(kv["models"]) == {"target", "draft"}
        assert all(m["ok"] and m["pointers_constant"] and m["buffer_devices"] == ["cpu"] for m in kv["models"].values())
        assert kv["models"]["target"]["logits_rows"][3] == 4  # the verify call returns its 4 rows
        assert c["host_copies"]["memcpy_nodes_per_run"] == 0 and c["host_copies"]["runs"] == 5
    p = data["probe"]
    assert (p["shape_name"], p["simulated"], p["ok"]) == ("tiny", True, True)
    assert list(p["per_call"]["by_seq"]) == ["1", "2", "4", "8", "16"]
    assert p["per_call"]["by_seq"]["16"]["row0_max_abs_diff_vs_s1"] == 0.0
    assert p["target_only"]["tokens_per_second"] > 0 and p["target_only"]["distinct_tokens"] > 8
    s = p["self_draft"]
    assert s["acceptance_rate"] == 1.0 and s["equal_to_target_only"] and s["speedup"] <= 1.1 and s["ok"]
    assert s["outside_ort_ms_per_round"] > 0
    g = p["cuda_graph"]
    assert g["result"] == "simulated: CPU session, nothing captured" and g["max_abs_diff_vs_plain"] == 0.0
    assert (
        p["bandwidth_bound"]["bandwidth_bytes_per_second"] is None
        and p["bandwidth_bound"]["weight_bytes_per_token"] > 0
    )
    text = summary.read_text()
    assert text.startswith("# device-check: ok") and "simulated: the CPU stands in for the GPU" in text
    assert (
        "| fused | target 0 (tol 0.0001); draft 0 (tol 0.0001) | 9/9 equal to target-only | yes (cpu);"
        " 0 Memcpy nodes/run | yes |"
    ) in text
    assert "- row invariance: row 0 of S=2..16 vs S=1, max |diff| 0 (bitwise equal)" in text
    assert "Performance probe (tiny, simulated, fp16, fused graph)" in text


@no_gpu
def test_a_broken_artifact_fails_the_check_and_the_rest_still_runs(tiny_artifacts, tmp_path):
    out = tmp_path / "dc.json"
    proc = device_check(
        "--artifact",
        tiny_artifacts["noisy"],
        "--fp16-artifact",
        tmp_path / "nothing",
        "--fused-artifact",
        tmp_path / "nothing",
        "--no-probe",
        "--tokens",
        "4",
        "--out",
        out,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert (data["status"], data["reason"]) == ("fail", "failed: fp16, fused (see checks)")
    assert data["checks"]["fp32"]["ok"] is True
    assert data["checks"]["fp16"]["ok"] is False and data["checks"]["fp16"]["error"].startswith("ArtifactError: ")
    assert "Traceback" in data["checks"]["fp16"]["traceback"]
    assert data["probe"] == {"skipped": "--no-probe"}
    assert "| fp16 | FAILED: ArtifactError: " in (tmp_path / "dc.md").read_text()


# --------------------------------------------------------------------------- pieces


def test_kv_residency_sees_a_cache_output_outside_the_buffers(tiny_artifacts):
    from specexport_runtime import contract
    from specexport_runtime.api import load

    model = load(tiny_artifacts["noisy"]).target
    ids = list(range(3, 20))
    assert checks.kv_residency(model, ids)["ok"]
    H, D = model.spec.num_kv_heads, model.spec.head_dim
    scratch = np.zeros((1, 64, H, D), np.float32)
    bind = model._bind_slots

    def leaky(P, S):  # a runtime bug: layer 0's new keys land in a scratch buffer
        bind(P, S)
        model._io.bind_output(contract.new_key(0), "cpu", 0, np.float32, [1, S, H, D], scratch.ctypes.data)

    model._bind_slots = leaky
    result = checks.kv_residency(model, ids)
    assert not result["ok"]
    assert result["problems"][0] == (
        "prefill: cache outputs ['cpu', 'cpu', 'cpu'] (expected 4 on cpu inside the bound buffers)"
    )


def test_budget_records_what_it_skips():
    skipped: list[str] = []
    budget = Budget(100, time.time() - 95, skipped)
    assert budget.allows("quick", 4) and not budget.allows("probe build", 150)
    assert skipped == ["probe build: skipped, needs about 150 s and 5 s of the 100 s budget are left"]


def test_probe_skips_everything_when_the_budget_is_spent():
    out: dict = {}
    budget = Budget(10, time.time() - 20, [])
    probe.run_probe("cpu", "tiny", budget, None, out, lambda: None)
    assert out["build"] == {"skipped": "budget"} and "per_call" not in out and out["ok"] is True
    assert budget.skipped[0].startswith("probe build: skipped")


def test_parse_profile(tmp_path):
    events = [
        {"cat": "Session", "name": "model_run"},
        {"cat": "Session", "name": "model_run"},
        {"cat": "Node", "name": "a_kernel_time", "args": {"op_name": "MatMul", "provider": "CUDAExecutionProvider"}},
        {"cat": "Node", "name": "a_kernel_time", "args": {"op_name": "MatMul", "provider": "CUDAExecutionProvider"}},
        {
            "cat": "Node",
            "name": "m_kernel_time",
            "args": {"op_name": "MemcpyToHost", "provider": "CUDAExecutionProvider", "output_size": "64"},
        },
        {"cat": "Node", "name": "a_fence_before", "args": {"op_name": "MatMul"}},
    ]
    (tmp_path / "p.json").write_text(json.dumps(events))
    r = checks.parse_profile(tmp_path / "p.json")
    assert r == {
        "runs": 2,
        "kernels_per_run": {"CUDAExecutionProvider": 1.5},
        "memcpy_nodes_per_run": 0.5,
        "memcpy_ops": {"MemcpyToHost": 1},
        "memcpy_bytes_per_run": 32.0,
    }


def test_bandwidth_figures():
    assert probe.bandwidth_for("NVIDIA H200")[0] == 4.8e12
    assert probe.bandwidth_for("NVIDIA H100 PCIe")[0] == 2.0e12
    assert probe.bandwidth_for("NVIDIA H100 80GB HBM3")[0] == 3.35e12
    assert probe.bandwidth_for("NVIDIA GeForce RTX 4090") == (None, None)
    assert probe.bandwidth_for(None) == (None, None)


def test_summary_of_an_early_error(tmp_path):
    report = Report(tmp_path / "dc.json", tmp_path / "dc.md", "cuda")
    report.data["install"] = {"error": "missing part x.part002"}
    report.finish("error", "install failed", 1.0)
    text = (tmp_path / "dc.md").read_text()
    assert text.startswith("# device-check: error (install failed)")
    assert "- install: FAILED missing part x.part002" in text
    assert summary_markdown(json.loads((tmp_path / "dc.json").read_text())) == text


def test_native_stderr_collects_onnxruntime_lines():
    log: list[str] = []
    with probe.native_stderr(log):
        os.write(
            2, b"[I:onnxruntime:, cuda_execution_provider.cc] Capturing the CUDA graph for this model\nother line\n"
        )
    assert log == ["[I:onnxruntime:, cuda_execution_provider.cc] Capturing the CUDA graph for this model", "other line"]
    assert probe.graph_log_lines(log) == [log[0]]


def test_cuda_graph_failure_is_the_result(tmp_path):
    """A session that cannot be made (here: no graph file) is reported with its error text. Run in
    a fresh interpreter, as the device check runs: in this process an earlier test may have made
    ONNX Runtime's process-wide thread pool, which refuses every plain session with another error."""
    code = f"""
import json, sys
sys.path.insert(0, {str(REPO / "scripts")!r})
from pathlib import Path
from devicecheck import probe
from specexport_runtime.contract import HEAD_MAJOR_INPLACE, GraphSpec

class Result:
    path = Path({str(tmp_path / "model.onnx")!r})
    spec = GraphSpec(1, 1, 8, 16, "float16", HEAD_MAJOR_INPLACE)

print(json.dumps(probe.cuda_graph(Result(), "cpu", reference=None, prompt=[1, 2], steps=4, plain_ms=None)))
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert run.returncode == 0, run.stderr[-400:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["ok"] is False and out["error"].startswith(
        "NoSuchFile: [ONNXRuntimeError] : 3 : NO_SUCHFILE : Load model"
    )
    assert out["ort_log"] and "[I:onnxruntime:" in out["ort_log"][0]  # the INFO lines come with it


def test_first_difference():
    assert checks.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert checks.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert checks.first_difference([1, 2], [1, 2, 3]) == 2
