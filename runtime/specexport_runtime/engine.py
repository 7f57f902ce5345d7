"""ONNX Runtime backend: one contract graph, its preallocated KV cache, IO binding.

The cache of each layer is one buffer per K and V of shape [1, T_max, H_kv, D], allocated once.
A call with S new tokens binds
    past_*  -> buffer[:, :P]        (contiguous prefix, no copy)
    new_*   -> buffer[:, P:P+S]     (the graph writes K/V straight into the slot at the cursor)
and advances the cursor P by S. Rollback is `truncate(P')`: rows >= P' are simply not bound
again. On CUDA the buffers live on the device; only the requested logits rows reach the host.

A head_major_inplace graph (feature head_major_in_place) takes the whole [1, H_kv, T_max, D] buffer as both
past_* and present_*, bound once for the life of the model; each call only passes the cursor
(seqlens_k = P + S - 1, total_sequence_length = P + S) and the graph writes rows P..P+S-1.
Which of the two a graph does is its spec's KvLayout (contract.py), read once here.

OrtModel implements model.Model, the interface the speculative loop and the proposers use.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from . import contract
from .contract import GraphSpec
from .errors import ContractError, InvalidArgument, ProviderUnavailable
from .model import CacheCursor, CallRows, CallStats, head_rows, move_rows, plan_rows
from .recurrent import MAX_CALL_ROWS, StateHistory, solo_piece

__all__ = [
    "CacheCursor",
    "CallRows",
    "CallStats",
    "OrtModel",
    "SessionConfig",
    "available_providers",
    "check_contract",
    "check_layout_provider",
    "make_session",
    "plan_rows",
]

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider", "tensorrt": "TensorrtExecutionProvider"}
NP_DTYPES = {"float32": np.float32, "float16": np.float16}  # kv_dtype -> numpy dtype of the caches


@dataclass(frozen=True)
class SessionConfig:
    """How one ONNX Runtime session runs.

    shared_pool (CPU): target and draft run one after the other, so they share the process-wide
    ONNX Runtime thread pool instead of two pools whose spinning threads fight for the cores
    (docs/performance.md, "Where the time goes": thread pools). The pool is process-wide
    and ONNX Runtime cannot mix it with per-session pools: once created (by the first CPU
    session with shared_pool), every later CPU session of the process joins it, whatever its
    own threads/spinning say, and a plain onnxruntime.InferenceSession made elsewhere in the
    process with default options fails. So it is off by default for library use and on in the
    specexport CLIs, which own their process."""

    provider: str = "cpu"
    threads: int | None = None  # intra-op threads; None = ORT default (physical cores)
    spinning: bool = True  # session.intra_op.allow_spinning (own pool only)
    shared_pool: bool = False  # opt-in: the CLIs turn it on; a library user decides (see above)
    device_id: int = 0
    optimization: str = "all"  # disable | basic | extended | all
    trt_cache_dir: str | None = None  # TensorRT EP engine/timing cache folder
    trt_fp16: bool = False
    profile_prefix: str | None = None  # ONNX Runtime's profiler on, its JSON at this prefix (end_profiling)
    # CPU: repack constant MatMul weights per session (faster; off: the weights file is mapped and
    # sessions on one file share its pages, about 0.75x decode speed; docs/trees.md, "What it costs and gains")
    prepack: bool = True

    def __post_init__(self) -> None:
        if self.provider not in PROVIDERS:
            raise InvalidArgument(f"provider {self.provider!r} is not one of {sorted(PROVIDERS)}")
        if self.threads is not None and self.threads < 1:
            raise InvalidArgument(f"threads must be >= 1 or None, got {self.threads}")
        if self.optimization not in ("disable", "basic", "extended", "all"):
            raise InvalidArgument(f"optimization {self.optimization!r} is not one of disable|basic|extended|all")


def available_providers() -> list[str]:
    names = set(ort.get_available_providers())
    return [short for short, full in PROVIDERS.items() if full in names]


_shared_pool_threads: int | None = None  # size of the process-wide pool once created


def _use_shared_pool(config: SessionConfig) -> bool:
    """Whether this session runs on the process-wide pool (creating it on first use)."""
    global _shared_pool_threads
    if config.provider != "cpu":
        return _shared_pool_threads is not None
    if _shared_pool_threads is None and config.shared_pool:
        from onnxruntime.capi import _pybind_state

        _shared_pool_threads = config.threads or max(1, os.cpu_count() or 1)
        _pybind_state.set_global_thread_pool_sizes(_shared_pool_threads, 1)
    return _shared_pool_threads is not None


def make_session(path: Path, config: SessionConfig) -> ort.InferenceSession:
    full = PROVIDERS[config.provider]
    if full not in ort.get_available_providers():
        raise ProviderUnavailable(
            f"provider {config.provider!r} is not available in this onnxruntime build;"
            f" available: {available_providers()}"
            " (install specexport-runtime[gpu] on a CUDA machine)"
        )
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if config.profile_prefix:
        opts.enable_profiling = True
        opts.profile_file_prefix = config.profile_prefix
    opts.graph_optimization_level = {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }[config.optimization]
    if not config.prepack:
        opts.add_session_config_entry("session.disable_prepacking", "1")
    if _use_shared_pool(config):
        opts.use_per_session_threads = False
    else:
        if config.threads is not None:
            opts.intra_op_num_threads = config.threads
        opts.inter_op_num_threads = 1
        opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if config.spinning else "0")
    providers: list = []
    if config.provider == "tensorrt":
        trt_opts = {"device_id": config.device_id, "trt_fp16_enable": config.trt_fp16}
        if config.trt_cache_dir:
            trt_opts.update(
                trt_engine_cache_enable=True,
                trt_engine_cache_path=config.trt_cache_dir,
                trt_timing_cache_enable=True,
                trt_timing_cache_path=config.trt_cache_dir,
            )
        providers.append((full, trt_opts))
    if config.provider in ("cuda", "tensorrt"):
        providers.append(("CUDAExecutionProvider", {"device_id": config.device_id}))
    providers.append("CPUExecutionProvider")
    return ort.InferenceSession(str(path), opts, providers=providers)


def check_layout_provider(spec: GraphSpec, provider: str) -> None:
    """head_major_inplace graphs use GroupQueryAttention: ONNX Runtime runs it on the CPU (fp32,
    fp16) and on CUDA for fp16 only; TensorRT implements no contrib op. Its windows need ONNX
    Runtime >= contract.WINDOW_MIN_ORT."""
    problem = contract.window_runtime_error(spec, ort.__version__)
    if problem:
        raise ProviderUnavailable(problem)
    if not spec.layout.contrib_attention or provider == "cpu":
        return
    if provider == "tensorrt" or spec.kv_dtype != "float16":
        raise ContractError(
            f"a {spec.kv_layout} graph with {spec.kv_dtype} caches cannot run on provider {provider!r}"
            " (GroupQueryAttention: CPU, or CUDA with fp16); rebuild with target precision fp16 for CUDA"
            " or with `graph: portable` for TensorRT"
        )


_ORT_TYPES = {"float32": "tensor(float)", "float16": "tensor(float16)"}  # kv_dtype -> ONNX Runtime type


def check_contract(session: ort.InferenceSession, spec: GraphSpec, name: str) -> None:
    inputs = [i.name for i in session.get_inputs()]
    outputs = [o.name for o in session.get_outputs()]
    if inputs != spec.input_names() or outputs != spec.output_names():
        missing = sorted(set(spec.input_names()) ^ set(inputs)) + sorted(set(spec.output_names()) ^ set(outputs))
        raise ContractError(
            f"graph {name!r} does not follow contract {contract.CONTRACT_VERSION} for its manifest entry"
            f" ({spec.num_layers} layers): differing names {missing[:6]}"
        )
    kv_type = _ORT_TYPES[spec.kv_dtype]
    # static dims the manifest fixes: time_major past [1, P, H_kv, D]; head_major_inplace [1, H_kv, T, D]
    want = {spec.layout.heads_axis: spec.num_kv_heads, 3: spec.head_dim}
    for arg in session.get_inputs():
        if arg.name.startswith(("past_key_", "past_value_")):
            dims = list(arg.shape)
            bad = len(dims) != 4 or any(isinstance(dims[i], int) and dims[i] != n for i, n in want.items())
            if bad or arg.type != kv_type:
                raise ContractError(
                    f"graph {name!r} input {arg.name} is {arg.type} {dims}, but its manifest entry says {kv_type}"
                    f" with {spec.num_kv_heads} KV heads x {spec.head_dim} ({spec.kv_layout})"
                )
    shapes = {contract.past_state(j): [1, *shape] for j, shape in enumerate(spec.states)}
    for arg in session.get_inputs():
        want_state = shapes.get(arg.name)
        if want_state is not None and (list(arg.shape) != want_state or arg.type != "tensor(float)"):
            raise ContractError(
                f"graph {name!r} input {arg.name} is {arg.type} {list(arg.shape)}, but its manifest entry says"
                f" tensor(float) {want_state}"
            )
    logits = next(o for o in session.get_outputs() if o.name == contract.LOGITS)
    if isinstance(logits.shape[-1], int) and logits.shape[-1] != spec.embedding_rows:
        raise ContractError(
            f"graph {name!r} returns {logits.shape[-1]} logits per row, but its manifest entry says"
            f" embedding_rows {spec.embedding_rows}"
        )


class OrtModel(CacheCursor):
    """A contract graph with its KV cache on ONNX Runtime (a model.Model); `forward` appends S
    tokens at the cursor."""

    def __init__(
        self,
        path: Path,
        spec: GraphSpec,
        max_context: int,
        config: SessionConfig,
        max_rows: int = 64,
        min_rows: int = 1,
        cache_pad: int = 0,
    ):
        self.spec, self.max_context, self.config = spec, max_context, config
        self.layout = spec.layout
        self.check_min_rows(spec, min_rows, max_rows)
        if not 0 <= cache_pad <= max_rows:
            raise InvalidArgument(f"cache_pad must be in 0..{max_rows}, got {cache_pad!r}")
        self.min_rows = min_rows  # feature row_padding: every call gets >= min_rows rows (plan_rows)
        # cache rows past the last real position that padding writes: call padding (min_rows) and
        # the graph's own padded attention (cache_pad, feature row_padding) add up
        self.cache_rows = max_context + min_rows - 1 + cache_pad
        check_layout_provider(spec, config.provider)
        self.session = make_session(path, config)
        check_contract(self.session, spec, str(path))
        self.dtype = NP_DTYPES[spec.kv_dtype]
        self.device = "cpu" if config.provider == "cpu" else "cuda"
        shape = spec.cache_shape(self.cache_rows)
        self.row_bytes = spec.num_kv_heads * spec.head_dim * np.dtype(self.dtype).itemsize  # one time step
        if self.device == "cpu":
            # filled, not np.zeros: calloc'd pages would be committed lazily as the cache grows,
            # and resident memory would creep up during a long generation
            self._buffers = [np.full(shape, 0, self.dtype) for _ in range(2 * spec.num_layers)]
            self._ptrs = [b.ctypes.data for b in self._buffers]
        else:
            self._buffers = [
                ort.OrtValue.ortvalue_from_shape_and_type(list(shape), self.dtype, "cuda", config.device_id)
                for _ in range(2 * spec.num_layers)
            ]
            self._ptrs = [b.data_ptr() for b in self._buffers]
        # logits: rows of one call land in a host buffer allocated once: [1, max_rows, V] fp32
        self.max_rows = max_rows
        self._logits = np.full((1, max_rows, spec.embedding_rows), 0, np.float32)
        # features (the eagle3_head feature's hidden_states) of every input row: [1, max_rows, F] fp32, bound
        # for calls of up to max_rows rows; longer calls (a prefill) get a buffer from ONNX Runtime
        self._feature_buf = np.full((1, max_rows, spec.feature_width), 0, np.float32) if spec.has_features else None
        self.features: np.ndarray | None = None  # [S, F] of the last call (a view; the next call overwrites it)
        if spec.is_head:  # EAGLE-3 head (feature eagle3_head): zero rows for its unused input side, hidden_out rows
            self._zeros = {
                contract.HEAD_FEATURES: np.zeros((max_rows, spec.feature_width), np.float32),
                contract.HEAD_HIDDEN: np.zeros((max_rows, spec.hidden_width), np.float32),
            }
            self._hidden_out = np.full((1, max_rows, spec.hidden_width), 0, np.float32)
        self.hidden_out: np.ndarray | None = None  # head graphs: [R, H] of the last call (a view)
        # feature recurrent_state: the state after each of the last max_rows + 1 positions (recurrent.py)
        self.states = StateHistory(spec.states, np.float32, max_rows + 1, max_rows) if spec.states else None
        if self.states is not None and self.device != "cpu":
            raise ProviderUnavailable(
                f"recurrent-state graphs keep their states in host memory; got {config.provider!r}"
            )
        self._rows = np.arange(self.cache_rows, dtype=np.int64)  # logits_index views
        self._io = self.session.io_binding()
        # (past K, K output, past V, V output) per layer: new_* (time_major) or present_* (in place)
        self._names = [
            (contract.past_key(i), out_k, contract.past_value(i), out_v)
            for i, (out_k, out_v) in enumerate(map(self.layout.kv_outputs, range(spec.num_layers)))
        ]
        if self.layout.in_place:
            self._bind_in_place(shape)
        self.length = 0  # cursor P: number of valid cache rows
        self.last_start = 0
        self.stats = CallStats()

    def _bind_in_place(self, shape: tuple[int, ...]) -> None:
        """head_major_inplace: past_i and present_i are the same buffer, bound once."""
        self._seqlens = np.zeros(1, np.int32)  # [1] = P + S - 1
        self._total = np.zeros((), np.int32)  # [] = P + S
        self.bind_cache(self._io)

    def bind_cache(self, io: ort.IOBinding) -> None:
        """Bind this model's K/V buffers in place into `io` (head_major_inplace: past_i and
        present_i the same memory): its own session's binding, or another graph's on the same
        cache (the tree graph, tree_model.TreeVerifier)."""
        dev, dt, shape = self.device, self.dtype, list(self.spec.cache_shape(self.cache_rows))
        for i, (pk, ok, pv, ov) in enumerate(self._names):
            for name_in, name_out, ptr in ((pk, ok, self._ptrs[2 * i]), (pv, ov, self._ptrs[2 * i + 1])):
                io.bind_input(name_in, dev, self.config.device_id, dt, shape, ptr)
                io.bind_output(name_out, dev, self.config.device_id, dt, shape, ptr)

    # read-only views for checks (scripts/devicecheck): where the caches and the logits live
    @property
    def cache_buffers(self) -> list:
        """The 2 x num_layers cache buffers, allocated once: numpy arrays (CPU) or OrtValues (device)."""
        return list(self._buffers)

    @property
    def logits_buffer(self) -> np.ndarray:
        """The host buffer [1, max_rows, V] every call's logits rows land in."""
        return self._logits

    def bind_row_outputs(self, io: ort.IOBinding, R: int) -> None:
        """Bind logits_index 0..R-1, the logits [1, R, V] and (feature eagle3_head) the hidden_states
        [1, R, F] of an R-row call into this model's host buffers: another graph's call on this
        cache (tree_model.TreeVerifier), whose results called_rows() then takes."""
        io.bind_cpu_input(contract.LOGITS_INDEX, self._rows[:R])
        logits = [1, R, self.spec.embedding_rows]
        io.bind_output(contract.LOGITS, "cpu", 0, np.float32, logits, self._logits.ctypes.data)
        if self._feature_buf is not None:
            shape = [1, R, self.spec.feature_width]
            io.bind_output(contract.HIDDEN_STATES, "cpu", 0, np.float32, shape, self._feature_buf.ctypes.data)

    def called_rows(self, P: int, R: int) -> np.ndarray:
        """After such a call of R rows at cursor P: the cursor stands at P + R, features holds the
        R rows' [R, F]; returns their logits, a view [R, V] that the next call overwrites."""
        self.length, self.last_start = P + R, P
        if self._feature_buf is not None:
            self.features = self._feature_buf[0, :R]
        return self._logits[0, :R]

    def bound_outputs(self) -> list:
        """The OrtValues the last call's outputs were bound to."""
        return self._io.get_outputs()

    def forward(
        self, ids, last_rows: int = 1, features: np.ndarray | None = None, hidden: np.ndarray | None = None
    ) -> np.ndarray:
        """Feed `ids` (S tokens) at the cursor; return logits of the last `last_rows` of them.

        With min_rows > 1 a shorter call is padded (plan_rows) and the cursor still advances by S.
        Head graphs (feature eagle3_head) also take the rows' features [S, F] or own hidden [S, H] (the
        other side zero) and leave hidden_out [last_rows, H] in self.hidden_out.
        Returns a view [last_rows, V] into a buffer that the next call overwrites."""
        ids = self.check_call(ids, last_rows)  # [1, S]
        S, P = ids.shape[1], self.length
        if self.states is not None and S > MAX_CALL_ROWS and not self.spec.has_features:
            return self._chunked(ids, last_rows)
        call = plan_rows(ids, last_rows, self.min_rows)
        M = call.ids.shape[1]
        io = self._io
        io.bind_cpu_input(contract.INPUT_IDS, call.ids)
        io.bind_cpu_input(contract.LOGITS_INDEX, self._rows[call.first : call.first + call.count])
        if self.layout.in_place:  # the cursor is all that changes; the cache stays bound
            self._seqlens[0], self._total[()] = P + M - 1, P + M
            io.bind_cpu_input(contract.SEQLENS_K, self._seqlens)
            io.bind_cpu_input(contract.TOTAL_SEQUENCE_LENGTH, self._total)
        else:
            self._bind_slots(P, M)
        io.bind_output(
            contract.LOGITS, "cpu", 0, np.float32, [1, call.count, self.spec.embedding_rows], self._logits.ctypes.data
        )
        if self._feature_buf is not None:
            self._bind_features(M)
        if self.spec.is_head:
            self._bind_head(S, call.count, features, hidden)
        if self.states is not None:
            state_rows = self.states.rows(S, last_rows)
            self.states.bind(io, P, state_rows)
        start = time.perf_counter()
        self.session.run_with_iobinding(io)
        self.stats.add(S, time.perf_counter() - start)
        if self.states is not None:
            self.states.store(P, state_rows, S)
        self.length = P + S  # padding rows (P + S .. P + M - 1) are overwritten by the next call
        self.last_start = P  # position of this call's first row (its features' rows start there)
        if self._feature_buf is not None:
            self.features = self._fetch_features(M)[:S]
        if self.spec.is_head:
            self.hidden_out = self._hidden_out[0, call.keep]
        return self._logits[0, call.keep]

    def _chunked(self, ids: np.ndarray, last_rows: int) -> np.ndarray:
        """A long call of a recurrent model (a prefill) as calls of at most MAX_CALL_ROWS rows in
        order, the last holding the returned rows: a scan's intermediates grow with the square of
        its rows (recurrent.py)."""
        S, fed = ids.shape[1], 0
        while (n := solo_piece(S, fed, last_rows)) < S - fed:
            self.forward(ids[:, fed : fed + n])
            fed += n
        return self.forward(ids[:, fed:], last_rows)

    def _bind_head(self, S: int, rows: int, features: np.ndarray | None, hidden: np.ndarray | None) -> None:
        """The head's row inputs: the given side as [1, S, width], zeros on the other."""
        for name, value in ((contract.HEAD_FEATURES, features), (contract.HEAD_HIDDEN, hidden)):
            zeros = self._zeros[name]
            value = head_rows(name, value, S, zeros.shape[1])
            if value is None:  # [S, width] rows of a 2-D buffer reshape with C strides (a [1, max, w] slice would not)
                value = zeros[:S] if S <= self.max_rows else np.zeros((S, zeros.shape[1]), np.float32)
            self._io.bind_cpu_input(name, value.reshape(1, S, -1))
        self._io.bind_output(
            contract.HEAD_HIDDEN_OUT,
            "cpu",
            0,
            np.float32,
            [1, rows, self.spec.hidden_width],
            self._hidden_out.ctypes.data,
        )

    def _bind_features(self, M: int) -> None:
        """hidden_states [1, M, F] into the buffer allocated once, or a fresh one for a long call."""
        if M > self.max_rows:
            self._long_features = np.empty((1, M, self.spec.feature_width), np.float32)
        buf = self._feature_buf if M <= self.max_rows else self._long_features
        self._io.bind_output(
            contract.HIDDEN_STATES, "cpu", 0, np.float32, [1, M, self.spec.feature_width], buf.ctypes.data
        )

    def _fetch_features(self, M: int) -> np.ndarray:
        """[M, F] features of the last call."""
        return (self._feature_buf if M <= self.max_rows else self._long_features)[0, :M]

    def _bind_slots(self, P: int, S: int) -> None:
        """time_major: this model's own call of S rows at the cursor P."""
        self.bind_rows(self._io, P, S)

    def bind_rows(self, io: ort.IOBinding, P: int, S: int) -> None:
        """time_major: past = buffer[:, :P] [1, P, H_kv, D], new = buffer[:, P:P+S] [1, S, H_kv, D]
        (pointer + offset) into `io`: this model's own binding, or the tree graph's on the same
        cache (tree_model.TreeVerifier)."""
        dev, dt, H, D = self.device, self.dtype, self.spec.num_kv_heads, self.spec.head_dim
        past_shape, new_shape, offset = [1, P, H, D], [1, S, H, D], P * self.row_bytes
        for i, (pk, nk, pv, nv) in enumerate(self._names):
            kp, vp = self._ptrs[2 * i], self._ptrs[2 * i + 1]
            io.bind_input(pk, dev, self.config.device_id, dt, past_shape, kp)
            io.bind_input(pv, dev, self.config.device_id, dt, past_shape, vp)
            io.bind_output(nk, dev, self.config.device_id, dt, new_shape, kp + offset)
            io.bind_output(nv, dev, self.config.device_id, dt, new_shape, vp + offset)

    def truncate(self, length: int) -> None:
        """Roll back to `length` rows; a recurrent model also needs the state after them kept."""
        if self.states is not None and 0 <= length <= self.length:
            self.states.rollback(length)  # InvalidArgument when its state is not kept
        super().truncate(length)

    def reset(self) -> None:
        if self.states is not None:
            self.states.reset()
        super().reset()

    def keep_path(self, start: int, rows: Sequence[int]) -> None:
        """After a tree call whose row r was written at cache row start + r (row 0 the root, the
        last committed token), keep the accepted path: its rows (ascending, root excluded) move
        to start + 1, start + 2, ... and the cursor stands after them (CPU buffers only). The
        features of a tree call at `start` become the root's and the path's rows [1 + n, F]."""
        if self.device != "cpu":
            raise InvalidArgument("keep_path moves host buffers; this model's cache is on the device")
        if not 0 <= start < self.length:
            raise InvalidArgument(f"the tree's root row {start} is not a cached row (length {self.length})")
        if any(not 1 <= int(r) < self.length - start for r in rows):
            raise InvalidArgument(f"path rows must be tree rows 1..{self.length - start - 1}, got {list(rows)}")
        src = [start + int(r) for r in rows]
        move_rows(self._buffers, self.layout.time_axis, src, start + 1)
        self.length = start + 1 + len(src)
        if self.features is not None and self.last_start == start:
            self.features = self.features[[0, *(int(r) for r in rows)]]

    def kv_rows(self, start: int, stop: int) -> list[np.ndarray]:
        """Views of cache rows [start, stop) of every K/V buffer as [n, H_kv, D], whatever the
        layout (CPU buffers only; for inspection and tests)."""
        if self.device != "cpu":
            raise InvalidArgument("kv_rows reads host buffers; this model's cache is on the device")
        axis = self.layout.time_axis - 1  # of b[0]: [T, H_kv, D] or [H_kv, T, D]
        return [np.moveaxis(b[0], axis, 0)[start:stop] for b in self._buffers]

    def kv_nbytes(self) -> int:
        """Bytes of the K/V buffers and (feature recurrent_state) the kept states."""
        return self.spec.kv_bytes(self.cache_rows) + (self.states.nbytes() if self.states is not None else 0)
