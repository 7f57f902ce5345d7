"""TensorRT engine profiles and engine records: the pure part of the native backend.

Nothing here imports tensorrt or cuda-python; trt_build.py builds engines with these profiles
and records, and trt_backend.py checks a record and picks a profile per call.

Optimization profiles. One engine per graph (target, draft), each with three optimization
profiles over the dynamic dimensions of the graph contract (docs/graph-contract.md; batch is
fixed at 1):

    profile   seq S                 past P             rows R
    decode    1                     0 .. max_context-1  1
    verify    2 .. max_gamma+1      0 .. max_context-1  1 .. max_gamma+1
    prefill   1 .. max_prompt       0 .. max_context-1  1 (1 .. min_rows for a padded graph, feature row_padding)

TensorRT sizes an engine's scratch memory for the largest shapes of a profile, and the attention
scores of one call hold H x S x (P + S) values, so the prefill profile is capped at `max_prompt`
tokens (default 512): the native backend (trt_backend.py) feeds longer prompts in chunks.

Engine records. Engines live in ARTIFACT/engines/<gpu-name>-<tensorrt-version>/{target,draft}.engine
and are recorded in ARTIFACT/engines.json (ENGINES_SCHEMA_VERSION). A record names the GPU, its
compute capability and the TensorRT version; an engine only runs on that GPU model with that
TensorRT version, and the runtime refuses any other with the command that rebuilds it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from . import contract
from .constants import DEFAULT_MAX_GAMMA
from .errors import ArtifactError, InvalidArgument

ENGINES_NAME = "engines.json"
ENGINES_DIR = "engines"
ENGINES_SCHEMA_VERSION = 1
DEFAULT_MAX_PROMPT = 512
DIMS = ("seq", "past", "rows")  # the symbolic dimension names of the contract graphs (graphs/ops_portable.py)
STATE_ROWS = "state_rows"  # state_index's (feature recurrent_state): 1 .. seq rows, shaped from seq


class EngineMismatch(ArtifactError):
    """No engine in engines.json fits this GPU / TensorRT version / graph; rebuild it."""


# --------------------------------------------------------------------------- profiles


@dataclass(frozen=True)
class Profile:
    """One optimization profile: (min, opt, max) per symbolic dimension."""

    name: str
    seq: tuple[int, int, int]
    past: tuple[int, int, int]
    rows: tuple[int, int, int]

    def __post_init__(self) -> None:
        for dim in DIMS:
            lo, opt, hi = getattr(self, dim)
            if not 0 <= lo <= opt <= hi:
                raise InvalidArgument(f"profile {self.name!r}: {dim} needs 0 <= min <= opt <= max, got {(lo, opt, hi)}")
        if self.seq[0] < 1 or self.rows[0] < 1:
            raise InvalidArgument(
                f"profile {self.name!r}: seq and rows start at 1, got seq {self.seq} rows {self.rows}"
            )

    def dims(self) -> dict[str, tuple[int, int, int]]:
        return {dim: getattr(self, dim) for dim in DIMS}

    def covers(self, seq: int, rows: int, past: int | None = None) -> bool:
        ok = self.seq[0] <= seq <= self.seq[2] and self.rows[0] <= rows <= self.rows[2]
        return ok and (past is None or self.past[0] <= past <= self.past[2])

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, **{dim: list(getattr(self, dim)) for dim in DIMS}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        return cls(name=data["name"], **{dim: tuple(int(v) for v in data[dim]) for dim in DIMS})


# max_gamma defaults to constants.DEFAULT_MAX_GAMMA: the profiles cover at least the runtime's default
# longest draft
def default_profiles(
    max_context: int,
    max_prompt: int = DEFAULT_MAX_PROMPT,
    max_gamma: int = DEFAULT_MAX_GAMMA,
    gamma: int = 4,
    min_rows: int = 1,
) -> list[Profile]:
    """decode, verify, prefill (in the order the backend tries them; see the module docstring).
    min_rows: a padded graph's (feature row_padding), whose prefill asks for min_rows logits rows."""
    if max_context < 2:
        raise InvalidArgument(f"max_context must be >= 2, got {max_context}")
    if not 1 <= max_gamma < max_context:
        raise InvalidArgument(f"max_gamma must be in 1..{max_context - 1}, got {max_gamma}")
    max_prompt = min(max_prompt, max_context)
    if max_prompt < 1:
        raise InvalidArgument(f"max_prompt must be >= 1, got {max_prompt}")
    p_max = max_context - 1
    p_opt = max_context // 2
    gamma = min(max(gamma, 1), max_gamma)
    profiles = [
        Profile("decode", seq=(1, 1, 1), past=(0, p_opt, p_max), rows=(1, 1, 1)),
        Profile(
            "verify", seq=(2, gamma + 1, max_gamma + 1), past=(0, p_opt, p_max), rows=(1, gamma + 1, max_gamma + 1)
        ),
        Profile(
            "prefill",
            seq=(1, min(128, max_prompt), max_prompt),
            past=(0, 0, p_max),
            rows=(1, max(1, min_rows), max(1, min_rows)),
        ),
    ]
    return profiles


def select_profile(profiles: Sequence[Profile], seq: int, rows: int, past: int | None = None) -> int:
    """Index of the first profile covering S tokens with R logits rows at past length P.

    Raises InvalidArgument naming the engine's limits when none does."""
    for index, profile in enumerate(profiles):
        if profile.covers(seq, rows, past):
            return index
    limits = ", ".join(f"{p.name}: S {p.seq[0]}..{p.seq[2]}, R {p.rows[0]}..{p.rows[2]}" for p in profiles)
    raise InvalidArgument(
        f"no optimization profile of this engine covers S={seq}, R={rows}"
        + (f", P={past}" if past is not None else "")
        + f" ({limits}); rebuild the engines with a larger --max-gamma / --max-prompt"
    )


def input_shapes(spec: contract.GraphSpec, seq: int, rows: int, past: int) -> dict[str, tuple[int, ...]]:
    """The TensorRT input shapes of one call (set_input_shape); an EAGLE-3 head's row inputs too."""
    shapes: dict[str, tuple[int, ...]] = {contract.INPUT_IDS: (1, seq), contract.LOGITS_INDEX: (rows,)}
    if spec.is_head:
        shapes[contract.HEAD_FEATURES] = (1, seq, spec.feature_width)
        shapes[contract.HEAD_HIDDEN] = (1, seq, spec.hidden_width)
    for i in range(spec.num_layers):
        shapes[contract.past_key(i)] = spec.layout.cache_shape(past, spec.num_kv_heads, spec.head_dim)
        shapes[contract.past_value(i)] = spec.layout.cache_shape(past, spec.num_kv_heads, spec.head_dim)
    if spec.states:  # a state for each of up to S rows; the states themselves are fixed-size
        shapes[contract.STATE_INDEX] = (seq,)
        for j, shape in enumerate(spec.states):
            shapes[contract.past_state(j)] = (1, *shape)
    return shapes


def profile_shapes(spec: contract.GraphSpec, profile: Profile) -> dict[str, tuple[tuple[int, ...], ...]]:
    """(min, opt, max) shapes of every input for IOptimizationProfile.set_shape."""
    out: dict[str, tuple[tuple[int, ...], ...]] = {}
    for k in range(3):
        shapes = input_shapes(spec, profile.seq[k], profile.rows[k], profile.past[k])
        for name, shape in shapes.items():
            out.setdefault(name, ())
            out[name] = out[name] + (shape,)
    return out


# --------------------------------------------------------------------------- engine records


def slug(text: str) -> str:
    """A folder-safe form of a GPU name: 'NVIDIA GeForce RTX 4090' -> 'nvidia-geforce-rtx-4090'."""
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-") or "gpu"


def engine_dir_name(gpu_name: str, trt_version: str) -> str:
    return f"{slug(gpu_name)}-{trt_version}"


@dataclass(frozen=True)
class GpuInfo:
    name: str
    compute_capability: str  # "8.7"
    total_memory: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class EngineRecord:
    """One built engine, as written to engines.json."""

    model: str  # target | draft
    graph: str  # relative path of the ONNX graph
    graph_sha256: str
    engine: str  # relative path of the .engine file
    gpu_name: str
    compute_capability: str
    tensorrt_version: str
    precision_flags: tuple[str, ...]
    max_context: int
    max_prompt: int
    max_gamma: int
    profiles: tuple[Profile, ...]
    built_at: str = ""
    build_seconds: float = 0.0
    engine_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["precision_flags"] = list(self.precision_flags)
        data["profiles"] = [p.to_dict() for p in self.profiles]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineRecord:
        try:
            return cls(
                **{
                    **{k: v for k, v in data.items() if k in cls.__dataclass_fields__},
                    "precision_flags": tuple(data.get("precision_flags", ())),
                    "profiles": tuple(Profile.from_dict(p) for p in data["profiles"]),
                }
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ArtifactError(f"{ENGINES_NAME} holds a malformed engine record: {exc!r}") from exc


def rebuild_command(artifact: str | Path, record: EngineRecord | None = None) -> str:
    args = [f"python -m specexport_runtime.trt_build {artifact}"]
    if record is not None:
        if "fp16" in record.precision_flags:
            args.append("--fp16")
        if "bf16" in record.precision_flags:
            args.append("--bf16")
        if record.max_prompt != DEFAULT_MAX_PROMPT:
            args.append(f"--max-prompt {record.max_prompt}")
        if record.max_gamma != DEFAULT_MAX_GAMMA:
            args.append(f"--max-gamma {record.max_gamma}")
    return " ".join(args)


def read_records(root: str | Path) -> list[EngineRecord]:
    path = Path(root) / ENGINES_NAME
    if not path.is_file():
        return []
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArtifactError(f"{str(path)!r} is not valid JSON: {exc}") from exc
    if data.get("schema_version") != ENGINES_SCHEMA_VERSION:
        raise ArtifactError(
            f"{str(path)!r} has schema_version {data.get('schema_version')!r};"
            f" this runtime reads {ENGINES_SCHEMA_VERSION}"
            f" (rebuild: {rebuild_command(root)})"
        )
    return [EngineRecord.from_dict(item) for item in data.get("engines", [])]


def write_records(root: str | Path, records: Iterable[EngineRecord]) -> Path:
    """Write engines.json, replacing records of the same (model, GPU, TensorRT version)."""
    path = Path(root) / ENGINES_NAME
    merged: dict[tuple[str, str, str], EngineRecord] = {}
    for record in [*read_records(root), *records]:
        merged[(record.model, record.gpu_name, record.tensorrt_version)] = record
    data = {"schema_version": ENGINES_SCHEMA_VERSION, "engines": [r.to_dict() for r in merged.values()]}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def check_record(
    record: EngineRecord, gpu: GpuInfo, trt_version: str, artifact: str | Path, graph_sha256: str | None = None
) -> None:
    """Raise EngineMismatch (with the rebuild command) unless `record` runs here.

    TensorRT engines are specific to the TensorRT version that built them and to the GPU model
    (its compute capability and, for tuned kernels, the exact device)."""
    problems = []
    if record.tensorrt_version != trt_version:
        problems.append(f"built with TensorRT {record.tensorrt_version}, this machine has TensorRT {trt_version}")
    if record.compute_capability != gpu.compute_capability:
        problems.append(
            f"built for compute capability {record.compute_capability}, this GPU has {gpu.compute_capability}"
        )
    if record.gpu_name != gpu.name:
        problems.append(f"built on GPU {record.gpu_name!r}, this GPU is {gpu.name!r}")
    if graph_sha256 is not None and record.graph_sha256 != graph_sha256:
        problems.append(
            f"built from a different {record.graph} (sha256 {record.graph_sha256[:12]}..., now {graph_sha256[:12]}...)"
        )
    if problems:
        raise EngineMismatch(
            f"the {record.model} engine {record.engine!r} does not fit this machine: {'; '.join(problems)}."
            f" Rebuild it here: {rebuild_command(artifact, record)}"
        )


def find_record(
    records: Sequence[EngineRecord],
    model: str,
    gpu: GpuInfo,
    trt_version: str,
    artifact: str | Path,
    graph_sha256: str | None = None,
) -> EngineRecord:
    """The record of `model` built for this GPU and TensorRT version (checked), else EngineMismatch."""
    mine = [r for r in records if r.model == model]
    if not mine:
        raise EngineMismatch(
            f"no TensorRT engine for the {model} graph in {str(Path(artifact) / ENGINES_NAME)!r}."
            f" Build it here: {rebuild_command(artifact)}"
        )
    exact = [r for r in mine if r.gpu_name == gpu.name and r.tensorrt_version == trt_version]
    candidate = exact[0] if exact else mine[0]
    if not exact and len(mine) > 1:
        built = "; ".join(f"{r.gpu_name} / TensorRT {r.tensorrt_version}" for r in mine)
        raise EngineMismatch(
            f"no {model} engine for GPU {gpu.name!r} (compute capability {gpu.compute_capability}) with TensorRT"
            f" {trt_version}; engines exist for: {built}. Rebuild it here: {rebuild_command(artifact, candidate)}"
        )
    check_record(candidate, gpu, trt_version, artifact, graph_sha256)
    return candidate
