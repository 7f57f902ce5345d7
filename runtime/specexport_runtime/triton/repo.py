"""`specexport triton-repo`: a Triton Inference Server model repository of one artifact.

    REPO/<model>/config.pbtxt         Python backend, decoupled transaction policy, generate-extension I/O
    REPO/<model>/1/model.py           triton/model.py (runs the speculative loop, streams rounds)
    REPO/<model>/1/artifact/...       the artifact: manifest.json (+ manifest.sig) and its listed files
    REPO/<model>/1/keys/key<i>.pem    the trusted public keys, when given (the backend checks the signature)

The artifact (a folder, or a .spx unpacked first) is verified before it is copied (checksums, and
the signature when keys are given); the backend verifies it again when Triton loads it. The
repository is written into a temporary folder next to REPO and renamed into place: REPO is either
absent or complete.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import InvalidArgument
from ..manifest import MANIFEST_NAME, SIGNATURE_NAME, read_manifest, verify_files
from ..package import SUFFIX, unpack

MODEL_PY = Path(__file__).with_name("model.py")
VERSION = "1"
INPUTS = [  # (name, Triton data type, dims, optional)
    ("text_input", "TYPE_STRING", "[ 1 ]", False),
    ("max_tokens", "TYPE_INT32", "[ 1 ]", True),
    ("stream", "TYPE_BOOL", "[ 1 ]", True),
    ("temperature", "TYPE_FP32", "[ 1 ]", True),
    ("top_k", "TYPE_INT32", "[ 1 ]", True),
    ("top_p", "TYPE_FP32", "[ 1 ]", True),
    ("seed", "TYPE_INT64", "[ 1 ]", True),
    ("proposer", "TYPE_STRING", "[ 1 ]", True),
]
OUTPUTS = [
    ("text_output", "TYPE_STRING", "[ 1 ]"),
    ("token_ids", "TYPE_INT64", "[ -1 ]"),
    ("finish_reason", "TYPE_STRING", "[ 1 ]"),
    ("drafted", "TYPE_INT64", "[ 1 ]"),
    ("accepted", "TYPE_INT64", "[ 1 ]"),
    ("rounds", "TYPE_INT64", "[ 1 ]"),
    ("acceptance_rate", "TYPE_FP32", "[ 1 ]"),
    ("speculative", "TYPE_STRING", "[ 1 ]"),
]


def check_model_name(name: object, source: str = "name", hint: str = "") -> str:
    """`name` when it may name a Triton model: letters, digits, '-' and '_' only, so it is one folder
    of the repository and a plain string in config.pbtxt; InvalidArgument otherwise."""
    if not isinstance(name, str) or not name or not name.replace("-", "").replace("_", "").isalnum():
        raise InvalidArgument(f"{source} must be letters, digits, '-' and '_', got {name!r}{hint}")
    return name


@dataclass(frozen=True)
class RepoSettings:
    name: str | None = None  # the model's name in Triton (None: the artifact's manifest name)
    instances: int = 1  # model instances (each one sequence at a time, each its own copy of the model)
    threads: int | None = None  # ONNX Runtime intra-op threads per instance (None: all cores)
    provider: str = "cpu"  # cpu | cuda | tensorrt (ONNX Runtime's, inside Triton's Python environment)

    def __post_init__(self) -> None:
        if self.name is not None:
            check_model_name(self.name)
        if not isinstance(self.instances, int) or not 1 <= self.instances <= 64:
            raise InvalidArgument(f"instances must be an integer in 1..64, got {self.instances!r}")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise InvalidArgument(f"threads must be an integer >= 1, got {self.threads!r}")
        if self.provider not in ("cpu", "cuda", "tensorrt"):
            raise InvalidArgument(f"provider must be cpu, cuda or tensorrt, got {self.provider!r}")


@dataclass(frozen=True)
class RepoReport:
    repository: Path
    model: str
    files: int  # files written
    signed: bool  # the backend checks a signature at load


def config_pbtxt(name: str, settings: RepoSettings, keys: Sequence[str]) -> str:
    """The model's config.pbtxt (Triton's ModelConfig in protobuf text format)."""
    lines = [
        f'name: "{name}"',
        'backend: "python"',
        "max_batch_size: 0",
        "model_transaction_policy { decoupled: true }",
    ]
    lines.append("input [")
    lines.append(
        ",\n".join(
            f'  {{ name: "{n}" data_type: {t} dims: {d}' + (" optional: true" if opt else "") + " }"
            for n, t, d, opt in INPUTS
        )
    )
    lines.append("]")
    lines.append("output [")
    lines.append(",\n".join(f'  {{ name: "{n}" data_type: {t} dims: {d} }}' for n, t, d in OUTPUTS))
    lines.append("]")
    kind = "KIND_CPU" if settings.provider == "cpu" else "KIND_GPU"
    lines.append(f"instance_group [ {{ count: {settings.instances} kind: {kind} }} ]")
    params = {"artifact": "artifact", "provider": settings.provider, "trusted_keys": ",".join(keys)}
    if settings.threads is not None:
        params["threads"] = str(settings.threads)
    for key, value in params.items():
        lines.append(f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}')
    return "\n".join(lines) + "\n"


def write_repository(
    artifact: str | Path,
    out: str | Path,
    settings: RepoSettings | None = None,
    trusted_keys: Sequence[str | Path] | None = None,
) -> RepoReport:
    """Write the model repository of `artifact` at `out` (which must not exist yet)."""
    settings = settings if settings is not None else RepoSettings()
    artifact, out = Path(artifact), Path(out)
    if out.exists() or out.is_symlink():
        raise InvalidArgument(f"{str(out)!r} exists; triton-repo writes a new repository (choose a new path)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        source = artifact
        if artifact.suffix == SUFFIX and artifact.is_file():  # checked (signature too) while unpacking
            source = unpack(artifact, tmp / "unpacked", trusted_keys=trusted_keys, keep=0).resolve()
        elif trusted_keys:
            from ..signing import verify as verify_signature

            verify_signature(source, trusted_keys)
        manifest = read_manifest(source)
        verify_files(source, manifest)
        # the name becomes a folder and a config.pbtxt string: checked whichever source it comes from
        name = settings.name or check_model_name(
            manifest.name, "the artifact's manifest name", " (pass --name to name the Triton model)"
        )
        model = tmp / "repo" / name
        version = model / VERSION
        names = (
            [MANIFEST_NAME] + ([SIGNATURE_NAME] if (source / SIGNATURE_NAME).is_file() else []) + sorted(manifest.files)
        )
        for member in names:
            dest = version / "artifact" / member
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source / member, dest)
        keys = []
        for i, key in enumerate(trusted_keys or ()):
            keys.append(f"keys/key{i}.pem")
            (version / "keys").mkdir(exist_ok=True)
            shutil.copyfile(key, version / keys[-1])
        shutil.copyfile(MODEL_PY, version / "model.py")
        (model / "config.pbtxt").write_text(config_pbtxt(name, settings, keys), encoding="utf-8")
        files = sum(1 for p in (tmp / "repo").rglob("*") if p.is_file())
        os.rename(tmp / "repo", out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return RepoReport(out, name, files, bool(keys))
