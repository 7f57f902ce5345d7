"""A GPTQ or AWQ Hugging Face folder as a TensorSource, read one tensor at a time.

    model = open_quantized(folder)                   # a streamed skeleton (streaming.py)
    source_of(model).get("model.layers.0.mlp.up_proj.weight")     # float32 [N, K], dequantized
    source_of(model).blocks.get("model.layers.0.mlp.up_proj.weight")  # the checkpoint's BlockQuantized

A quantized Linear at module path P is stored as P.qweight / P.qzeros / P.scales (/ P.g_idx)
(formats/gptq.py, awq.py); its parameter P.weight is served from those, read with
safetensors.safe_open when asked (the blocks exactly; `get` their float32 dequantization). Every
other parameter is the checkpoint's own tensor. Nothing holds more than the tensor being read.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from ..errors import BuildError
from ..formats import awq, gptq
from ..formats.blocks import BlockQuantized, FormatError
from ..formats.hf_quantized import LOADERS
from .streaming import INDEX, attach, skeleton, tied_aliases

_LAYER = {"gptq": gptq.gptq_layer, "awq": awq.awq_layer}
_IGNORED = (".rotary_emb.inv_freq",)  # buffers old checkpoints carry; recomputed from the config


def _weight_map(folder: Path) -> dict[str, str]:
    """tensor name -> safetensors file name (the index's map, else every *.safetensors' keys)."""
    from safetensors import safe_open

    index = folder / INDEX
    if index.is_file():
        return dict(json.loads(index.read_text(encoding="utf-8"))["weight_map"])
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FormatError(f"{folder} has no *.safetensors files (other weight files are not read)")
    out: dict[str, str] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safe_open handle is not a mapping)
                if name in out:
                    raise FormatError(f"tensor {name!r} is in more than one safetensors file of {folder}")
                out[name] = path.name
    return out


class _Tensors(Mapping):
    """The folder's tensors by name, each read from its file when asked (a copy)."""

    def __init__(self, folder: Path, files: dict[str, str]):
        self.folder, self.files = folder, files

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self.files:
            raise KeyError(name)
        with safe_open(str(self.folder / self.files[name]), framework="pt") as f:
            return f.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.files)

    def __len__(self) -> int:
        return len(self.files)


class QuantizedFolderSource:
    """A GPTQ / AWQ folder's parameters by Hugging Face name (module docstring).

    hf_names: the model's parameter names; tied: head name -> embedding name (read when the
    folder has no head of its own)."""

    def __init__(self, folder: Path, qconfig: dict, hf_names: list[str], tied: dict[str, str] | None = None):
        self.folder = Path(folder)
        self.method = str(qconfig.get("quant_method")).lower()
        if self.method not in _LAYER:
            raise FormatError(
                f"quant_method {qconfig.get('quant_method')!r} is not supported (expected one of {sorted(LOADERS)})"
            )
        if self.method == "awq":
            awq.check_config(qconfig)
        else:
            gptq.check_bits(qconfig.get("bits"), "GPTQ")
        self.qconfig = qconfig
        self._tensors = _Tensors(self.folder, _weight_map(self.folder))
        files = self._tensors.files
        quantized = {n[: -len(".qweight")] for n in files if n.endswith(".qweight")}
        suffixes = LOADERS[self.method][1]
        self._quantized = {f"{p}.weight" for p in quantized}
        self._aliases = {a: b for a, b in (tied or {}).items() if a not in files and a not in self._quantized}
        missing = [n for n in hf_names if n not in self._aliases and n not in self._quantized and n not in files]
        if missing:
            raise BuildError(
                f"{self.folder.name}: checkpoint has no tensor for parameter {missing[0]!r} ({len(missing)} missing)"
            )
        used = {f"{p}.{s}" for p in quantized for s in suffixes} | set(hf_names)
        extra = sorted(n for n in files if n not in used and not n.endswith(_IGNORED))
        if extra:
            raise FormatError(f"checkpoint tensors the model has no place for: {extra[:8]}")
        self.blocks = _Blocks(self)

    def canonical(self, name: str) -> str:
        return self._aliases.get(name, name)

    def has(self, name: str) -> bool:
        name = self.canonical(name)
        return name in self._quantized or name in self._tensors.files

    def get(self, name: str) -> torch.Tensor:
        """A quantized Linear's weight as its float32 dequantization [N, K]; any other tensor as stored."""
        name = self.canonical(name)
        if name in self._quantized:
            return torch.from_numpy(self.exact(name).dequantize())
        try:
            return self._tensors[name]
        except KeyError:
            raise BuildError(f"{self.folder.name}: no tensor {name!r} in the checkpoint") from None

    def exact(self, name: str) -> BlockQuantized:
        """The checkpoint's blocks of the quantized Linear weight `name` (P.weight)."""
        return _LAYER[self.method](self._tensors, name[: -len(".weight")], self.qconfig)

    def quantized(self) -> list[str]:
        return sorted(self._quantized)


class _Blocks(Mapping):
    """The checkpoint's quantized weights by parameter name, read and decoded when asked."""

    def __init__(self, source: QuantizedFolderSource):
        self._source = source

    def __getitem__(self, name: str) -> BlockQuantized:
        name = self._source.canonical(name)
        if name not in self._source._quantized:
            raise KeyError(name)
        return self._source.exact(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._source.quantized())

    def __len__(self) -> int:
        return len(self._source._quantized)


def open_quantized(folder: Path) -> torch.nn.Module:
    """The streamed skeleton of a GPTQ / AWQ folder (config.json without quantization_config)."""
    from transformers import AutoConfig

    folder = Path(folder)
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise FormatError(f"{path} is not a readable config.json: {exc}") from exc
    qconfig = config.pop("quantization_config", None)
    if not qconfig:
        raise FormatError(f"{path} has no quantization_config")
    model_type = config.pop("model_type", None)
    try:
        hf = AutoConfig.for_model(model_type, **config)
    except (KeyError, ValueError) as exc:
        raise FormatError(
            f"config.json model_type {model_type!r} is not a causal LM transformers builds: {exc}"
        ) from exc
    model = skeleton(hf)
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    attach(model, QuantizedFolderSource(folder, qconfig, names, tied_aliases(model)))
    if (folder / "generation_config.json").is_file():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(folder)
    return model
