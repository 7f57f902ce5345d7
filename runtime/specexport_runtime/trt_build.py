"""Build TensorRT engines from an artifact's ONNX graphs, on the device that will run them.

    python -m specexport_runtime.trt_build ARTIFACT [--fp16] [--max-prompt N] [--max-gamma N]

NOT RUN ON A GPU YET: no GPU has been available to this project (docs/gpu.md). The pure
Python parts (profiles and engine records in trt_engines.py, the build options and refusals here)
are unit tested; the TensorRT calls follow the TensorRT 10 Python API (IBuilder / IOnnxParser /
IBuilderConfig / optimization profiles / timing cache / IProgressMonitor) and have not been
executed.

One engine per graph (target, draft), each with the three optimization profiles decode, verify
and prefill over the dynamic dimensions seq S, past P and rows R of the graph contract
(trt_engines.default_profiles; batch is fixed at 1). The prefill profile is capped at
`max_prompt` tokens (default 512): the native backend (trt_backend.py) feeds longer prompts in
chunks.

Engines are written to ARTIFACT/engines/<gpu-name>-<tensorrt-version>/{target,draft}.engine with
a timing cache beside them, and recorded in ARTIFACT/engines.json (trt_engines.EngineRecord):
manifest.json is not modified (its `files` checksums do not cover engines; verify_files ignores
unlisted files).

Only `numpy` and the standard library are imported at module level; `tensorrt` and `cuda-python`
are imported when a build starts (install specexport-runtime[tensorrt], or JetPack's TensorRT).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from . import contract
from .constants import DEFAULT_MAX_GAMMA
from .errors import ProviderUnavailable, SpecExportError
from .trt_engines import (
    DEFAULT_MAX_PROMPT,
    ENGINES_DIR,
    EngineRecord,
    GpuInfo,
    Profile,
    default_profiles,
    engine_dir_name,
    profile_shapes,
    write_records,
)

DEFAULT_WORKSPACE_MIB = 1024
QUANTIZED_PRECISIONS = ("int8", "int4", "dynamic-int8")  # MatMulNBits / MatMulInteger graphs


class TensorRTUnavailable(ProviderUnavailable):
    """tensorrt or cuda-python is not installed, or no CUDA GPU is visible."""


class EngineBuildError(SpecExportError):
    """TensorRT could not parse a graph or build an engine."""


class CudaError(SpecExportError):
    """A CUDA runtime call failed (out of memory, invalid device, ...)."""


# --------------------------------------------------------------------------- build plan (pure)


@dataclass(frozen=True)
class BuildOptions:
    fp16: bool = False  # allow fp16 kernels for an fp32 graph (fp16 graphs always get the flag)
    bf16: bool = False
    strongly_typed: bool = False  # follow the graph's types exactly (no precision flags then)
    max_prompt: int = DEFAULT_MAX_PROMPT
    max_gamma: int | None = None  # None: max(DEFAULT_MAX_GAMMA, Manifest.max_gamma)
    workspace_mib: int = DEFAULT_WORKSPACE_MIB
    models: tuple[str, ...] = ("target", "draft")
    quiet: bool = False


def precision_flags(graph_precision: str, options: BuildOptions, qdq: set[str] = frozenset()) -> list[str]:
    """Builder flags for one graph: fp16 graphs get FP16; Q/DQ nodes add INT8 (and FP8 for
    float8 Q/DQ). Strongly typed networks take no precision flags (TensorRT refuses them)."""
    if options.strongly_typed:
        return []
    flags: list[str] = []
    if options.fp16 or graph_precision == "fp16":
        flags.append("fp16")
    if options.bf16:
        flags.append("bf16")
    if "int8" in qdq:
        flags.append("int8")
    if "fp8" in qdq:
        flags.append("fp8")
    return flags


def refuse_quantized(model: str, precision: str) -> None:
    if precision in QUANTIZED_PRECISIONS:
        raise EngineBuildError(
            f"the {model} graph is {precision} (MatMulNBits / DynamicQuantizeLinear + MatMulInteger, ONNX Runtime"
            " operators TensorRT does not implement): TensorRT cannot build it. Build the artifact with an fp16 draft"
            " (draft precision fp16, or a separate draft model), or run this artifact on the ONNX Runtime CUDA"
            " provider (`--provider cuda`); `specexport check-trt` lists the operators."
        )


def refuse_fused(model: str, kv_layout: str) -> None:
    if contract.layout_of(kv_layout).contrib_attention:
        raise EngineBuildError(
            f"the {model} graph uses the {kv_layout} layout (ONNX Runtime contrib ops such as GroupQueryAttention,"
            " which TensorRT does not implement): TensorRT cannot build it. Rebuild the artifact with"
            " `graph: portable` in the recipe, or run this artifact on the ONNX Runtime CPU/CUDA provider."
        )


def resolve_max_gamma(manifest, options: BuildOptions) -> int:
    if options.max_gamma is not None:
        return options.max_gamma
    return max(DEFAULT_MAX_GAMMA, manifest.max_gamma)


# --------------------------------------------------------------------------- TensorRT / CUDA access


def import_tensorrt():
    try:
        import tensorrt as trt  # noqa: PLC0415
    except (ImportError, OSError) as exc:  # OSError: the wheel is there but libnvinfer is not
        raise TensorRTUnavailable(
            "the tensorrt Python package is not installed: install specexport-runtime[tensorrt] on a CUDA machine,"
            " or use JetPack's TensorRT on Jetson (sudo apt install python3-libnvinfer); see docs/gpu.md"
        ) from exc
    return trt


def import_cudart():
    try:
        from cuda.bindings import runtime as cudart  # cuda-python >= 12.6  # noqa: PLC0415
    except ImportError:
        try:
            from cuda import cudart  # older cuda-python  # noqa: PLC0415
        except (ImportError, OSError) as exc:
            raise TensorRTUnavailable(
                "cuda-python is not installed: install specexport-runtime[tensorrt] (pip install cuda-python)"
            ) from exc
    return cudart


def cuda_check(result, what: str, error: type[SpecExportError] = CudaError):
    """cuda-python returns (err, *values); raise `error` on a failure, return the values."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise error(f"{what} failed: CUDA error {int(err)} ({err})")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def gpu_info(device_id: int = 0) -> GpuInfo:
    cudart = import_cudart()
    count = cuda_check(cudart.cudaGetDeviceCount(), "cudaGetDeviceCount (is there a CUDA GPU?)", TensorRTUnavailable)
    if device_id >= int(count):
        raise TensorRTUnavailable(f"CUDA device {device_id} does not exist ({count} visible)")
    prop = cuda_check(cudart.cudaGetDeviceProperties(device_id), "cudaGetDeviceProperties")
    name = prop.name.decode() if isinstance(prop.name, bytes) else str(prop.name)
    return GpuInfo(
        name=name.strip("\x00 ").strip(),
        compute_capability=f"{prop.major}.{prop.minor}",
        total_memory=int(prop.totalGlobalMem),
    )


def trt_version_of(trt) -> str:
    return str(trt.__version__)


# --------------------------------------------------------------------------- build (TensorRT)


def _progress_monitor(trt, echo):
    """A TensorRT IProgressMonitor printing top-level phases (TensorRT >= 10)."""
    if not hasattr(trt, "IProgressMonitor"):
        return None

    class Monitor(trt.IProgressMonitor):
        def __init__(self):
            trt.IProgressMonitor.__init__(self)
            self.started: dict[str, float] = {}

        def phase_start(self, phase_name, parent_phase, num_steps):
            if parent_phase is None:
                self.started[phase_name] = time.perf_counter()
                echo(f"  {phase_name} ({num_steps} steps)")

        def step_complete(self, phase_name, step):
            return True  # False would cancel the build

        def phase_finish(self, phase_name):
            if phase_name in self.started:
                echo(f"  {phase_name} done in {time.perf_counter() - self.started.pop(phase_name):.1f} s")

    return Monitor()


def _network_quantized_types(trt, network) -> set[str]:
    """Quantized types produced inside the parsed network (Q/DQ nodes): 'int8', 'fp8'."""
    found: set[str] = set()
    kinds = {"int8": getattr(trt.DataType, "INT8", None), "fp8": getattr(trt.DataType, "FP8", None)}
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        for j in range(layer.num_outputs):
            dtype = layer.get_output(j).dtype
            found.update(name for name, kind in kinds.items() if kind is not None and dtype == kind)
    return found


def build_engine(
    graph: Path,
    out: Path,
    spec: contract.GraphSpec,
    profiles: Sequence[Profile],
    graph_precision: str,
    options: BuildOptions,
    timing_cache: Path,
    echo=print,
) -> tuple[float, list[str]]:
    """Parse `graph`, build one engine with `profiles`, write it to `out`.

    Returns (seconds, builder precision flags used)."""
    trt = import_tensorrt()
    start = time.perf_counter()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    major = int(trt.__version__.split(".")[0])
    creation = 0 if major >= 10 else 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
    if options.strongly_typed:
        creation |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(creation)
    parser = trt.OnnxParser(network, logger)
    echo(f"parsing {graph}")
    if not parser.parse_from_file(str(graph)):  # reads the external data file beside it
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise EngineBuildError(f"TensorRT could not parse {graph}: " + " | ".join(errors[:5]))
    flags = precision_flags(graph_precision, options, _network_quantized_types(trt, network))
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, options.workspace_mib << 20)
    names = {"fp16": "FP16", "bf16": "BF16", "int8": "INT8", "fp8": "FP8"}
    for flag in flags:
        if not hasattr(trt.BuilderFlag, names[flag]):
            raise EngineBuildError(f"TensorRT {trt.__version__} has no BuilderFlag.{names[flag]}")
        config.set_flag(getattr(trt.BuilderFlag, names[flag]))
    for profile in profiles:
        opt_profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in profile_shapes(spec, profile).items():
            opt_profile.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(opt_profile)
    cache_bytes = timing_cache.read_bytes() if timing_cache.is_file() else b""
    cache = config.create_timing_cache(cache_bytes)
    config.set_timing_cache(cache, ignore_mismatch=False)
    monitor = _progress_monitor(trt, echo)
    if monitor is not None and not options.quiet:
        config.progress_monitor = monitor
    echo(f"building {out.name} (profiles: {', '.join(p.name for p in profiles)}; flags: {', '.join(flags) or 'none'})")
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise EngineBuildError(f"TensorRT could not build an engine from {graph} (see the TensorRT log above)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    with open(tmp, "wb") as handle:
        handle.write(serialized)
    tmp.replace(out)
    timing_cache.write_bytes(bytes(config.get_timing_cache().serialize()))
    return time.perf_counter() - start, flags


def build_artifact_engines(
    artifact: str | Path, options: BuildOptions = BuildOptions(), echo=print
) -> list[EngineRecord]:
    """Build the engines of every graph of `artifact` for the GPU of this machine; record them."""
    from .manifest import read_manifest, verify_files  # noqa: PLC0415

    root = Path(artifact)
    manifest = read_manifest(root)
    verify_files(root, manifest)
    trt = import_tensorrt()
    gpu = gpu_info()
    version = trt_version_of(trt)
    folder = Path(ENGINES_DIR) / engine_dir_name(gpu.name, version)
    (root / folder).mkdir(parents=True, exist_ok=True)
    timing_cache = root / folder / "timing.cache"
    max_gamma = resolve_max_gamma(manifest, options)
    min_rows = max(e.min_rows for e in (manifest.target, manifest.draft) if e is not None)
    profiles = default_profiles(
        manifest.max_context, options.max_prompt, max_gamma, manifest.speculation.gamma, min_rows
    )
    echo(f"GPU {gpu.name} (compute capability {gpu.compute_capability}), TensorRT {version}")
    records = []
    for model, entry in (("target", manifest.target), ("draft", manifest.draft)):
        if entry is None or model not in options.models:
            continue
        refuse_fused(model, entry.kv_layout)
        refuse_quantized(model, entry.precision)
        graph = root / entry.graph
        out = root / folder / f"{model}.engine"
        seconds, flags = build_engine(
            graph, out, entry.graph_spec(), profiles, entry.precision, options, timing_cache, echo
        )
        echo(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB) in {seconds:.0f} s")
        records.append(
            EngineRecord(
                model=model,
                graph=entry.graph,
                graph_sha256=manifest.files.get(entry.graph, ""),
                engine=(folder / f"{model}.engine").as_posix(),
                gpu_name=gpu.name,
                compute_capability=gpu.compute_capability,
                tensorrt_version=version,
                precision_flags=tuple(flags),
                max_context=manifest.max_context,
                max_prompt=min(options.max_prompt, manifest.max_context),
                max_gamma=max_gamma,
                profiles=tuple(profiles),
                built_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                build_seconds=round(seconds, 1),
                engine_bytes=out.stat().st_size,
            )
        )
    path = write_records(root, records)
    echo(f"recorded {len(records)} engine(s) in {path}")
    return records


# --------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m specexport_runtime.trt_build",
        description="Build TensorRT engines for a specexport artifact on this machine's GPU. Engines go to"
        " ARTIFACT/engines/<gpu>-<tensorrt-version>/ and are recorded in ARTIFACT/engines.json.",
    )
    parser.add_argument("artifact", help="artifact folder written by `specexport build`")
    parser.add_argument(
        "--fp16", action="store_true", help="allow fp16 kernels for fp32 graphs (fp16 graphs always use them)"
    )
    parser.add_argument("--bf16", action="store_true", help="allow bf16 kernels (TensorRT >= 9, Ampere or newer)")
    parser.add_argument(
        "--strongly-typed", action="store_true", help="follow the graph's types exactly (no precision flags)"
    )
    parser.add_argument(
        "--max-prompt",
        type=int,
        default=DEFAULT_MAX_PROMPT,
        help=f"largest prefill chunk in tokens (default {DEFAULT_MAX_PROMPT}); longer prompts are fed in chunks",
    )
    parser.add_argument(
        "--max-gamma",
        type=int,
        default=None,
        help="largest draft length the verify profile accepts (default: max(8, the artifact's gamma))",
    )
    parser.add_argument(
        "--workspace-mib",
        type=int,
        default=DEFAULT_WORKSPACE_MIB,
        help=f"builder workspace limit in MiB (default {DEFAULT_WORKSPACE_MIB})",
    )
    parser.add_argument("--only", choices=["target", "draft"], default=None, help="build one graph only")
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    options = BuildOptions(
        fp16=args.fp16,
        bf16=args.bf16,
        strongly_typed=args.strongly_typed,
        max_prompt=args.max_prompt,
        max_gamma=args.max_gamma,
        workspace_mib=args.workspace_mib,
        models=(args.only,) if args.only else ("target", "draft"),
        quiet=args.quiet,
    )
    echo = (lambda _msg: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    try:
        build_artifact_engines(args.artifact, options, echo)
    except SpecExportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
