"""Correctness on the device with tiny random-init artifacts built on the spot (tests/tiny.py).

Per artifact (portable fp32, portable fp16, fused fp16; each a target with a noisy draft):
    parity        target and draft logits of every prompt row vs the CPU provider
    greedy        speculation on (draft, ngram, hybrid; gamma 1, 4, 8) vs off: identical tokens
    kv_residency  every K/V buffer is a device OrtValue whose address never changes; every call's
                  cache outputs land inside those buffers; only the logits rows asked for reach
                  the host ([1, R, V] into the host buffer allocated once)
    host_copies   ONNX Runtime's profiler on the runtime's own sessions: Memcpy nodes per run
                  (copies between host and device inside the graph) and kernels per provider
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import numpy as np

PROPOSERS = ("draft", "ngram", "hybrid")
GAMMAS = (1, 4, 8)
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
# kind -> (tests/tiny.py draft kind, precision); fused graphs run on CUDA in fp16 only
KINDS = {"fp32": ("noisy", "fp32"), "fp16": ("noisy", "fp16"), "fused": ("noisy-fused", "fp16")}
# max |device - CPU| of logits: fp32 (TF32 matmuls), fp16 portable, fp16 fused (GroupQueryAttention);
# with the CPU standing in both sides run the same kernels
TOLERANCE = {"cpu": 1e-4, "fp32": 5e-2, "fp16": 2e-1, "fused": 1e-1}


def build_artifact(kind: str, workdir: Path) -> tuple[Path, float]:
    from tiny import build_tiny_artifact

    draft_kind, precision = KINDS[kind]
    start = time.perf_counter()
    path = build_tiny_artifact(workdir / kind, draft_kind, precision=precision)
    return path, round(time.perf_counter() - start, 1)


def prompt_ids(gen) -> list[int]:
    return gen.codec.encode(PROMPT)[:48] or list(range(1, 17))


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# --------------------------------------------------------------------------- parity


def parity(cpu, dev, ids: list[int], tolerance: float) -> dict:
    """Logits of every prompt row, target and draft, device vs CPU."""
    out = {}
    for role in ("target", "draft"):
        a, b = getattr(cpu, role), getattr(dev, role)
        if a is None:
            continue
        a.reset()
        b.reset()
        la = np.array(a.forward(ids, last_rows=len(ids)))
        lb = np.array(b.forward(ids, last_rows=len(ids)))
        a.reset()
        b.reset()
        diff = float(np.abs(la - lb).max())
        out[role] = {
            "max_abs_diff": diff,
            "argmax_agreement": float((la.argmax(-1) == lb.argmax(-1)).mean()),
            "tolerance": tolerance,
            "ok": bool(diff <= tolerance),
            "precision": getattr(cpu.manifest, role).precision,
        }
    return out


# --------------------------------------------------------------------------- greedy


def _run(gen, ids: list[int], tokens: int, **kwargs) -> dict:
    r = gen.generate(ids, max_new_tokens=tokens, **kwargs)
    s = r.stats
    return {
        "tokens": r.token_ids,
        "tokens_per_second": round(s.tokens_per_second, 2),
        "acceptance_rate": round(s.acceptance_rate, 3),
        "mean_accepted_length": round(s.mean_accepted_length, 3),
    }


def greedy_matrix(cpu, dev, ids: list[int], tokens: int) -> dict:
    """Greedy output with speculation on, per proposer and gamma, must equal speculation off."""
    from specexport_runtime.errors import InvalidArgument

    dev.generate(ids, max_new_tokens=4, speculative=False)  # warm-up
    off = _run(dev, ids, tokens, speculative=False)
    cpu_off = _run(cpu, ids, tokens, speculative=False)
    runs = []
    for proposer in PROPOSERS:
        try:
            dev.resolve_proposer(proposer)
        except InvalidArgument as exc:
            runs.append({"proposer": proposer, "skipped": str(exc)})
            continue
        for gamma in GAMMAS:
            on = _run(dev, ids, tokens, proposer=proposer, gamma=gamma)
            runs.append(
                {
                    "proposer": proposer,
                    "gamma": gamma,
                    "equal": on["tokens"] == off["tokens"],
                    "first_difference": first_difference(on["tokens"], off["tokens"]),
                    **{k: v for k, v in on.items() if k != "tokens"},
                }
            )
    checked = [r for r in runs if "equal" in r]
    return {
        "new_tokens": tokens,
        "tokens_off": off["tokens"],
        "tokens_per_second_off": off["tokens_per_second"],
        "device_equals_cpu": off["tokens"] == cpu_off["tokens"],
        "runs": runs,
        "ok": bool(checked) and all(r["equal"] for r in checked),
    }


# --------------------------------------------------------------------------- K/V residency


def buffer_location(buf) -> tuple[str, int]:
    """(device, address) of a cache buffer: a numpy array (CPU) or an OrtValue."""
    if isinstance(buf, np.ndarray):
        return "cpu", int(buf.ctypes.data)
    return buf.device_name().lower(), int(buf.data_ptr())


def _calls(ids: list[int]) -> list[tuple[str, list[int], int, int | None]]:
    """(label, tokens, logits rows, truncate-to before the call): prefill, decodes, a verify, a rollback."""
    return [
        ("prefill", ids, 1, None),
        ("decode", [5], 1, None),
        ("decode", [6], 1, None),
        ("verify", [7, 8, 9, 10], 4, None),
        ("rollback+decode", [11], 1, len(ids) + 3),
    ]


def _classify_outputs(model, spans: list[tuple[int, int]], rows: int) -> dict:
    """The bound outputs after a call: cache outputs (inside a buffer) and the logits."""
    V = model.spec.embedding_rows
    cache, logits, other = [], [], []
    for value in model.bound_outputs():
        device, ptr = value.device_name().lower(), int(value.data_ptr())
        if any(lo <= ptr < hi for lo, hi in spans):
            cache.append(device)
        elif list(value.shape()) == [1, rows, V]:
            logits.append((device, ptr))
        else:
            other.append((device, list(value.shape())))
    return {"cache": cache, "logits": logits, "other": other}


def kv_residency(model, ids: list[int]) -> dict:
    """Cache buffers stay where the runtime put them (the device), at fixed addresses; each call
    writes its K/V into them and returns only the requested logits rows to the host buffer."""
    from specexport_runtime.engine import plan_rows

    itemsize = np.dtype(model.dtype).itemsize
    nbytes = int(np.prod(model.spec.cache_shape(model.cache_rows))) * itemsize
    before = [buffer_location(b) for b in model.cache_buffers]
    spans = [(ptr, ptr + nbytes) for _, ptr in before]
    model.reset()
    problems, rows_seen = [], []
    for label, tokens, rows, cut in _calls(ids):
        if cut is not None:
            model.truncate(cut)
        returned = model.forward(tokens, last_rows=rows)
        count = plan_rows(np.asarray([tokens], np.int64), rows, model.min_rows).count
        found = _classify_outputs(model, spans, count)
        rows_seen.append(count)
        if len(found["cache"]) != 2 * model.spec.num_layers or set(found["cache"]) != {model.device}:
            problems.append(
                f"{label}: cache outputs {found['cache']} (expected {2 * model.spec.num_layers} on {model.device}"
                " inside the bound buffers)"
            )
        if found["logits"] != [("cpu", int(model.logits_buffer.ctypes.data))]:
            problems.append(
                f"{label}: logits outputs {found['logits']} (expected one [1, {count}, V] in the host buffer)"
            )
        if not np.shares_memory(returned, model.logits_buffer) or returned.shape[0] != rows:
            problems.append(f"{label}: the returned logits {returned.shape} are not a view of the host buffer")
    after = [buffer_location(b) for b in model.cache_buffers]
    model.reset()
    devices = sorted({d for d, _ in before})
    constant = before == after
    ok = not problems and constant and devices == [model.device]
    return {
        "device": model.device,
        "buffers": len(before),
        "buffer_devices": devices,
        "pointers_constant": constant,
        "buffer_bytes": nbytes,
        "calls": [c[0] for c in _calls(ids)],
        "logits_rows": rows_seen,
        "problems": problems,
        "ok": ok,
    }


# --------------------------------------------------------------------------- host copies (profiler)


def parse_profile(path: Path) -> dict:
    """Kernels per run by provider, and the Memcpy nodes (host <-> device copies inside the graph)."""
    events = json.loads(path.read_text(encoding="utf-8"))
    runs = sum(1 for e in events if e.get("cat") == "Session" and e.get("name") == "model_run")
    by_provider: dict[str, int] = {}
    memcpy: dict[str, int] = {}
    memcpy_bytes = 0
    for e in events:
        if e.get("cat") != "Node" or not str(e.get("name", "")).endswith("_kernel_time"):
            continue
        args = e.get("args", {})
        provider = args.get("provider", "?")
        by_provider[provider] = by_provider.get(provider, 0) + 1
        if str(args.get("op_name", "")).startswith("Memcpy"):
            memcpy[args["op_name"]] = memcpy.get(args["op_name"], 0) + 1
            memcpy_bytes += int(args.get("output_size", 0) or 0)
    per = max(runs, 1)
    return {
        "runs": runs,
        "kernels_per_run": {p: n / per for p, n in sorted(by_provider.items())},
        "memcpy_nodes_per_run": sum(memcpy.values()) / per,
        "memcpy_ops": memcpy,
        "memcpy_bytes_per_run": memcpy_bytes / per,
    }


def host_copies(artifact: Path, provider: str, ids: list[int]) -> dict:
    """The target of a fresh load, profiled over a prefill, three decodes and a verify."""
    from specexport_runtime.engine import OrtModel, SessionConfig
    from specexport_runtime.manifest import read_manifest

    manifest = read_manifest(Path(artifact))
    entry = manifest.target
    with tempfile.TemporaryDirectory(prefix="device-check-profile-") as folder:  # the profile JSON is parsed here
        config = SessionConfig(provider=provider, profile_prefix=str(Path(folder) / "target"))
        model = OrtModel(
            Path(artifact) / entry.graph,
            entry.graph_spec(),
            manifest.max_context,
            config,
            min_rows=entry.min_rows,
            cache_pad=entry.cache_pad,
        )
        model.reset()
        model.forward(ids)
        for token in (5, 6, 7):
            model.forward([token])
        model.forward([8, 9, 10, 11], last_rows=4)
        result = parse_profile(Path(model.session.end_profiling()))
    result["note"] = (
        "Memcpy nodes copy between host and device inside the graph; feeds/fetches bound by address are not nodes"
    )
    return result


# --------------------------------------------------------------------------- one artifact


def tolerance(kind: str, provider: str) -> float:
    return TOLERANCE["cpu"] if provider == "cpu" else TOLERANCE[kind]


def check_artifact(kind: str, artifact: Path, provider: str, tokens: int) -> dict:
    from specexport_runtime.api import load

    cpu, dev = load(artifact, provider="cpu"), load(artifact, provider=provider)
    ids = prompt_ids(cpu)
    m = cpu.manifest
    result = {
        "artifact": str(artifact),
        "graph": m.target.kv_layout,
        "precision": m.target.precision,
        "prompt_tokens": len(ids),
    }
    result["parity"] = parity(cpu, dev, ids, tolerance(kind, provider))
    result["greedy"] = greedy_matrix(cpu, dev, ids, tokens)
    kv = {role: kv_residency(getattr(dev, role), ids) for role in ("target", "draft") if getattr(dev, role) is not None}
    result["kv_residency"] = {"device": dev.target.device, "models": kv, "ok": all(v["ok"] for v in kv.values())}
    result["host_copies"] = host_copies(artifact, provider, ids)
    result["ok"] = (
        all(p["ok"] for p in result["parity"].values()) and result["greedy"]["ok"] and result["kv_residency"]["ok"]
    )
    print_artifact(kind, provider, result)
    return result


def print_artifact(kind: str, provider: str, r: dict) -> None:
    for role, p in r["parity"].items():
        print(
            f"{kind} parity {role} ({p['precision']}): max |{provider} - cpu| = {p['max_abs_diff']:.3e}"
            f" (tol {p['tolerance']:g}), argmax agreement {p['argmax_agreement']:.1%}",
            flush=True,
        )
    g = r["greedy"]
    bad = [f"{x['proposer']}/γ{x['gamma']}@{x['first_difference']}" for x in g["runs"] if x.get("equal") is False]
    print(
        f"{kind} greedy: {sum(1 for x in g['runs'] if x.get('equal'))}/{sum(1 for x in g['runs'] if 'equal' in x)}"
        f" speculative runs equal target-only{' (differ: ' + ', '.join(bad) + ')' if bad else ''};"
        f" {provider} == cpu: {g['device_equals_cpu']}; off {g['tokens_per_second_off']} tok/s",
        flush=True,
    )
    kv = r["kv_residency"]
    print(
        f"{kind} K/V residency ({kv['device']}): {'ok' if kv['ok'] else 'FAILED'}"
        + "".join(
            f"; {role}: {v['problems'] or 'pointers constant' if v['pointers_constant'] else 'pointers moved'}"
            for role, v in kv["models"].items()
        ),
        flush=True,
    )
    h = r["host_copies"]
    print(
        f"{kind} profiler: {h['memcpy_nodes_per_run']:g} Memcpy nodes per run, kernels per run {h['kernels_per_run']}",
        flush=True,
    )


# --------------------------------------------------------------------------- TensorRT (optional)


def tensorrt_native(artifact: Path, ids: list[int]) -> dict:
    """Builds native engines (trt_build) and compares their logits with the CPU provider's."""
    from specexport_runtime import trt_build
    from specexport_runtime.api import load
    from specexport_runtime.trt_backend import TrtModel

    cpu = load(artifact, provider="cpu")
    out: dict = {}
    start = time.perf_counter()
    trt_build.build_artifact_engines(artifact, trt_build.BuildOptions(max_prompt=64, quiet=True), echo=print)
    out["build_seconds"] = round(time.perf_counter() - start, 1)
    for role in ("target", "draft"):
        a = getattr(cpu, role)
        if a is None:
            continue
        model = TrtModel.from_artifact(artifact, role)
        a.reset()
        la = np.array(a.forward(ids, last_rows=len(ids)))
        a.reset()
        if len(ids) <= model.max_rows:
            lb = np.array(model.forward(ids, last_rows=len(ids)))
        else:  # verify profile too small for every prompt row: compare the last row
            lb, la = np.array(model.forward(ids, last_rows=1)), la[-1:]
        diff = float(np.abs(la - lb).max())
        out[role] = {"max_abs_diff": diff, "ok": diff <= 5e-2}
        model.close()
    out["ok"] = all(v["ok"] for k, v in out.items() if isinstance(v, dict))
    return out
