"""A CPU stand-in for TensorRT and cuda-python, enough of both for trt_backend.TrtModel to run a
contract graph through its own bindings without a GPU.

"Device" and "pinned host" memory are numpy byte blocks addressed by their real addresses, kept in
two separate pools, so every copy is checked for its direction and bounds. An engine file holds
JSON naming an ONNX graph and the (min, max) input shapes of each optimization profile, as
trt_engines.profile_shapes gives them; an execution context checks that every input shape lies in
its profile and every address in an allocated block, reads the inputs at their addresses, runs
the graph on ONNX Runtime's CPU provider and writes each output at its bound address. This tests
the binding logic (names, shapes, addresses, copies, profile choice), not TensorRT: nothing here
says the backend runs on a GPU.
"""

from __future__ import annotations

import ctypes
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from specexport_runtime.engine import SessionConfig, make_session
from specexport_runtime.manifest import read_manifest
from specexport_runtime.trt_engines import (
    EngineRecord,
    GpuInfo,
    Profile,
    default_profiles,
    engine_dir_name,
    profile_shapes,
    write_records,
)

GPU = GpuInfo("CPU stand-in", "0.0")  # what gpu_info reports through FakeCudart

_ORT_TYPES = {
    "tensor(int64)": np.dtype(np.int64),
    "tensor(int32)": np.dtype(np.int32),
    "tensor(float)": np.dtype(np.float32),
    "tensor(float16)": np.dtype(np.float16),
}


class Memory:
    """Two pools of byte blocks, ptr -> block: the device's and the pinned host's."""

    def __init__(self):
        self.pools: dict[str, dict[int, np.ndarray]] = {"device": {}, "host": {}}

    def alloc(self, pool: str, nbytes: int) -> int:
        block = np.zeros(max(nbytes, 1), np.uint8)
        self.pools[pool][block.ctypes.data] = block
        return block.ctypes.data

    def free(self, pool: str, ptr: int) -> None:
        del self.pools[pool][ptr]

    def check(self, pool: str, ptr: int, nbytes: int) -> None:
        """[ptr, ptr + nbytes) lies inside one block of `pool`."""
        for base, block in self.pools[pool].items():
            if base <= ptr and ptr + nbytes <= base + block.size:
                return
        raise AssertionError(f"{nbytes} bytes at {ptr:#x} are not inside one {pool} block")

    def view(self, ptr: int, shape, dtype) -> np.ndarray:
        """A device tensor [shape] of dtype at ptr (a view: writes land in the block)."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        self.check("device", ptr, nbytes)
        raw = (ctypes.c_uint8 * max(nbytes, 1)).from_address(ptr)
        return np.frombuffer(raw, np.uint8, count=nbytes).view(dtype).reshape(shape)


class FakeCudart:
    """The cuda-python runtime calls trt_backend._Cuda makes; each returns (error, *values)."""

    cudaMemcpyKind = SimpleNamespace(
        cudaMemcpyHostToDevice="h2d", cudaMemcpyDeviceToHost="d2h", cudaMemcpyDeviceToDevice="d2d"
    )
    _POOLS = {"h2d": ("host", "device"), "d2h": ("device", "host"), "d2d": ("device", "device")}

    def __init__(self, memory: Memory):
        self.memory = memory
        self.copies: list[tuple[str, int]] = []  # (kind, nbytes) of every copy

    def cudaSetDevice(self, device_id):
        return (0,)

    def cudaGetDeviceCount(self):
        return (0, 1)

    def cudaGetDeviceProperties(self, device_id):
        return (0, SimpleNamespace(name=GPU.name.encode(), major=0, minor=0, totalGlobalMem=1 << 30))

    def cudaStreamCreate(self):
        return (0, 7)

    def cudaStreamSynchronize(self, stream):
        return (0,)

    def cudaStreamDestroy(self, stream):
        return (0,)

    def cudaMalloc(self, nbytes):
        return (0, self.memory.alloc("device", nbytes))

    def cudaMallocHost(self, nbytes):
        return (0, self.memory.alloc("host", nbytes))

    def cudaFree(self, ptr):
        self.memory.free("device", ptr)
        return (0,)

    def cudaFreeHost(self, ptr):
        self.memory.free("host", ptr)
        return (0,)

    def cudaMemcpyAsync(self, dst, src, nbytes, kind, stream):
        src_pool, dst_pool = self._POOLS[kind]
        self.memory.check(src_pool, src, nbytes)
        self.memory.check(dst_pool, dst, nbytes)
        ctypes.memmove(dst, src, nbytes)
        self.copies.append((kind, nbytes))
        return (0,)


class FakeContext:
    def __init__(self, engine: FakeEngine):
        self.engine, self.profile, self.shapes, self.addresses = engine, None, {}, {}

    def set_device_memory(self, ptr, nbytes):
        self.engine.memory.check("device", ptr, nbytes)

    def set_optimization_profile_async(self, index, stream):
        self.profile = index
        return 0 <= index < len(self.engine.profiles)

    def set_input_shape(self, name, shape):
        if name not in self.engine.inputs:
            raise AssertionError(f"{name!r} is not an input of the engine")
        self.shapes[name] = tuple(int(d) for d in shape)
        return True

    def set_tensor_address(self, name, ptr):
        if name not in self.engine.inputs and name not in self.engine.outputs:
            raise AssertionError(f"{name!r} is not a tensor of the engine")
        self.addresses[name] = int(ptr)
        return True

    def execute_async_v3(self, stream):
        engine, ranges = self.engine, self.engine.profiles[self.profile]
        feeds = {}
        for name, dtype in engine.inputs.items():
            shape = self.shapes[name]
            lo, hi = ranges[name]
            if not all(a <= d <= b for a, d, b in zip(lo, shape, hi, strict=True)):
                raise AssertionError(f"{name} shape {shape} is outside profile {self.profile}: {lo} .. {hi}")
            feeds[name] = engine.memory.view(self.addresses[name], shape, dtype).copy()
        outputs = engine.session.run(None, feeds)
        for (name, dtype), value in zip(engine.outputs.items(), outputs, strict=True):
            engine.memory.view(self.addresses[name], value.shape, dtype)[...] = value
        engine.calls.append({name: self.shapes[name] for name in engine.inputs} | {"profile": self.profile})
        return True


class FakeEngine:
    device_memory_size_v2 = 4096

    def __init__(self, record: dict, memory: Memory):
        self.memory, self.calls = memory, []
        self.session = make_session(Path(record["graph"]), SessionConfig(provider="cpu", threads=1))
        self.inputs = {i.name: _ORT_TYPES[i.type] for i in self.session.get_inputs()}
        self.outputs = {o.name: _ORT_TYPES[o.type] for o in self.session.get_outputs()}
        self.profiles = [{name: tuple(map(tuple, r)) for name, r in p.items()} for p in record["profiles"]]
        self.num_optimization_profiles = len(self.profiles)
        self.names = list(self.inputs) + list(self.outputs)
        self.num_io_tensors = len(self.names)

    def get_tensor_name(self, index):
        return self.names[index]

    def get_tensor_dtype(self, name):
        return {**self.inputs, **self.outputs}[name]

    def create_execution_context(self, strategy=None):
        return FakeContext(self)


class FakeTensorRT:
    """The `tensorrt` module as trt_backend.TrtModel uses it; `engines` lists every engine loaded."""

    __version__ = "10.3.0"
    ExecutionContextAllocationStrategy = SimpleNamespace(USER_MANAGED="user-managed")

    class Logger:
        WARNING = 2

        def __init__(self, level):
            self.level = level

    def __init__(self, memory: Memory):
        self.memory, self.engines = memory, []
        fake = self

        class Runtime:
            def __init__(self, logger):
                pass

            def deserialize_cuda_engine(self, data: bytes):
                engine = FakeEngine(json.loads(data), fake.memory)
                fake.engines.append(engine)
                return engine

        self.Runtime = Runtime

    @staticmethod
    def nptype(dtype):
        return dtype


def write_engine(path: Path, graph: Path, spec, profiles: list[Profile]) -> Path:
    """An "engine" file for FakeTensorRT: the graph and each profile's (min, max) input shapes."""
    ranges = []
    for profile in profiles:
        shapes = profile_shapes(spec, profile)
        ranges.append({name: [list(lo), list(hi)] for name, (lo, _opt, hi) in shapes.items()})
    path.write_text(json.dumps({"graph": str(graph), "profiles": ranges}), encoding="utf-8")
    return path


def write_engines(root: Path, max_prompt: int = 8, max_gamma: int = 8) -> list[EngineRecord]:
    """What trt_build.build_artifact_engines leaves for the fake GPU: an "engine" file per graph
    of the artifact (its profiles as the build derives them) and their engines.json records."""
    manifest = read_manifest(root)
    min_rows = max(e.min_rows for e in (manifest.target, manifest.draft) if e is not None)
    profiles = default_profiles(manifest.max_context, max_prompt, max_gamma, manifest.speculation.gamma, min_rows)
    folder = Path("engines") / engine_dir_name(GPU.name, FakeTensorRT.__version__)
    (root / folder).mkdir(parents=True, exist_ok=True)
    records = []
    for model, entry in (("target", manifest.target), ("draft", manifest.draft)):
        if entry is None:
            continue
        write_engine(root / folder / f"{model}.engine", root / entry.graph, entry.graph_spec(), profiles)
        records.append(
            EngineRecord(
                model=model,
                graph=entry.graph,
                graph_sha256=manifest.files.get(entry.graph, ""),
                engine=(folder / f"{model}.engine").as_posix(),
                gpu_name=GPU.name,
                compute_capability=GPU.compute_capability,
                tensorrt_version=FakeTensorRT.__version__,
                precision_flags=(),
                max_context=manifest.max_context,
                max_prompt=min(max_prompt, manifest.max_context),
                max_gamma=max_gamma,
                profiles=tuple(profiles),
            )
        )
    write_records(root, records)
    return records


def install(monkeypatch) -> tuple[FakeTensorRT, FakeCudart]:
    """Make trt_backend (and trt_build's gpu_info) import the fakes (one memory for both)."""
    from specexport_runtime import trt_backend, trt_build

    memory = Memory()
    trt, cudart = FakeTensorRT(memory), FakeCudart(memory)
    monkeypatch.setattr(trt_backend, "import_tensorrt", lambda: trt)
    monkeypatch.setattr(trt_backend, "import_cudart", lambda: cudart)
    monkeypatch.setattr(trt_build, "import_cudart", lambda: cudart)
    return trt, cudart
