"""Validate an exported graph against the transformers model it came from.

Three steps, each compared with an independent full-sequence transformers forward (no cache):
  prefill   S0 prompt tokens on an empty cache, every row;
  verify    S1 tokens on top of the prefill cache, every row (the multi-token verify call);
  rollback  the cache cursor moved back 2 positions, then one different token (decode).
The ONNX side is run with plain feeds here (numpy concatenation), independent of the
runtime's IO-binding engine, so a bug there cannot hide a bug in the graph.

validate_long_range repeats prefill and verify on a probe longer than every sliding window of
the model (within max_context), comparing the last rows: what only shows at long range (a window
off by one key, a rotary table switching) cannot pass the short probe alone.

An fp32 graph's bound grows with the model: each step also runs the reference in float64 and
measures transformers' own fp32 error there (`reference_error`, which grows with the width and
the depth of the model and the scale of its logits), and the graph may differ from the fp32
reference by `float64_factor` times that error (two fp32 computations of the same sums, each off
the exact value by about that much), or by the fixed floor, whichever is larger.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from specexport_runtime import contract
from specexport_runtime.contract import GraphSpec
from specexport_runtime.engine import SessionConfig, make_session
from specexport_runtime.errors import SpecExportError

from ..models.streaming import weights_dtype


class ExportValidationError(SpecExportError):
    """The exported graph's outputs differ from the reference beyond the tolerance."""

    def __init__(self, step: str, output: str, detail: str):
        super().__init__(f"export validation failed at step {step!r}, output {output!r}: {detail}")
        self.step, self.output, self.detail = step, output, detail


@dataclass(frozen=True)
class Tolerance:
    max_abs: float  # on logits; the bound is max(max_abs, rel * max |reference logit|)
    rel: float = 0.0
    near_tie: float = 0.0  # rows whose reference top-2 gap is below this may disagree on argmax
    require_argmax: bool = True
    min_agreement: float = 0.0  # without require_argmax: the argmax agreement every step must reach
    float64_factor: float = 0.0  # > 0: the bound is also this times the fp32 reference's error vs float64

    def to_dict(self) -> dict:
        return {
            "max_abs": self.max_abs if math.isfinite(self.max_abs) else None,
            "rel": self.rel,
            "near_tie": self.near_tie,
            "require_argmax": self.require_argmax,
            "min_agreement": self.min_agreement,
            "float64_factor": self.float64_factor,
        }

    def bound(self, scale: float, reference_error: float) -> float:
        """The largest |graph - fp32 reference| allowed: max(max_abs, rel * max |reference logit|,
        float64_factor * the fp32 reference's own max error against float64)."""
        return max(self.max_abs, self.rel * scale, self.float64_factor * reference_error)


# fp32: transformers' own fp32 forward is ~1e-4 from float64 on SmolLM2-135M (logits up to ~30)
# and more on wider and deeper models, so the bound is 4x that error as measured on each step's
# rows, with a floor of 1e-4 or 5e-6 of the logit scale (docs/validation.md)
FP32 = Tolerance(max_abs=1e-4, rel=5e-6, float64_factor=4.0)
# fp16 graphs are compared with the fp32 reference (fp16 weights and activations): errors grow with
# the attended length, and argmax flips where the reference's top two are that close
# (docs/validation.md has the measured differences)
FP16 = Tolerance(max_abs=5e-2, rel=0.08, require_argmax=False, min_agreement=0.85)
# quantized drafts only need to run and agree often enough to be useful; agreement is reported
QUANTIZED = Tolerance(max_abs=float("inf"), require_argmax=False)
# quantized targets against their float32 reference (docs/validation.md has the measurements):
# a checkpoint's own blocks (gguf / gptq / awq) against their exact dequantization, where only
# int8 activations (accuracy level 4) and kernels differ; round-to-nearest int8 / int4 against
# the float weights they were quantized from, where the weights differ too. Bounds catch a
# broken graph (a wrong block layout agrees on ~1/V of the rows), not a weak quantization.
QUANTIZED_TARGET = {
    "checkpoint": Tolerance(max_abs=0.0, rel=0.15, require_argmax=False, min_agreement=0.75),
    "int8": Tolerance(max_abs=0.0, rel=0.25, require_argmax=False, min_agreement=0.75),
    "int4": Tolerance(max_abs=0.0, rel=1.0, require_argmax=False, min_agreement=0.3),
}


@dataclass(frozen=True)
class StepReport:
    step: str
    rows: int
    max_abs_diff: float
    argmax_agreement: float
    reference_scale: float = 0.0  # max |reference logit|: the rel bound's unit
    reference_error: float = 0.0  # max |fp32 reference - float64 reference| (0: not measured)
    bound: float = 0.0  # the max |diff| this step allowed


@dataclass(frozen=True)
class ValidationReport:
    steps: tuple[StepReport, ...]

    @property
    def max_abs_diff(self) -> float:
        return max(s.max_abs_diff for s in self.steps)

    @property
    def argmax_agreement(self) -> float:
        total = sum(s.rows for s in self.steps)
        return sum(s.argmax_agreement * s.rows for s in self.steps) / total

    def to_dict(self) -> dict:
        return {
            "max_abs_diff": self.max_abs_diff,
            "argmax_agreement": self.argmax_agreement,
            "steps": [asdict(s) for s in self.steps],
        }

    def check_agreement(self, tol: Tolerance) -> ValidationReport:
        """Raise unless the argmax agreement over all rows reaches tol.min_agreement."""
        if self.argmax_agreement < tol.min_agreement:
            raise ExportValidationError(
                "all", contract.LOGITS, f"argmax agreement {self.argmax_agreement:.3f} < {tol.min_agreement}"
            )
        return self


class FeedRunner:
    """Minimal contract runner with a growing numpy cache of exactly P rows (validation only).

    Its session maps the weights file instead of repacking it (SessionConfig.prepack False): a
    few calls do not pay back a repacked copy of every MatMul weight, which for a 1B fp32 target
    is 5 GB of the build's memory; the kernels then differ from the runtime's in low bits only,
    far inside every tolerance (rowcheck measures the runtime's own sessions).

    time_major: the graph returns the S new rows, appended here with numpy.
    head_major_inplace: fed a [1, H_kv, P, D] past that is not shared with the output, the
    graph returns the whole [1, H_kv, P + S, D] cache (ONNX Runtime's non-shared mode; one row
    more with padded attention, dropped here), so neither the runtime's in-place binding nor
    its buffer reuse is exercised here."""

    def __init__(self, path: Path, spec: GraphSpec):
        self.session = make_session(path, SessionConfig(provider="cpu", prepack=False))  # mapped, not repacked
        self.spec = spec
        dtype = np.float32 if spec.kv_dtype == "float32" else np.float16
        self.axis = spec.layout.time_axis  # of the cache buffers
        self.cache = [np.zeros(spec.cache_shape(0), dtype)] * (2 * spec.num_layers)
        # feature recurrent_state: position -> the states after it (every row's is asked for)
        self.states: dict[int, list[np.ndarray]] = {0: [np.zeros((1, *s), np.float32) for s in spec.states]}

    @property
    def past_len(self) -> int:
        return self.cache[0].shape[self.axis]

    def run(self, ids: list[int], rows: list[int]) -> np.ndarray:
        feeds = {contract.INPUT_IDS: np.asarray([ids], np.int64), contract.LOGITS_INDEX: np.asarray(rows, np.int64)}
        total = self.past_len + len(ids)
        if self.spec.layout.cursor_inputs:
            feeds[contract.SEQLENS_K] = np.asarray([total - 1], np.int32)
            feeds[contract.TOTAL_SEQUENCE_LENGTH] = np.asarray(total, np.int32)
        for i in range(self.spec.num_layers):
            feeds[contract.past_key(i)] = self.cache[2 * i]
            feeds[contract.past_value(i)] = self.cache[2 * i + 1]
        P, n_states = self.past_len, len(self.spec.states)
        if n_states:
            feeds[contract.STATE_INDEX] = np.arange(len(ids), dtype=np.int64)
            for j, state in enumerate(self.states[P]):
                feeds[contract.past_state(j)] = state
        outputs = self.session.run(None, feeds)
        if n_states:  # new_state_{j} [1, S, *s_j]: the state after each row
            new = outputs[len(outputs) - n_states :]
            outputs = outputs[: len(outputs) - n_states]
            for r in range(len(ids)):
                self.states[P + r + 1] = [s[:, r] for s in new]
        logits, kv = outputs[0], outputs[2:] if self.spec.feature_width else outputs[1:]
        self.features = (
            outputs[1][0] if self.spec.feature_width else None
        )  # [S, F]: feature eagle3_head's hidden_states
        if self.spec.layout.in_place:  # the whole cache (with padded attention, row_padding's cache_pad, one row more)
            self.cache = [np.take(c, np.arange(total), axis=self.axis) for c in kv]
        else:  # the S new rows
            self.cache = [np.concatenate([c, n], axis=self.axis) for c, n in zip(self.cache, kv)]
        return logits[0]  # [R, V]

    def rollback(self, n: int) -> None:
        keep = self.past_len - n
        self.states = {p: s for p, s in self.states.items() if p <= keep}
        self.cache = [np.take(c, np.arange(keep), axis=self.axis) for c in self.cache]


def reference_logits(model: torch.nn.Module, ids: list[int], last: int = 0) -> np.ndarray:
    """Full-sequence transformers forward, no cache: [len(ids), V] float32 (the last `last` rows
    only when last > 0: a long probe's full logits would not fit)."""
    with torch.no_grad():
        kwargs = {"logits_to_keep": last} if last else {}
        out = model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=False, **kwargs)
    return out.logits[0].float().numpy()


def float64_logits(model: torch.nn.Module, ids: list[int], last: int = 0) -> np.ndarray:
    """reference_logits computed with float64 weights and activations ([len(ids) or last, V]
    float64): a streamed skeleton loads its weights in float64 for this forward; a loaded model
    is converted in place and back (float32 -> float64 -> float32 is exact). transformers keeps
    its rotary tables and RMSNorm statistics in float32 either way."""
    with torch.no_grad(), weights_dtype(model, torch.float64):
        kwargs = {"logits_to_keep": last} if last else {}
        out = model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=False, **kwargs)
        return out.logits[0].double().numpy()


def compare(step: str, got: np.ndarray, ref: np.ndarray, tol: Tolerance, exact: np.ndarray | None = None) -> StepReport:
    """got against the fp32 reference `ref`; exact: the float64 reference's rows (the bound's
    reference error), or None."""
    if got.shape != ref.shape:
        raise ExportValidationError(step, contract.LOGITS, f"shape {got.shape} != reference {ref.shape}")
    if not np.all(np.isfinite(got)):
        raise ExportValidationError(step, contract.LOGITS, "non-finite values")
    diff = float(np.max(np.abs(got.astype(np.float64) - ref)))
    scale = float(np.max(np.abs(ref)))
    error = 0.0 if exact is None else float(np.max(np.abs(ref.astype(np.float64) - exact)))
    bound = tol.bound(scale, error)
    if diff > bound:
        detail = f" ({tol.float64_factor:g}x the fp32 reference's error {error:.3g})" if exact is not None else ""
        raise ExportValidationError(step, contract.LOGITS, f"max abs diff {diff:.3g} > tolerance {bound:.3g}{detail}")
    same = got.argmax(-1) == ref.argmax(-1)
    if tol.require_argmax and not same.all():
        top2 = np.sort(ref, axis=-1)[:, -2:]
        gap = top2[:, 1] - top2[:, 0]
        bad = np.flatnonzero(~same & (gap >= tol.near_tie))
        if bad.size:
            r = int(bad[0])
            raise ExportValidationError(
                step,
                contract.LOGITS,
                f"argmax differs at row {r}: graph {int(got[r].argmax())} vs reference {int(ref[r].argmax())}"
                f" (reference top-2 gap {gap[r]:.3g})",
            )
    return StepReport(step, got.shape[0], diff, float(same.mean()), scale, error, bound)


def validate_export(
    reference: torch.nn.Module,
    graph: Path,
    spec: GraphSpec,
    probe_ids: list[int],
    tolerance: Tolerance = FP32,
    verify_len: int = 5,
    rollback: int = 2,
) -> ValidationReport:
    """probe_ids: at least verify_len + 2 tokens; the first len - verify_len are the prompt.
    Every reference forward runs before the graph's session opens, so the build's memory holds
    one of them at a time (a streamed reference loads weights per module; the session maps them
    all)."""
    if len(probe_ids) < verify_len + 2:
        raise ValueError(f"probe_ids has {len(probe_ids)} tokens; need at least {verify_len + 2}")
    n0 = len(probe_ids) - verify_len
    keep = probe_ids[: len(probe_ids) - rollback]
    token = (probe_ids[len(keep)] + 1) % spec.embedding_rows  # a token the cache has not seen there
    full = reference_logits(reference, probe_ids)  # [N, V]
    exact = _exact(reference, probe_ids, tolerance)  # [N, V] float64, or None
    edited = reference_logits(reference, keep + [token])[-1:]  # [1, V]
    edited_exact = _exact(reference, keep + [token], tolerance, last=1)

    runner = FeedRunner(graph, spec)
    got = runner.run(probe_ids[:n0], list(range(n0)))
    prefill = compare("prefill", got, full[:n0], tolerance, _rows(exact, slice(None, n0)))
    got = runner.run(probe_ids[n0:], list(range(verify_len)))
    verify = compare("verify", got, full[n0:], tolerance, _rows(exact, slice(n0, None)))
    runner.rollback(rollback)
    after = compare("rollback", runner.run([token], [0]), edited, tolerance, edited_exact)
    return ValidationReport((prefill, verify, after)).check_agreement(tolerance)


def validate_long_range(
    reference: torch.nn.Module,
    graph: Path,
    spec: GraphSpec,
    probe_ids: list[int],
    length: int,
    tolerance: Tolerance = FP32,
    verify_len: int = 5,
    rows: int = 16,
) -> ValidationReport:
    """Prefill `length - verify_len` tokens (the probe repeated) and verify `verify_len` more,
    comparing the prefill's last `rows` rows and every verify row with transformers'."""
    tokens = (probe_ids * (length // len(probe_ids) + 1))[:length]
    n0 = length - verify_len
    rows = min(rows, n0)
    full = reference_logits(reference, tokens, last=rows + verify_len)  # [rows + verify_len, V]
    exact = _exact(reference, tokens, tolerance, last=rows + verify_len)
    runner = FeedRunner(graph, spec)  # after the reference forwards (validate_export)
    got = runner.run(tokens[:n0], list(range(n0 - rows, n0)))
    prefill = compare("long prefill", got, full[:rows], tolerance, _rows(exact, slice(None, rows)))
    got = runner.run(tokens[n0:], list(range(verify_len)))
    verify = compare("long verify", got, full[rows:], tolerance, _rows(exact, slice(rows, None)))
    return ValidationReport((prefill, verify)).check_agreement(tolerance)


def _exact(reference: torch.nn.Module, ids: list[int], tol: Tolerance, last: int = 0) -> np.ndarray | None:
    """The float64 reference's logits when the tolerance reads them, else None."""
    return float64_logits(reference, ids, last) if tol.float64_factor > 0 else None


def _rows(a: np.ndarray | None, rows: slice) -> np.ndarray | None:
    """a[rows], or None for a step without a float64 reference."""
    return None if a is None else a[rows]
