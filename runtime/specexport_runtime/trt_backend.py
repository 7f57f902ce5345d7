"""Native TensorRT backend: a contract graph's engine with its KV cache in device memory.

NOT RUN ON A GPU YET: no GPU has been available to this project (docs/gpu.md). The pure
Python parts (profile choice, address arithmetic, engine-record checks, chunking) are unit
tested; the TensorRT / CUDA calls follow the TensorRT 10 and cuda-python APIs and have not
been executed.

`TrtModel` implements model.Model (forward / truncate / reset / length / free / stats /
kv_nbytes, and the feature tensors of EAGLE-3), so the speculative loop runs on it unchanged:

  * KV buffers: one device buffer per layer and per K/V of shape [1, T_max, H_kv, D], allocated
    once with cudaMalloc. A call with S tokens at cursor P binds
        past_*  -> buffer              shape [1, P, H_kv, D]   (the valid prefix, no copy)
        new_*   -> buffer + P*row      shape [1, S, H_kv, D]   (TensorRT writes the slot)
    where row = H_kv * D * itemsize bytes. TensorRT wants I/O addresses 256-byte aligned; when
    P*row is not (row not a multiple of 256, e.g. fp16 with H_kv*D = 192), that call's new K/V
    go to an aligned staging buffer and one device-to-device copy moves them into the slot.
  * One CUDA stream; one execution context per optimization profile (decode, verify, prefill),
    all sharing one scratch allocation (ExecutionContextAllocationStrategy.USER_MANAGED), each
    bound to its profile once; a call picks the context by S (trt_engines.select_profile).
  * input_ids / logits_index go through pinned host buffers; after execute_async_v3 only the R
    requested logits rows (R x V x 4 bytes) are copied back to a pinned host buffer.
  * Prompts longer than the prefill profile's max S are fed in chunks (the cursor moves, the
    positions stay right: positions come from the past length, docs/graph-contract.md).
  * EAGLE-3 (feature eagle3_head; plan_row_tensors): a target's hidden_states [1, S, F] and a head's
    hidden_out [1, R, H] are written to device buffers and copied back to pinned host buffers
    after each call (`features`, `hidden_out`, as OrtModel leaves them); a head's features
    [1, S, F] and draft_hidden [1, S, H] inputs go from pinned host buffers to the device, the
    side not given as zeros. All four are float32 at every precision.

`api.load(artifact, backend="tensorrt")` returns a SpecGenerator whose target and draft are
TrtModels (TrtModel.from_entry), after the same signature, checksum and config checks as on ONNX
Runtime. The pure parts (bindings, row tensors, chunks, profile limits) are in trt_bindings.py.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from . import contract
from .contract import GraphSpec
from .errors import ContractError, InvalidArgument
from .model import CacheCursor, CallStats, head_rows, plan_rows
from .paths import confined
from .trt_bindings import (
    ALIGNMENT,
    ITEMSIZE,
    KvBinding,
    RowTensor,
    max_rows,
    max_seq,
    needs_staging,
    plan_kv_bindings,
    plan_row_tensors,
    prefill_chunks,
    prefill_limit,
    slot_address,
)
from .trt_build import TensorRTUnavailable, cuda_check, gpu_info, import_cudart, import_tensorrt, trt_version_of
from .trt_engines import (
    EngineMismatch,
    EngineRecord,
    GpuInfo,
    Profile,
    find_record,
    read_records,
    rebuild_command,
    select_profile,
)

__all__ = [
    "ALIGNMENT",
    "EngineMismatch",
    "KvBinding",
    "RowTensor",
    "TensorRTUnavailable",
    "TrtModel",
    "plan_kv_bindings",
    "plan_row_tensors",
    "prefill_chunks",
    "slot_address",
]


# --------------------------------------------------------------------------- CUDA helpers


class _Cuda:
    """The few cuda-python runtime calls the backend needs; every call is checked."""

    def __init__(self, device_id: int):
        self.rt = import_cudart()
        cuda_check(self.rt.cudaSetDevice(device_id), "cudaSetDevice")
        self.stream = cuda_check(self.rt.cudaStreamCreate(), "cudaStreamCreate")
        self.handle = int(self.stream)

    def malloc(self, nbytes: int) -> int:
        return int(cuda_check(self.rt.cudaMalloc(max(nbytes, 1)), f"cudaMalloc({nbytes})"))

    def malloc_host(self, nbytes: int) -> int:
        return int(cuda_check(self.rt.cudaMallocHost(max(nbytes, 1)), f"cudaMallocHost({nbytes})"))

    def h2d(self, dst: int, src: int, nbytes: int) -> None:
        kind = self.rt.cudaMemcpyKind.cudaMemcpyHostToDevice
        cuda_check(self.rt.cudaMemcpyAsync(dst, src, nbytes, kind, self.stream), "cudaMemcpyAsync H2D")

    def d2h(self, dst: int, src: int, nbytes: int) -> None:
        kind = self.rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
        cuda_check(self.rt.cudaMemcpyAsync(dst, src, nbytes, kind, self.stream), "cudaMemcpyAsync D2H")

    def d2d(self, dst: int, src: int, nbytes: int) -> None:
        kind = self.rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice
        cuda_check(self.rt.cudaMemcpyAsync(dst, src, nbytes, kind, self.stream), "cudaMemcpyAsync D2D")

    def sync(self) -> None:
        cuda_check(self.rt.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")

    def free(self, ptr: int) -> None:
        self.rt.cudaFree(ptr)

    def free_host(self, ptr: int) -> None:
        self.rt.cudaFreeHost(ptr)

    def close(self) -> None:
        self.rt.cudaStreamDestroy(self.stream)


def _host_array(ptr: int, count: int, dtype) -> np.ndarray:
    ctype = np.ctypeslib.as_ctypes_type(np.dtype(dtype))
    return np.ctypeslib.as_array((ctype * count).from_address(ptr))


# --------------------------------------------------------------------------- the model


class TrtModel(CacheCursor):
    """A contract graph's TensorRT engine with its KV cache (a model.Model); `forward` appends S
    tokens at the cursor."""

    def __init__(
        self,
        engine_path: str | Path,
        spec: GraphSpec,
        max_context: int,
        profiles: Sequence[Profile],
        device_id: int = 0,
        min_rows: int = 1,
    ):
        check_layout(spec)
        trt = import_tensorrt()
        self.spec, self.max_context, self.profiles = spec, max_context, list(profiles)
        self.min_rows = min_rows  # feature row_padding: every call gets >= min_rows rows (engine.plan_rows)
        self.cuda = _Cuda(device_id)
        self._device_ptrs: list[int] = []
        self._host_ptrs: list[int] = []
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(self.logger)
        self.engine = self.runtime.deserialize_cuda_engine(Path(engine_path).read_bytes())
        if self.engine is None:
            raise EngineMismatch(
                f"TensorRT could not deserialize {str(engine_path)!r} (built for another GPU or TensorRT version?)"
            )
        self._check_io(trt)
        if self.engine.num_optimization_profiles != len(self.profiles):
            raise EngineMismatch(
                f"{engine_path} has {self.engine.num_optimization_profiles} profiles,"
                f" engines.json records {len(self.profiles)}"
            )
        # scratch memory shared by one context per profile (they run one at a time on one stream)
        size_attr = "device_memory_size_v2" if hasattr(self.engine, "device_memory_size_v2") else "device_memory_size"
        scratch_bytes = int(getattr(self.engine, size_attr))
        self._scratch = self._dev(scratch_bytes)
        strategy = getattr(trt, "ExecutionContextAllocationStrategy", None)
        self.contexts = []
        for index in range(len(self.profiles)):
            if strategy is not None:
                ctx = self.engine.create_execution_context(strategy.USER_MANAGED)
                if hasattr(ctx, "set_device_memory"):
                    ctx.set_device_memory(self._scratch, scratch_bytes)
                else:
                    ctx.device_memory = self._scratch
            else:
                ctx = self.engine.create_execution_context()
            if not ctx.set_optimization_profile_async(index, self.cuda.handle):
                raise EngineMismatch(f"could not select optimization profile {index} of {engine_path}")
            self.contexts.append(ctx)
        self.cuda.sync()
        # KV cache at max context, allocated once
        itemsize = ITEMSIZE[spec.kv_dtype]
        self.row_bytes = spec.num_kv_heads * spec.head_dim * itemsize
        cache_bytes = (max_context + min_rows - 1) * self.row_bytes  # + padding rows past the last position
        self._kv = [self._dev(cache_bytes) for _ in range(2 * spec.num_layers)]
        self.max_seq, self.max_rows = max_seq(self.profiles), max_rows(self.profiles)
        self.check_min_rows(spec, min_rows, self.max_rows)
        self.prefill_limit = prefill_limit(self.profiles, min_rows)
        self._staging = (
            [self._dev(self.max_seq * self.row_bytes) for _ in range(2 * spec.num_layers)]
            if needs_staging(spec)
            else None
        )
        # ids, rows and logits: device buffers plus pinned host buffers
        ids_dtype = trt.nptype(self.engine.get_tensor_dtype(contract.INPUT_IDS))
        rows_dtype = trt.nptype(self.engine.get_tensor_dtype(contract.LOGITS_INDEX))
        self._ids_dtype, self._rows_dtype = np.dtype(ids_dtype), np.dtype(rows_dtype)
        self._d_ids = self._dev(self.max_seq * self._ids_dtype.itemsize)
        self._d_rows = self._dev(self.max_rows * self._rows_dtype.itemsize)
        V = spec.embedding_rows
        self._d_logits = self._dev(self.max_rows * V * 4)
        self._h_ids = _host_array(self._host(self.max_seq * self._ids_dtype.itemsize), self.max_seq, self._ids_dtype)
        self._h_rows = _host_array(
            self._host(self.max_rows * self._rows_dtype.itemsize), self.max_rows, self._rows_dtype
        )
        self._h_logits = _host_array(self._host(self.max_rows * V * 4), self.max_rows * V, np.float32).reshape(
            self.max_rows, V
        )
        # EAGLE-3 tensors: name -> (its plan, device buffer, pinned host [capacity, width] float32)
        self._row_tensors = {
            t.name: (
                t,
                self._dev(t.capacity * t.width * 4),
                _host_array(self._host(t.capacity * t.width * 4), t.capacity * t.width, np.float32).reshape(
                    t.capacity, t.width
                ),
            )
            for t in plan_row_tensors(spec, self.max_seq, self.max_rows)
        }
        self.length = self.last_start = 0
        self.features: np.ndarray | None = None  # a target's [S, F] of the last call (a view)
        self.hidden_out: np.ndarray | None = None  # a head's [last_rows, H] of the last call (a view)
        self.stats = CallStats()

    # -- allocation bookkeeping
    def _dev(self, nbytes: int) -> int:
        ptr = self.cuda.malloc(nbytes)
        self._device_ptrs.append(ptr)
        return ptr

    def _host(self, nbytes: int) -> int:
        ptr = self.cuda.malloc_host(nbytes)
        self._host_ptrs.append(ptr)
        return ptr

    def _check_io(self, trt) -> None:
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        expected = self.spec.input_names() + self.spec.output_names()
        if sorted(names) != sorted(expected):
            diff = sorted(set(names) ^ set(expected))
            raise ContractError(f"engine tensors differ from contract {contract.CONTRACT_VERSION}: {diff[:6]}")
        kv = trt.nptype(self.engine.get_tensor_dtype(contract.past_key(0)))
        if np.dtype(kv) != np.dtype(self.spec.kv_dtype):
            raise ContractError(f"engine KV dtype {np.dtype(kv)} differs from the manifest's {self.spec.kv_dtype}")

    # -- model.Model (free, truncate, reset and the call checks come from CacheCursor)

    def kv_nbytes(self) -> int:
        return self.spec.kv_bytes(self.max_context)

    def forward(
        self, ids, last_rows: int = 1, features: np.ndarray | None = None, hidden: np.ndarray | None = None
    ) -> np.ndarray:
        """Feed `ids` (S tokens) at the cursor; return logits of the last `last_rows` of them.

        With min_rows > 1 a shorter call is padded (plan_rows) and the cursor still advances by S.
        Head graphs also take the rows' features [S, F] or own hidden [S, H] (the other side
        zero) and leave hidden_out [last_rows, H]; a target with features leaves features [S, F].
        Returns a view [last_rows, V] into a pinned buffer that the next call overwrites."""
        ids = self.check_call(ids, last_rows)[0]  # [S]
        S, P = ids.size, self.length
        rows_in = {}
        if self.spec.is_head:
            rows_in = {
                contract.HEAD_FEATURES: head_rows(contract.HEAD_FEATURES, features, S, self.spec.feature_width),
                contract.HEAD_HIDDEN: head_rows(contract.HEAD_HIDDEN, hidden, S, self.spec.hidden_width),
            }
        sizes = prefill_chunks(S, self.prefill_limit) if last_rows == 1 and S > self.prefill_limit else [S]
        start, parts = 0, []
        for size in sizes:  # each call padded to min_rows (plan_rows; min_rows 1: the plain call)
            call = plan_rows(ids[None, start : start + size], last_rows, self.min_rows)
            chunk = {name: None if v is None else v[start : start + size] for name, v in rows_in.items()}
            out = self._run(call.ids[0], call.count, call.first, chunk)[call.keep]
            start += size
            self.length = P + start  # padding rows are overwritten by the next call
            if self.features is not None:  # the next chunk overwrites the pinned rows
                parts.append(self.features[:size].copy() if len(sizes) > 1 else self.features[:size])
        self.last_start = P
        self.features = (parts[0] if len(parts) == 1 else np.concatenate(parts)) if parts else None
        if self.hidden_out is not None:
            self.hidden_out = self.hidden_out[call.keep]
        return out

    def _run(
        self, ids: np.ndarray, rows: int, first: int | None = None, inputs: dict[str, np.ndarray | None] | None = None
    ) -> np.ndarray:
        """One engine call on ids [S]; logits rows first .. first + rows - 1 (default: the last
        rows). inputs: a head's row inputs, [S, width] each, None for zeros."""
        S, P, cuda = ids.size, self.length, self.cuda
        first = S - rows if first is None else first
        ctx = self.contexts[select_profile(self.profiles, S, rows, P)]
        start = time.perf_counter()
        self._h_ids[:S] = ids
        self._h_rows[:rows] = np.arange(first, first + rows)
        cuda.h2d(self._d_ids, self._h_ids.ctypes.data, S * self._ids_dtype.itemsize)
        cuda.h2d(self._d_rows, self._h_rows.ctypes.data, rows * self._rows_dtype.itemsize)
        ok = ctx.set_input_shape(contract.INPUT_IDS, (1, S)) and ctx.set_input_shape(contract.LOGITS_INDEX, (rows,))
        ok = ok and ctx.set_tensor_address(contract.INPUT_IDS, self._d_ids)
        ok = ok and ctx.set_tensor_address(contract.LOGITS_INDEX, self._d_rows)
        ok = ok and ctx.set_tensor_address(contract.LOGITS, self._d_logits)
        bindings, copies = plan_kv_bindings(self.spec, self._kv, P, S, self._staging)
        for b in bindings:
            if b.is_input:
                ok = ok and ctx.set_input_shape(b.name, b.shape)
            ok = ok and ctx.set_tensor_address(b.name, b.address)
        for tensor, device, host in self._row_tensors.values():
            if tensor.is_input:
                value = (inputs or {}).get(tensor.name)
                host[:S] = 0 if value is None else value
                cuda.h2d(device, host.ctypes.data, S * tensor.width * 4)
                ok = ok and ctx.set_input_shape(tensor.name, (1, S, tensor.width))
            ok = ok and ctx.set_tensor_address(tensor.name, device)
        if not ok:
            raise InvalidArgument(f"TensorRT refused the shapes/addresses of a call with S={S}, R={rows}, P={P}")
        if not ctx.execute_async_v3(cuda.handle):
            raise InvalidArgument(f"TensorRT execute_async_v3 failed for S={S}, R={rows}, P={P}")
        for dst, src, nbytes in copies:
            cuda.d2d(dst, src, nbytes)
        V = self.spec.embedding_rows
        cuda.d2h(self._h_logits.ctypes.data, self._d_logits, rows * V * 4)
        returned = {}  # output name -> its rows on the host
        for tensor, device, host in self._row_tensors.values():
            if not tensor.is_input:
                n = rows if tensor.per_logits_row else S
                cuda.d2h(host.ctypes.data, device, n * tensor.width * 4)
                returned[tensor.name] = host[:n]
        cuda.sync()
        self.stats.add(S, time.perf_counter() - start)
        self.length, self.last_start = P + S, P
        self.features = returned.get(contract.HIDDEN_STATES)
        self.hidden_out = returned.get(contract.HEAD_HIDDEN_OUT)
        return self._h_logits[:rows]

    def close(self) -> None:
        """Free device and pinned memory (also done when the object is collected)."""
        cuda = getattr(self, "cuda", None)
        if cuda is None:
            return
        self.contexts = []
        for ptr in self._device_ptrs:
            cuda.free(ptr)
        for ptr in self._host_ptrs:
            cuda.free_host(ptr)
        self._device_ptrs, self._host_ptrs = [], []
        cuda.close()
        self.cuda = None

    def __del__(self):  # pragma: no cover - needs a GPU
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # -- construction from an artifact
    @classmethod
    def from_artifact(cls, root: str | Path, model: str = "target", device_id: int = 0) -> TrtModel:
        from .manifest import read_manifest  # noqa: PLC0415

        return cls.from_entry(Path(root), read_manifest(root), model, device_id)

    @classmethod
    def from_entry(cls, root: Path, manifest, model: str = "target", device_id: int = 0) -> TrtModel:
        """The engine of manifest's `model` entry (target | draft) recorded in root/engines.json
        for this GPU and TensorRT version; EngineMismatch, naming the rebuild command, otherwise."""
        entry = manifest.target if model == "target" else manifest.draft
        if entry is None:
            raise InvalidArgument(f"artifact {str(root)!r} has no {model} graph")
        check_layout(entry.graph_spec())  # before the engine lookup: no engine is ever built from a fused graph
        record = engine_for(root, model, manifest.files.get(entry.graph), device_id)
        return cls(
            confined(root, record.engine, "engines.json engine"),
            entry.graph_spec(),
            manifest.max_context,
            record.profiles,
            device_id,
            min_rows=entry.min_rows,
        )


def check_layout(spec: GraphSpec) -> None:
    """ContractError unless the graph is in the portable (time_major) layout, the one TensorRT builds."""
    if spec.layout.contrib_attention or spec.layout.in_place:
        raise ContractError(
            f"the native TensorRT backend runs time_major graphs (recipe graph: portable); this graph is"
            f" {spec.kv_layout}"
        )
    if spec.states:
        raise ContractError(
            f"the native TensorRT backend binds no recurrent state in this version (feature recurrent_state, contract"
            f" {contract.RECURRENT_VERSION}); run this hybrid model with backend onnxruntime, provider cpu"
        )


def engine_for(
    root: Path,
    model: str,
    graph_sha256: str | None,
    device_id: int = 0,
    gpu: GpuInfo | None = None,
    trt_version: str | None = None,
) -> EngineRecord:
    """The checked engines.json record of `model` for this GPU and TensorRT version."""
    if trt_version is None:
        trt_version = trt_version_of(import_tensorrt())
    if gpu is None:
        gpu = gpu_info(device_id)
    record = find_record(read_records(root), model, gpu, trt_version, root, graph_sha256)
    if not confined(root, record.engine, "engines.json engine").is_file():
        raise EngineMismatch(f"engine file {record.engine!r} is missing; rebuild it: {rebuild_command(root, record)}")
    return record
