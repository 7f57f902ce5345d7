"""Pre-quantized Hugging Face folders (GPTQ, AWQ): their blocks, and a float model to trace.

`load_quantized_folder` reads config.json's `quantization_config`, maps the quantized Linears
onto BlockQuantized weights (gptq.py, awq.py) keeping the checkpoint's codes and scales exactly,
and builds a float32 transformers model (from config.json without `quantization_config`, no
remote code) whose quantized Linear weights are those blocks dequantized and whose other
tensors (embeddings, norms, biases, a non-quantized lm_head) are the checkpoint's, cast to
float32. Tensors are read from *.safetensors only (no pickle).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import awq, gptq
from .blocks import BlockQuantized, FormatError

# quant_method -> (blocks loader, tensor suffixes of a quantized Linear that the loader consumes)
LOADERS: dict[str, tuple[Callable[[dict, dict], dict[str, BlockQuantized]], tuple[str, ...]]] = {
    "gptq": (gptq.gptq_blocks, gptq.SUFFIXES),
    "awq": (awq.awq_blocks, awq.SUFFIXES),
}
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)  # buffers old checkpoints carry; recomputed from config


@dataclass(frozen=True, eq=False)
class QuantizedCheckpoint:
    model: Any  # transformers PreTrainedModel, float32, eval; quantized weights = blocks[...].dequantize()
    blocks: dict[str, BlockQuantized]  # by parameter name, e.g. "model.layers.0.mlp.down_proj.weight"
    method: str  # "gptq" | "awq"
    bits: int
    group_size: int  # as in quantization_config; -1 = one group over all of K


def quantization_method(folder: Path) -> str | None:
    """quantization_config.quant_method of the folder's config.json (lowercase), or None."""
    qconfig = _read_config(Path(folder)).get("quantization_config")
    if not qconfig:
        return None
    method = qconfig.get("quant_method")
    return None if method is None else str(method).lower()


def load_quantized_folder(folder: Path) -> QuantizedCheckpoint:
    """Blocks and float32 model of a GPTQ / AWQ Hugging Face folder (module docstring)."""
    folder = Path(folder)
    config = _read_config(folder)
    qconfig = config.pop("quantization_config", None)
    if not qconfig:
        raise FormatError(f"{folder / 'config.json'} has no quantization_config")
    method = str(qconfig.get("quant_method")).lower()
    if method not in LOADERS:
        raise FormatError(
            f"quant_method {qconfig.get('quant_method')!r} is not supported (expected one of {sorted(LOADERS)})"
        )
    loader, suffixes = LOADERS[method]
    tensors = read_safetensors(folder)
    blocks = loader(tensors, qconfig)
    plain = _plain_tensors(tensors, blocks, suffixes)
    model = _float_model(config)
    _fill(model, blocks, plain)
    bits = int(qconfig.get("bits", qconfig.get("w_bit")))
    group_size = int(qconfig.get("group_size", qconfig.get("q_group_size", 128)))
    return QuantizedCheckpoint(model=model.eval(), blocks=blocks, method=method, bits=bits, group_size=group_size)


def _read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise FormatError(f"{folder} has no config.json")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise FormatError(f"{path} is not valid JSON: {exc}") from exc


def read_safetensors(folder: Path) -> dict:
    """All tensors (torch, CPU) of the folder's safetensors files: those of
    model.safetensors.index.json when there is one, else every *.safetensors."""
    from safetensors.torch import load_file

    tensors: dict = {}
    for path in _safetensors_files(folder):
        for name, value in load_file(path).items():
            if name in tensors:
                raise FormatError(f"tensor {name!r} is in more than one safetensors file of {folder}")
            tensors[name] = value
    return tensors


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise FormatError(f"{index} lists files that are not in the folder: {missing}")
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FormatError(f"{folder} has no *.safetensors files (other weight files are not read)")
    return files


def _plain_tensors(tensors: dict, blocks: dict[str, BlockQuantized], suffixes: tuple[str, ...]) -> dict:
    """The tensors the format loader did not consume (embeddings, norms, biases, ...)."""
    prefixes = [name[: -len(".weight")] for name in blocks]
    consumed = {f"{prefix}.{suffix}" for prefix in prefixes for suffix in suffixes}
    return {
        name: value for name, value in tensors.items() if name not in consumed and not name.endswith(_IGNORED_SUFFIXES)
    }


def _float_model(config: dict):
    """float32 model from a config.json dict (quantization_config removed), no remote code."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type = config.pop("model_type", None)
    try:
        hf_config = AutoConfig.for_model(model_type, **config)
        return AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32, trust_remote_code=False)
    except (KeyError, ValueError) as exc:
        raise FormatError(
            f"config.json model_type {model_type!r} is not a causal LM transformers builds without remote code: {exc}"
        ) from exc


def _fill(model, blocks: dict[str, BlockQuantized], plain: dict) -> None:
    """Set every parameter (and persistent buffer the checkpoint has) of `model` in place."""
    import torch

    values: dict = {**blocks, **plain}
    state = model.state_dict()  # tensors sharing storage with the parameters: copy_ sets them
    buffers = {name for name, _ in model.named_buffers()}
    with torch.no_grad():
        for name in _owned_names(model, state):
            if name not in values:
                if name in buffers:
                    continue  # a persistent buffer the checkpoint may leave at its initial value
                raise FormatError(f"checkpoint has no tensor for parameter {name!r}")
            _copy(state[name], _as_float(values.pop(name)), name)
        model.tie_weights()
        for name in [n for n in values if n in state]:  # tied aliases (lm_head.weight)
            _check_tied(state[name], _as_float(values.pop(name)), name)
    if values:
        raise FormatError(f"checkpoint tensors the model has no place for: {sorted(values)[:8]}")


def _as_float(value):
    """float32 torch tensor of a block weight (dequantized, [N, K]) or a checkpoint tensor."""
    import torch

    if isinstance(value, BlockQuantized):
        return torch.from_numpy(value.dequantize())  # [N, K] float32
    return value.float() if value.is_floating_point() else value


def _owned_names(model, state: dict) -> list[str]:
    """state_dict names that are not aliases of another (tied weights appear once)."""
    names = [name for name, _ in model.named_parameters()]
    names += [name for name, _ in model.named_buffers() if name in state]
    return names


def _copy(target, value, name: str) -> None:
    if tuple(value.shape) != tuple(target.shape):
        raise FormatError(f"tensor {name!r} has shape {list(value.shape)}, the model expects {list(target.shape)}")
    target.copy_(value)


def _check_tied(target, value, name: str) -> None:
    if tuple(value.shape) != tuple(target.shape) or not bool((value == target).all()):
        raise FormatError(
            f"checkpoint has its own {name!r}, but config.json ties it to another weight "
            f"(tie_word_embeddings); set it false or drop the tensor"
        )


__all__ = ["QuantizedCheckpoint", "load_quantized_folder", "quantization_method", "read_safetensors"]
