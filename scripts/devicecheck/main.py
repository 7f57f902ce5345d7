"""scripts/device-check: install (optional), smoke test, correctness on tiny artifacts, performance probe.

Status: ok | fail (a check failed: exit 1) | error (the environment is incomplete, e.g. a GPU but
no CUDAExecutionProvider, or a failed install: exit 2) | skipped (no NVIDIA GPU: exit 0).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from devicecheck.report import Budget, Report, error_record

FULL = {"cuda": "CUDAExecutionProvider", "cpu": "CPUExecutionProvider"}
DEFAULT_BUDGET = 330  # seconds, install included: the whole check fits in 6 minutes on an H200-class host
NEEDS_TRT = 120


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="device-check",
        description="Check the ONNX Runtime CUDA path on an NVIDIA GPU: install onnxruntime-gpu from wheel parts"
        " (optional), run a MatMul on CUDA, compare tiny artifacts with the CPU (logits, greedy with and"
        " without speculation, K/V residency) and probe performance on a Llama-3.2-1B-shaped random"
        " model. DEVICE_CHECK_PROVIDER=cpu runs everything with the CPU standing in (the JSON says"
        " simulated). See docs/gpu.md.",
    )
    p.add_argument(
        "--out", type=Path, default=Path("device-check.json"), help="the JSON report (default device-check.json)"
    )
    p.add_argument("--summary", type=Path, default=None, help="the Markdown summary (default: --out with .md)")
    p.add_argument("--artifact", type=Path, default=None, help="a portable (fp32) artifact instead of a tiny one")
    p.add_argument("--fp16-artifact", type=Path, default=None, help="a portable fp16 artifact instead of a tiny one")
    p.add_argument("--fused-artifact", type=Path, default=None, help="an fp16 fused artifact instead of a tiny one")
    p.add_argument("--tokens", type=int, default=48, help="new tokens per greedy run (default 48)")
    p.add_argument("--no-trt", action="store_true", help="skip the native TensorRT part")
    p.add_argument(
        "--install-parts",
        type=Path,
        default=None,
        help="folder of wheel parts (scripts/gpu-prepare): join, pip install --target SITE, SITE first on the path",
    )
    p.add_argument("--site", type=Path, default=Path("/tmp/device-check-site"), help="where --install-parts installs")
    p.add_argument("--install-only", action="store_true", help="stop after the install")
    p.add_argument("--no-probe", action="store_true", help="skip the performance probe")
    p.add_argument(
        "--probe-shape",
        choices=("llama-3.2-1b", "tiny"),
        default=None,
        help="probe model shape (default: llama-3.2-1b on CUDA, tiny with the CPU standing in)",
    )
    p.add_argument(
        "--budget",
        type=float,
        default=DEFAULT_BUDGET,
        help=f"seconds for the whole check; optional sections are skipped when short (default {DEFAULT_BUDGET})",
    )
    args = p.parse_args(argv)
    if args.tokens < 1:
        p.error(f"--tokens must be >= 1, got {args.tokens}")
    return args


def start_time() -> float:
    """When the wrapper started (DEVICE_CHECK_T0, epoch seconds), so that the budget covers it all."""
    value = os.environ.get("DEVICE_CHECK_T0")
    try:
        return float(value) if value else time.time()
    except ValueError:
        return time.time()


def gpu_info() -> tuple[list[str], str | None]:
    gpus = []
    smi = shutil.which("nvidia-smi")
    if smi:
        proc = subprocess.run(
            [smi, "--query-gpu=name,memory.total,driver_version,compute_cap", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if proc.returncode == 0:
            gpus = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
    jetson = None
    if os.path.exists("/etc/nv_tegra_release"):
        jetson = Path("/etc/nv_tegra_release").read_text(errors="replace").splitlines()[0]
    print(f"GPUs: {gpus or 'none'}{'; Jetson: ' + jetson if jetson else ''}", flush=True)
    return gpus, jetson


def versions(report: Report):
    """onnxruntime (its providers), tensorrt and cuda-python; the onnxruntime module or None."""
    try:
        import onnxruntime as ort
    except ImportError as exc:
        report.data["versions"]["onnxruntime"] = None
        report.data["versions"]["onnxruntime_error"] = str(exc)
        ort = None
    if ort is not None:
        report.data["versions"].update(onnxruntime=ort.__version__, onnxruntime_file=ort.__file__)
        report.data["providers"] = ort.get_available_providers()
    for name, module in (("tensorrt", "tensorrt"), ("cuda-python", "cuda")):
        try:
            report.data["versions"][name] = getattr(__import__(module), "__version__", "installed")
        except ImportError:
            report.data["versions"][name] = None
    v = report.data["versions"]
    print(
        f"onnxruntime {v['onnxruntime']} ({v.get('onnxruntime_file')});"
        f" providers: {', '.join(report.data['providers']) or 'none'}",
        flush=True,
    )
    return ort


def install(args: argparse.Namespace, report: Report) -> tuple[str, str | None, int] | None:
    from devicecheck.install import InstallError, install_from_parts

    try:
        info = install_from_parts(args.install_parts, args.site)
    except InstallError as exc:
        report.data["install"] = {"error": str(exc), "parts": str(args.install_parts), "site": str(args.site)}
        return "error", f"install from {args.install_parts} failed: {exc}", 2
    report.data["install"] = info
    report.save()
    for w in info["wheels"]:
        print(f"install: {w['name']}: {'installed' if w['installed'] else 'not installed'} ({w['reason']})", flush=True)
    print(f"install: {info['site']} first on PYTHONPATH; imports: {info['imports']} ({info['seconds']} s)", flush=True)
    return None


def artifacts(args: argparse.Namespace, report: Report, work: Path) -> dict[str, Path]:
    """Given artifacts, else tiny ones built now in `work` (needs the build side: torch, transformers)."""
    from devicecheck.checks import KINDS, build_artifact

    given = {"fp32": args.artifact, "fp16": args.fp16_artifact, "fused": args.fused_artifact}
    found, built = {}, {}
    for kind in KINDS:
        if given[kind]:
            found[kind] = given[kind]
            continue
        try:
            found[kind], built[kind] = build_artifact(kind, work)
        except ImportError as exc:
            report.data["checks"][kind] = {
                "skipped": f"no --{'artifact' if kind == 'fp32' else kind + '-artifact'}"
                f" and the build side is missing ({exc})"
            }
        except Exception as exc:  # recorded, the check fails; the other kinds and the probe still run
            report.data["checks"][kind] = {**error_record(exc), "ok": False}
            print(f"{kind}: building the tiny artifact FAILED {report.data['checks'][kind]['error']}", flush=True)
    report.data["checks"]["artifacts"] = {k: {"path": str(v), "build_seconds": built.get(k)} for k, v in found.items()}
    print(f"artifacts: {report.data['checks']['artifacts']}", flush=True)
    return found


def run(args: argparse.Namespace, provider: str, report: Report, budget: Budget) -> tuple[str, str | None, int]:
    report.data["gpus"], report.data["jetson"] = gpu_info()
    if args.install_parts:
        failed = install(args, report)
        if failed:
            return failed
        if args.install_only:
            return "ok", "installed (--install-only)", 0
    ort = versions(report)
    if provider == "cuda" and not report.data["gpus"] and not report.data["jetson"]:
        return "skipped", "no NVIDIA GPU on this machine (nvidia-smi absent or found no GPU, not a Jetson)", 0
    if ort is None:
        return "error", "onnxruntime is not installed (pip install specexport-runtime[gpu], or --install-parts)", 2
    full = FULL[provider]
    if full not in report.data["providers"]:
        return (
            "error",
            (
                f"onnxruntime {ort.__version__} ({ort.__file__}) has no {full}: install onnxruntime-gpu"
                " (--install-parts, docs/gpu.md) or the JetPack onnxruntime-gpu wheel"
            ),
            2,
        )
    from devicecheck.install import smoke_test

    smoke = report.section("smoke", lambda: smoke_test(full))
    print(
        f"smoke test: {'ok' if smoke['ok'] else 'FAILED ' + str(smoke.get('error'))}"
        f" (session providers {smoke.get('session_providers')})",
        flush=True,
    )
    if not smoke["ok"]:
        return "error", f"{full} does not run: {smoke.get('error')}", 2
    if provider == "cuda":
        from devicecheck.install import preload_cuda

        report.data["cuda_preload"] = preload_cuda(ort)
    return correctness_and_probe(args, provider, report, budget)


def correctness_and_probe(
    args: argparse.Namespace, provider: str, report: Report, budget: Budget
) -> tuple[str, str | None, int]:
    work = Path(tempfile.mkdtemp(prefix="device-check-"))  # tiny artifacts built here; removed at the end
    try:
        return _correctness_and_probe(args, provider, report, budget, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _correctness_and_probe(
    args: argparse.Namespace, provider: str, report: Report, budget: Budget, work: Path
) -> tuple[str, str | None, int]:
    from devicecheck.checks import KINDS, check_artifact, prompt_ids, tensorrt_native

    found = artifacts(args, report, work)
    checks = report.data["checks"]
    if all("skipped" in checks.get(kind, {}) for kind in KINDS):
        return "error", checks["fp32"]["skipped"], 2
    for kind, path in found.items():
        report.section(kind, lambda k=kind, p=path: check_artifact(k, p, provider, args.tokens))
    trt_ok = True
    v = report.data["versions"]
    if args.no_trt or provider != "cuda" or not (v["tensorrt"] and v["cuda-python"]):
        report.data["checks"]["tensorrt_native"] = {
            "skipped": "tensorrt/cuda-python not installed, --no-trt, or simulated"
        }
    elif "fp32" in found and budget.allows("tensorrt native", NEEDS_TRT):
        from specexport_runtime.api import load

        ids = prompt_ids(load(found["fp32"]))
        trt_ok = report.section("tensorrt_native", lambda: tensorrt_native(found["fp32"], ids))["ok"]
    probe_ok = probe(args, provider, report, budget)
    failed = [k for k in KINDS if "skipped" not in checks.get(k, {}) and not checks.get(k, {}).get("ok")]
    failed += [] if trt_ok else ["tensorrt_native"]
    failed += [] if probe_ok else ["probe"]
    if failed:
        return "fail", f"failed: {', '.join(failed)} (see checks)", 1
    return "ok", None, 0


def probe(args: argparse.Namespace, provider: str, report: Report, budget: Budget) -> bool:
    from devicecheck.probe import run_probe

    if args.no_probe:
        report.data["probe"] = {"skipped": "--no-probe"}
        return True
    shape = args.probe_shape or ("llama-3.2-1b" if provider == "cuda" else "tiny")
    gpu = report.data["gpus"][0].split(",")[0].strip() if report.data["gpus"] else None
    report.data["probe"] = out = {}
    try:
        run_probe(provider, shape, budget, gpu, out, report.save)
    except Exception as exc:  # recorded in the report, the check fails
        out.update(error_record(exc), ok=False)
        print(f"probe: FAILED {out['error']}", flush=True)
    report.save()
    print_probe(out)
    return bool(out.get("ok"))


def print_probe(out: dict) -> None:
    calls = out.get("per_call", {}).get("by_seq", {})
    if calls:
        print(
            "probe per call (past 512): " + ", ".join(f"S={s} {c['median_ms']:.3f} ms" for s, c in calls.items()),
            flush=True,
        )
    for key in ("target_only", "self_draft"):
        r = out.get(key, {})
        if "tokens_per_second" in r:
            print(
                f"probe {key}: {r['tokens_per_second']:.1f} tok/s, outside ONNX Runtime"
                f" {r['outside_ort_ms_per_round']:.3f} ms/round"
                + (
                    f", acceptance {r['acceptance_rate']:.2f}, speedup {r['speedup']:.2f}"
                    if key == "self_draft"
                    else ""
                ),
                flush=True,
            )
    g = out.get("cuda_graph", {})
    if g:
        print(f"probe cuda_graph: {g.get('result') or g.get('error') or g.get('skipped')}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    provider = os.environ.get("DEVICE_CHECK_PROVIDER", "cuda")
    if provider not in FULL:
        print(f"device-check: DEVICE_CHECK_PROVIDER must be one of {sorted(FULL)}, got {provider!r}")
        return 2
    report = Report(args.out, args.summary or args.out.with_suffix(".md"), provider)
    budget = Budget(args.budget, start_time(), report.data["skipped_for_time"])
    report.data["budget"] = {"seconds": args.budget}
    try:
        status, reason, code = run(args, provider, report, budget)
    except Exception as exc:  # recorded with its traceback: the JSON says what broke
        report.data["fatal"] = error_record(exc)
        status, reason, code = "error", report.data["fatal"]["error"], 1
    report.data["budget"]["used_seconds"] = round(budget.elapsed(), 1)
    report.finish(status, reason, budget.elapsed())
    return code
