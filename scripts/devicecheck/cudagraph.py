"""The probe's CUDA graph part: the fused graph in a session of its own with the CUDA EP's
enable_cuda_graph, decode steps replayed from a captured graph next to the runtime's plain
session (time per step, logits difference), with ONNX Runtime's log lines about the capture.
On the CPU the same code runs with a plain session and nothing is captured.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager

import numpy as np


def _bind_caches(io, caches: list, layers: int) -> None:
    from specexport_runtime import contract

    for i in range(layers):
        for name_in, name_out, value in (
            (contract.past_key(i), contract.present_key(i), caches[2 * i]),
            (contract.past_value(i), contract.present_value(i), caches[2 * i + 1]),
        ):
            io.bind_ortvalue_input(name_in, value)
            io.bind_ortvalue_output(name_out, value)


class GraphSession:
    """The fused graph in a session of its own with the CUDA EP's enable_cuda_graph (on the CPU:
    a plain session with the same bindings, nothing captured). Caches: own fixed device buffers,
    past_i and present_i bound to the same one (head_major_inplace). Decode steps bind every
    input and output as a device OrtValue at a fixed address, updated in place; the CPU input
    total_sequence_length of GroupQueryAttention stays a host scalar."""

    def __init__(self, result, provider: str):
        import onnxruntime as ort

        from devicecheck.probe import MAX_CONTEXT  # the probe's context (probe.py imports this module)
        from specexport_runtime import contract

        self.ort, self.c, self.spec = ort, contract, result.spec
        self.device = "cuda" if provider == "cuda" else "cpu"
        opts = ort.SessionOptions()
        opts.log_severity_level = 1  # its INFO lines say whether a CUDA graph was captured
        providers = (
            [("CUDAExecutionProvider", {"device_id": 0, "enable_cuda_graph": "1"})] if provider == "cuda" else []
        )
        start = time.perf_counter()
        self.session = ort.InferenceSession(str(result.path), opts, providers=providers + ["CPUExecutionProvider"])
        self.session_seconds = round(time.perf_counter() - start, 1)
        shape = list(self.spec.cache_shape(MAX_CONTEXT))
        self.caches = [
            ort.OrtValue.ortvalue_from_shape_and_type(shape, np.float16, self.device, 0)
            for _ in range(2 * self.spec.num_layers)
        ]
        self.replay = ort.RunOptions()
        self.replay.add_run_config_entry("gpu_graph_id", "1")
        self.plain = ort.RunOptions()
        self.plain.add_run_config_entry("gpu_graph_id", "-1")  # no capture (the prefill's shapes differ)

    def prefill(self, prompt: list[int]) -> np.ndarray:
        io, c, V = self.session.io_binding(), self.c, self.spec.embedding_rows
        _bind_caches(io, self.caches, self.spec.num_layers)
        P = len(prompt)
        io.bind_cpu_input(c.INPUT_IDS, np.array([prompt], np.int64))
        io.bind_cpu_input(c.LOGITS_INDEX, np.array([P - 1], np.int64))
        io.bind_cpu_input(c.SEQLENS_K, np.array([P - 1], np.int32))
        io.bind_cpu_input(c.TOTAL_SEQUENCE_LENGTH, np.array(P, np.int32))
        logits = np.zeros((1, 1, V), np.float32)
        io.bind_output(c.LOGITS, "cpu", 0, np.float32, [1, 1, V], logits.ctypes.data)
        self.session.run_with_iobinding(io, self.plain)
        self.length = P
        return logits[0, 0]

    def start_decode(self) -> None:
        ort, c, dev, V = self.ort, self.c, self.device, self.spec.embedding_rows
        self.io = io = self.session.io_binding()
        _bind_caches(io, self.caches, self.spec.num_layers)
        self.ids = ort.OrtValue.ortvalue_from_numpy(np.zeros((1, 1), np.int64), dev, 0)
        self.index = ort.OrtValue.ortvalue_from_numpy(np.zeros(1, np.int64), dev, 0)
        self.seqlens = ort.OrtValue.ortvalue_from_numpy(np.zeros(1, np.int32), dev, 0)
        self.total = np.zeros((), np.int32)
        self.logits = ort.OrtValue.ortvalue_from_shape_and_type([1, 1, V], np.float32, dev, 0)
        io.bind_ortvalue_input(c.INPUT_IDS, self.ids)
        io.bind_ortvalue_input(c.LOGITS_INDEX, self.index)
        io.bind_ortvalue_input(c.SEQLENS_K, self.seqlens)
        io.bind_cpu_input(c.TOTAL_SEQUENCE_LENGTH, self.total)
        io.bind_ortvalue_output(c.LOGITS, self.logits)

    def decode(self, token: int) -> np.ndarray:
        P = self.length
        self.ids.update_inplace(np.array([[token]], np.int64))
        self.seqlens.update_inplace(np.array([P], np.int32))  # P + S - 1 with S = 1
        self.total[()] = P + 1
        self.session.run_with_iobinding(self.io, self.replay)
        self.length = P + 1
        return self.logits.numpy()[0, 0]


@contextmanager
def native_stderr(sink: list[str]):
    """What native code writes to file descriptor 2 inside the block (ONNX Runtime's log) goes
    to `sink`, one line per entry, instead of the terminal."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            sink.extend(tmp.read().decode(errors="replace").splitlines())


def graph_log_lines(lines: list[str]) -> list[str]:
    """ONNX Runtime's log lines about CUDA graphs (capture, refusal), at most 20."""
    return [line.strip()[:300] for line in lines if "graph" in line.lower() and "cuda" in line.lower()][:20]


class Steps:
    """Per decode step of the graph session next to the reference: seconds, max |diff|, argmax equal."""

    def __init__(self):
        self.times: list[float] = []
        self.diffs: list[float] = []
        self.agree: list[bool] = []

    def compare(self, got: np.ndarray, want: np.ndarray) -> int:
        """Record one logits row against the reference's; returns the reference's next token."""
        self.diffs.append(float(np.abs(got - want).max()))
        self.agree.append(bool(got.argmax() == want.argmax()))
        return int(want.argmax())

    def step(self, g: GraphSession, reference, token: int) -> int:
        start = time.perf_counter()
        got = g.decode(token)
        self.times.append(time.perf_counter() - start)
        return self.compare(got, np.array(reference.forward([token])[0]))  # both follow the reference's tokens


def cuda_graph(result, provider: str, reference, prompt: list[int], steps: int, plain_ms: float | None) -> dict:
    """Decode `steps` tokens with the graph session next to `reference` (the runtime's plain
    session, fed the same tokens): time per step and logits difference per step. Session
    creation, the prefill and the first 3 steps (ONNX Runtime captures in one of them) run with
    ONNX Runtime's log at INFO into a buffer, whose lines about CUDA graphs are reported, with
    the error when one of them fails."""
    import onnxruntime as ort

    from devicecheck.report import error_record

    log: list[str] = []
    s = Steps()
    ort.set_default_logger_severity(1)
    try:
        with native_stderr(log):
            g = GraphSession(result, provider)
            first = g.prefill(prompt)
            reference.reset()
            token = s.compare(first, np.array(reference.forward(prompt)[0]))
            g.start_decode()
            for _ in range(min(3, steps)):
                token = s.step(g, reference, token)
    except Exception as exc:  # the refusal or failure is the result, with ONNX Runtime's own lines
        return {**error_record(exc), "ok": False, "ort_log": graph_log_lines(log) or log[-20:]}
    finally:
        ort.set_default_logger_severity(2)  # ONNX Runtime's default
    for _ in range(steps - len(s.times)):
        token = s.step(g, reference, token)
    reference.reset()
    lines = graph_log_lines(log)
    captured = provider == "cuda" and any("captur" in line.lower() for line in lines)
    if provider != "cuda":
        outcome = "simulated: CPU session, nothing captured"
    else:
        outcome = "captured and replayed" if captured else "no capture seen in ONNX Runtime's log (see ort_log)"
    replay = statistics.median(s.times[3:]) * 1e3 if len(s.times) > 3 else None
    return {
        "result": outcome,
        "captured": captured,
        "session_seconds": g.session_seconds,
        "steps": steps,
        "first_runs_ms": [round(t * 1e3, 3) for t in s.times[:3]],
        "replay_ms": replay,
        "plain_ms": plain_ms,
        "speedup_vs_plain": (plain_ms / replay) if replay and plain_ms else None,
        "max_abs_diff_vs_plain": max(s.diffs),
        "argmax_agreement": sum(s.agree) / len(s.agree),
        "ort_log": lines,
        "note": "plain_ms: the runtime's plain session, decode S=1 at past 512",
    }
