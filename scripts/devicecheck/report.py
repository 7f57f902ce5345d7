"""The report: one JSON document saved after every section (a run killed by its time limit still
leaves what it measured), a short Markdown summary beside it, and the time budget."""

from __future__ import annotations

import json
import os
import platform
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any


class Budget:
    """Seconds for the whole check, counted from `start` (the wrapper's start: the install is in
    it). Optional sections ask `allows(name, needs)` first; a refusal is recorded and printed."""

    def __init__(self, seconds: float, start: float, skipped: list[str]):
        if seconds <= 0:
            raise ValueError(f"--budget must be > 0 seconds, got {seconds}")
        self.seconds, self.start, self.skipped = seconds, start, skipped

    def elapsed(self) -> float:
        return time.time() - self.start

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def allows(self, section: str, needs: float) -> bool:
        if self.left() >= needs:
            return True
        note = (
            f"{section}: skipped, needs about {needs:.0f} s and {max(0.0, self.left()):.0f} s of the"
            f" {self.seconds:.0f} s budget are left"
        )
        self.skipped.append(note)
        print(f"budget: {note}", flush=True)
        return False


def error_record(exc: BaseException) -> dict:
    """An exception as the report keeps it: type, message and the last frames."""
    frames = traceback.format_exception(type(exc), exc, exc.__traceback__)
    return {"error": f"{type(exc).__name__}: {exc}", "traceback": "".join(frames)[-2000:]}


class Report:
    """The JSON document (`data`) and where it and its summary go."""

    def __init__(self, out: Path, summary: Path, provider: str):
        self.out, self.summary = out, summary
        self.data: dict[str, Any] = {
            "status": "running",
            "reason": None,
            "simulated": provider != "cuda",
            "provider": provider,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "host": platform.node(),
            "machine": platform.machine(),
            "python": platform.python_version(),
            "versions": {},
            "providers": [],
            "gpus": [],
            "jetson": None,
            "budget": {},
            "skipped_for_time": [],
            "install": None,
            "checks": {},
            "probe": None,
        }

    def save(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        _write(self.out, json.dumps(self.data, indent=2, default=str) + "\n")
        _write(self.summary, summary_markdown(self.data))

    def section(self, key: str, fn: Callable[[], dict], into: dict | None = None) -> dict:
        """Run one section; its result (or its error, with traceback) lands under `key` and is saved."""
        target = self.data["checks"] if into is None else into
        try:
            result = fn()
        except Exception as exc:  # recorded in the report and printed, never dropped
            result = {**error_record(exc), "ok": False}
            print(f"{key}: FAILED {result['error']}", flush=True)
        target[key] = result
        self.save()
        return result

    def finish(self, status: str, reason: str | None, seconds: float) -> None:
        self.data["status"], self.data["reason"], self.data["seconds"] = status, reason, round(seconds, 1)
        self.save()
        print(f"== {status}{': ' + reason if reason else ''}  (JSON: {self.out}, summary: {self.summary})", flush=True)


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


# --------------------------------------------------------------------------- Markdown summary


ARTIFACT_KINDS = ("fp32", "fp16", "fused")  # devicecheck.checks.KINDS


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def summary_markdown(data: dict) -> str:
    lines = [f"# device-check: {data['status']}" + (f" ({data['reason']})" if data.get("reason") else ""), ""]
    sim = " — **simulated: the CPU stands in for the GPU**" if data.get("simulated") else ""
    lines.append(
        f"- host {data.get('host')} ({data.get('machine')}), Python {data.get('python')},"
        f" onnxruntime {data['versions'].get('onnxruntime')}{sim}"
    )
    lines.append(f"- GPU: {', '.join(data.get('gpus') or []) or data.get('jetson') or 'none found'}")
    if data.get("seconds") is not None:
        lines.append(f"- took {data['seconds']} s of a {data['budget'].get('seconds')} s budget")
    lines += _install_lines(data.get("install"))
    smoke = data["checks"].get("smoke")
    if smoke:
        lines.append(
            f"- smoke test: session providers {smoke.get('session_providers')}, MatMul max |diff|"
            f" {_fmt(smoke.get('max_abs_diff'))}: {'ok' if smoke.get('ok') else 'FAILED ' + str(smoke.get('error'))}"
        )
    lines += _artifact_lines(data["checks"])
    lines += _probe_lines(data.get("probe"))
    if data.get("skipped_for_time"):
        lines += ["", "Skipped for time:"] + [f"- {s}" for s in data["skipped_for_time"]]
    return "\n".join(lines) + "\n"


def _install_lines(install: dict | None) -> list[str]:
    if not install:
        return []
    if install.get("error"):
        return [f"- install: FAILED {install['error']}"]
    wheels = ", ".join(
        f"{w['name']} ({'installed' if w['installed'] else w['reason']})" for w in install.get("wheels", [])
    )
    return [f"- install ({install.get('seconds')} s) into {install.get('site')}: {wheels}"]


def _artifact_lines(checks: dict) -> list[str]:
    rows = []
    for kind in ARTIFACT_KINDS:
        c = checks.get(kind)
        if not isinstance(c, dict):
            continue
        if "skipped" in c:
            rows.append(f"| {kind} | skipped: {c['skipped']} | | | |")
            continue
        if "error" in c and "parity" not in c:
            rows.append(f"| {kind} | FAILED: {c['error']} | | | |")
            continue
        par = "; ".join(
            f"{role} {_fmt(p.get('max_abs_diff'))} (tol {_fmt(p.get('tolerance'))})"
            for role, p in c["parity"].items()
            if isinstance(p, dict)
        )
        g = c.get("greedy", {})
        runs = g.get("runs", [])
        equal = sum(1 for r in runs if r.get("equal"))
        kv, copies = c.get("kv_residency", {}), c.get("host_copies", {})
        rows.append(
            f"| {kind} | {par} | {equal}/{len(runs)} equal to target-only | {_fmt(kv.get('ok'))}"
            f" ({kv.get('device')}); {_fmt(copies.get('memcpy_nodes_per_run'))} Memcpy nodes/run"
            f" | {_fmt(c.get('ok'))} |"
        )
    trt = checks.get("tensorrt_native") or {}
    trt_line = (
        [f"- native TensorRT: {trt.get('skipped') or trt.get('error') or ('ok' if trt.get('ok') else 'FAILED')}"]
        if trt
        else []
    )
    if not rows:
        return trt_line
    return trt_line + [
        "",
        "| artifact | logits max abs diff vs CPU | greedy, speculation on (draft, ngram, hybrid × γ 1, 4, 8)"
        " | K/V stays on device; graph copies | ok |",
        "|---|---|---|---|---|",
        *rows,
    ]


def _probe_lines(probe: dict | None) -> list[str]:
    if not probe:
        return []
    if probe.get("skipped"):
        return ["", f"Performance probe: skipped ({probe['skipped']})"]
    out = [
        "",
        f"Performance probe ({probe.get('shape_name')}{', simulated' if probe.get('simulated') else ''},"
        f" {probe.get('dtype')}, fused graph):",
    ]
    if probe.get("error"):
        out.append(f"- FAILED {probe['error']}")
    calls = probe.get("per_call", {}).get("by_seq", {})
    if calls:
        out.append(
            "- per call at past "
            + str(probe["per_call"].get("past"))
            + ": "
            + ", ".join(f"S={s} {_fmt(c.get('median_ms'))} ms" for s, c in calls.items())
        )
    rows = [c for s, c in calls.items() if s != "1" and "row0_max_abs_diff_vs_s1" in c]
    if rows:
        worst = max(c["row0_max_abs_diff_vs_s1"] for c in rows)
        same = (
            "bitwise equal"
            if worst == 0
            else "argmax equal"
            if all(c["row0_argmax_equal_s1"] for c in rows)
            else "ARGMAX DIFFERS"
        )
        out.append(f"- row invariance: row 0 of S=2..16 vs S=1, max |diff| {_fmt(worst)} ({same})")
    t = probe.get("target_only", {})
    if t.get("tokens_per_second"):
        out.append(f"- target only: {_fmt(t['tokens_per_second'])} tokens/s ({_fmt(t.get('ms_per_token'))} ms/token)")
    s = probe.get("self_draft", {})
    if s.get("tokens_per_second"):
        out.append(
            f"- self-draft γ {s.get('gamma')}: {_fmt(s['tokens_per_second'])} tokens/s, acceptance"
            f" {_fmt(s.get('acceptance_rate'))}, speedup {_fmt(s.get('speedup'))} (must be <= {s.get('max_speedup')}),"
            f" outside ONNX Runtime {_fmt(s.get('outside_ort_ms_per_round'))} ms/round"
        )
    for key in ("self_draft", "cuda_graph"):
        if probe.get(key, {}).get("error"):
            out.append(f"- {key}: FAILED {probe[key]['error']}")
    g = probe.get("cuda_graph", {})
    if g and not g.get("error"):
        out.append(
            f"- CUDA graph: {g.get('result')}"
            + (
                f", {_fmt(g.get('replay_ms'))} ms/step vs {_fmt(g.get('plain_ms'))} without"
                if g.get("replay_ms")
                else ""
            )
        )
    b = probe.get("bandwidth_bound", {})
    if b:
        out.append(
            f"- weights {_fmt(b.get('weight_bytes_per_token'))} B/token; bound"
            f" {_fmt(b.get('max_tokens_per_second'))} tokens/s at {_fmt(b.get('bandwidth_bytes_per_second'))} B/s"
            f" ({b.get('bandwidth_source')})"
        )
    return out
