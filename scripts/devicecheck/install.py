"""onnxruntime-gpu from wheel parts, and the proof that its CUDA provider runs.

The GPU host has a CPU-only onnxruntime preinstalled and no internet. The wheels travel in parts
(scripts/gpu-prepare, scripts/wheel-parts); here they are joined, installed with
`pip install --no-deps --target SITE`, and SITE goes first on sys.path and PYTHONPATH so that
`import onnxruntime` finds the GPU build, never the preinstalled one. onnxruntime-gpu loads the
CUDA 13 libraries (cuBLAS, cuDNN, cuFFT, cuRAND, the runtime) at its first CUDA session; they
come with the host's torch as nvidia-* packages, which onnxruntime's own preload does not find
from SITE, so `preload_cuda` imports torch (which loads most of them) and loads the rest from
the nvidia package folders by path.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1]
ALWAYS = ("onnxruntime",)  # distributions starting with this are installed even when importable (that is the point)
# CUDA 13 layout of the nvidia-* wheels (onnxruntime's own list when it has one, see preload_cuda)
CUDA13_LIBS = (
    ("nvidia", "cu13", "lib", "libcublasLt.so.13"),
    ("nvidia", "cu13", "lib", "libcublas.so.13"),
    ("nvidia", "cu13", "lib", "libnvrtc.so.13"),
    ("nvidia", "cu13", "lib", "libcurand.so.10"),
    ("nvidia", "cu13", "lib", "libcufft.so.12"),
    ("nvidia", "cu13", "lib", "libcudart.so.13"),
    ("nvidia", "cudnn", "lib", "libcudnn.so.9"),
)


class InstallError(Exception):
    """The install from parts failed; the message is one line naming what and why."""


def join_parts(parts: Path, wheels: Path) -> list[Path]:
    """scripts/wheel-parts join: every manifest in `parts`, checksums verified."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "wheel-parts"), "join", str(parts), str(wheels)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise InstallError(proc.stderr.strip() or f"wheel-parts join {parts} failed (exit {proc.returncode})")
    return sorted(wheels.glob("*.whl"))


def distribution(wheel: Path) -> str:
    return wheel.name.split("-", 1)[0].lower()


def top_level(wheel: Path) -> list[str]:
    """Importable top-level names of a wheel: its packages and modules (not dist-info/data)."""
    try:
        with zipfile.ZipFile(wheel) as z:
            names = z.namelist()
    except zipfile.BadZipFile as exc:
        raise InstallError(f"{wheel.name} is not a wheel (zip): {exc}") from exc
    tops = set()
    for name in names:
        first = name.split("/", 1)[0]
        if first.endswith((".dist-info", ".data")):
            continue
        if "/" in name:
            tops.add(first)
        elif first.endswith(".py"):
            tops.add(first[:-3])
    if not tops:
        raise InstallError(f"{wheel.name} holds no package or module")
    return sorted(tops)


def host_location(module: str) -> str | None:
    """Where `module` imports from on this host now (before SITE is added), or None."""
    spec = importlib.util.find_spec(module)
    if spec is None:
        return None
    return spec.origin or (list(spec.submodule_search_locations or []) or [None])[0]


def pip_install(wheels: list[Path], site: Path) -> None:
    if not wheels:
        return
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--no-index",
        "--no-compile",
        "--no-cache-dir",
        "--disable-pip-version-check",
        "--upgrade",
        "-q",
        "--target",
        str(site),
        *map(str, wheels),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise InstallError(
            f"pip install --target {site} failed (exit {proc.returncode}, Python"
            f" {platform.python_version()}): {tail[0]}"
        )


def put_first(site: Path) -> None:
    """SITE first on this process's path and on PYTHONPATH (for the processes it starts)."""
    entry = str(site)
    if entry in sys.path:
        sys.path.remove(entry)
    sys.path.insert(0, entry)
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != entry]
    os.environ["PYTHONPATH"] = os.pathsep.join([entry, *rest])
    importlib.invalidate_caches()


def import_locations(modules: list[str]) -> dict[str, str | None]:
    """Where each module imports from in a fresh interpreter with the current PYTHONPATH."""
    code = (
        "import importlib.util, json, sys\n"
        "def loc(m):\n    s = importlib.util.find_spec(m)\n"
        "    return None if s is None else (s.origin or list(s.submodule_search_locations or [''])[0])\n"
        "print(json.dumps({m: loc(m) for m in sys.argv[1:]}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, *modules], capture_output=True, text=True, env=os.environ.copy())
    if proc.returncode != 0:
        raise InstallError(f"could not locate {modules} with the new PYTHONPATH: {proc.stderr.strip()[-300:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def plan_wheels(wheels: list[Path]) -> list[dict]:
    """onnxruntime* always; any other wheel only when none of its modules imports on the host
    (so a brought fallback never shadows the host's own version)."""
    plan = []
    for wheel in wheels:
        tops = top_level(wheel)
        present = {m: host_location(m) for m in tops}
        always = distribution(wheel).startswith(ALWAYS)
        if always or not any(present.values()):
            plan.append(
                {
                    "name": wheel.name,
                    "modules": tops,
                    "installed": True,
                    "path": wheel,
                    "reason": "always" if always else "missing on the host",
                }
            )
        else:
            where = next(v for v in present.values() if v)
            plan.append(
                {
                    "name": wheel.name,
                    "modules": tops,
                    "installed": False,
                    "path": wheel,
                    "reason": f"host has it ({where})",
                }
            )
    return plan


def install_from_parts(parts: Path, site: Path) -> dict:
    """Join, install into `site`, put it first, and check that what was installed imports from it."""
    start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="device-check-wheels-"))
    try:
        plan = plan_wheels(join_parts(parts, work))
        if not plan:
            raise InstallError(f"no wheel in the parts of {parts}")
        site.mkdir(parents=True, exist_ok=True)
        pip_install([w["path"] for w in plan if w["installed"]], site)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    put_first(site)
    installed = [m for w in plan if w["installed"] for m in w["modules"]]
    where = import_locations(installed)
    wrong = {m: loc for m, loc in where.items() if not loc or not Path(loc).resolve().is_relative_to(site.resolve())}
    if wrong:
        m, loc = next(iter(wrong.items()))
        raise InstallError(f"{m} imports from {loc}, expected under {site} (first on PYTHONPATH)")
    for w in plan:
        del w["path"]  # a temporary file, gone now
    return {
        "parts": str(parts),
        "site": str(site),
        "wheels": plan,
        "imports": where,
        "pythonpath_first": os.environ["PYTHONPATH"].split(os.pathsep)[0],
        "seconds": round(time.perf_counter() - start, 1),
    }


# --------------------------------------------------------------------------- CUDA libraries


def _nvidia_roots() -> list[Path]:
    """site-packages folders holding the nvidia namespace package (the host torch's CUDA wheels)."""
    spec = importlib.util.find_spec("nvidia")
    if spec is None:
        return []
    return [Path(p).parent for p in spec.submodule_search_locations or []]


def preload_cuda(ort_module=None) -> dict:
    """Load the CUDA libraries onnxruntime-gpu needs before its first CUDA session: torch first
    (its import loads cuBLAS, cuDNN and the runtime), then each library from the nvidia package
    folders by path (RTLD_GLOBAL), else by name; what failed is recorded with its error."""
    info: dict = {"torch": None, "loaded": [], "failed": {}}
    try:
        import torch

        info["torch"] = f"{torch.__version__} (CUDA {torch.version.cuda})"
    except ImportError as exc:
        info["torch"] = f"not importable: {exc}"
    listing = getattr(ort_module, "_get_nvidia_dll_paths", None)
    libs = [tuple(p) for p in listing(False, True, True)] if listing else list(CUDA13_LIBS)
    roots = _nvidia_roots()
    for rel in libs:
        path = next((r.joinpath(*rel) for r in roots if r.joinpath(*rel).is_file()), None)
        try:
            ctypes.CDLL(str(path) if path else rel[-1], mode=ctypes.RTLD_GLOBAL)
            info["loaded"].append(str(path) if path else f"{rel[-1]} (by name)")
        except OSError as exc:
            info["failed"][rel[-1]] = str(exc)
    return info


# --------------------------------------------------------------------------- smoke test

_SMOKE = r"""
import json, sys
import numpy as np
provider = sys.argv[1]
preload = None
if provider == "CUDAExecutionProvider":
    import onnxruntime as ort
    from devicecheck.install import preload_cuda
    preload = preload_cuda(ort)
import onnxruntime as ort
from onnx import TensorProto, helper
graph = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["c"])], "smoke",
                          [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2, 3]),
                           helper.make_tensor_value_info("b", TensorProto.FLOAT, [3, 4])],
                          [helper.make_tensor_value_info("c", TensorProto.FLOAT, [2, 4])])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
model.ir_version = 8
result = {"onnxruntime": ort.__version__, "file": ort.__file__, "available": ort.get_available_providers(),
          "preload": preload}
print(json.dumps(result), flush=True)
sess = ort.InferenceSession(model.SerializeToString(), providers=[provider, "CPUExecutionProvider"])
a = np.arange(6, dtype=np.float32).reshape(2, 3)
b = np.arange(12, dtype=np.float32).reshape(3, 4) - 5
c = sess.run(None, {"a": a, "b": b})[0]
result.update(session_providers=sess.get_providers(), max_abs_diff=float(np.abs(c - a @ b).max()))
print(json.dumps(result), flush=True)
"""


def smoke_test(provider_full: str, timeout: float = 120) -> dict:
    """A fresh interpreter (a broken CUDA load cannot take the check down, and onnxruntime's own
    error lines are captured): providers listed, a MatMul session with `provider_full` first,
    its result exact (small integers: exact in TF32 too)."""
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _SMOKE, provider_full],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=os.environ.copy(),
        )
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"the smoke test ran past {timeout:.0f} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    result = json.loads(lines[-1]) if lines else {}
    result["seconds"] = round(time.perf_counter() - start, 1)
    stderr = proc.stderr.strip()
    if stderr:
        result["stderr_tail"] = stderr[-1500:]
    result["ok"] = (
        proc.returncode == 0
        and provider_full in result.get("available", [])
        and (result.get("session_providers") or [None])[0] == provider_full
        and result.get("max_abs_diff") == 0.0
    )
    if not result["ok"]:
        result["error"] = smoke_error(provider_full, proc.returncode, result, stderr)
    return result


def smoke_error(provider_full: str, code: int, result: dict, stderr: str) -> str:
    last = stderr.splitlines()[-1] if stderr else "no error output"
    if code != 0:
        return f"the smoke test exited {code}: {last}"
    if provider_full not in result.get("available", []):
        return (
            f"{provider_full} is not in onnxruntime.get_available_providers() = {result.get('available')}"
            f" ({result.get('file')})"
        )
    if (result.get("session_providers") or [None])[0] != provider_full:
        return (
            f"a session asked for {provider_full} runs on {result.get('session_providers')}: the provider did not"
            f" load ({last}; preload failures: {(result.get('preload') or {}).get('failed')})"
        )
    return f"MatMul on {provider_full} is off by {result.get('max_abs_diff')} (expected 0)"
