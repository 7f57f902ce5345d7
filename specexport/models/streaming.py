"""Weights one tensor at a time: where the graph writer and the validation reference read them.

    model = open_streamed(folder, config)     # a transformers skeleton: parameters on `meta`
    source_of(model).get("model.layers.0.mlp.up_proj.weight")   # one tensor, in its stored dtype

The skeleton holds the config, the shapes and the rotary buffers, never a weight: the graph
writer (graphs/decoder.py, both forms) reads each weight from the source by its Hugging Face name as it writes it,
and validation (validate.py) runs the skeleton as its float32 reference with every module's own
parameters loaded just before its forward and dropped right after it (`lazy_forward`), so the
build holds at most one module's weights in float32 (the embedding, for most models) rather
than the whole model several times over.

Other sources: a GGUF file (gguf_source.GGUFSource), a GPTQ / AWQ folder (quantized_source.py),
and a loaded transformers model (`ModuleSource`: a folder whose tensor names are not the
model's, a hub GGUF).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from ..errors import BuildError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class TensorSource(Protocol):
    """Named weights, read one at a time in their stored dtype."""

    def get(self, name: str) -> torch.Tensor:
        """The tensor `name` (a Hugging Face parameter name; a tied head resolves to its table)."""

    def has(self, name: str) -> bool: ...

    def canonical(self, name: str) -> str:
        """The name the tensor is stored under (a tied output head: the embedding's name)."""


class ModuleSource:
    """The parameters and buffers of a loaded torch model (the first name of a tied parameter is
    canonical); a buffer such as Gemma 4's layer_scalar is read like a weight."""

    def __init__(self, model: torch.nn.Module):
        self._params = dict(model.named_buffers()) | dict(model.named_parameters(remove_duplicate=False))
        first: dict[int, str] = {}
        for name, p in self._params.items():
            first.setdefault(id(p), name)
        self._canonical = {name: first[id(p)] for name, p in self._params.items()}

    def get(self, name: str) -> torch.Tensor:
        try:
            return self._params[name].detach()
        except KeyError:
            raise BuildError(f"the model has no parameter {name!r}") from None

    def has(self, name: str) -> bool:
        return name in self._params

    def canonical(self, name: str) -> str:
        return self._canonical.get(name, name)


class SafetensorsSource:
    """A Hugging Face folder's safetensors file(s): `get` maps the file, copies one tensor out and
    unmaps it again (a file kept mapped would leave every tensor read so far resident).

    aliases: name -> stored name, for names the files lack (a tied output head: the embedding)."""

    def __init__(self, folder: Path, aliases: dict[str, str] | None = None):
        self.folder = Path(folder)
        index = self.folder / INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.folder / SINGLE).is_file():
            from safetensors import safe_open

            with safe_open(str(self.folder / SINGLE), framework="pt") as f:
                weight_map = dict.fromkeys(f.keys(), SINGLE)
        else:
            raise BuildError(f"folder {str(folder)!r} holds neither {SINGLE} nor {INDEX}")
        self._file_of: dict[str, str] = dict(weight_map)
        self._aliases = dict(aliases or {})

    def canonical(self, name: str) -> str:
        return name if name in self._file_of else self._aliases.get(name, name)

    def has(self, name: str) -> bool:
        return self.canonical(name) in self._file_of

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        stored = self.canonical(name)
        file = self._file_of.get(stored)
        if file is None:
            raise BuildError(f"{self.folder.name}: no tensor {name!r} in the checkpoint")
        with safe_open(str(self.folder / file), framework="pt") as handle:
            return handle.get_tensor(stored)  # a copy: it outlives the mapping


def streamable(folder: Path) -> bool:
    """Whether a Hugging Face folder's weights can be read tensor by tensor (safetensors)."""
    return (Path(folder) / INDEX).is_file() or (Path(folder) / SINGLE).is_file()


def skeleton(config) -> torch.nn.Module:
    """The transformers model of `config` with its parameters on the meta device (no memory) and
    its buffers (rotary tables, embedding scales) real, in eval mode."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.tie_weights()  # as from_pretrained does (tie_word_embeddings)
    return model.eval()


FORWARD_READS_EMBEDDING = frozenset({"gemma4"})  # model types whose forward reads the embedding weight directly
DTYPE_ATTR = "weight_dtype"  # the dtype a streamed skeleton's forwards load their weights in


def _units(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The modules whose forwards load weights: each element of an outermost ModuleList (a decoder
    layer, with every parameter below it: some layers use a child's weight without calling the
    child, as LFM2's conv reads conv.weight), and each other module owning parameters."""
    units, inside = [], []
    for prefix, module in model.named_modules():
        if any(prefix.startswith(p + ".") for p in inside):
            continue
        if isinstance(module, torch.nn.ModuleList):
            inside.append(prefix)
            units += [(f"{prefix}.{n}", m) for n, m in module.named_children()]
        elif any(p is not None for p in module._parameters.values()):
            units.append((prefix, module))
    return units


def lazy_forward(model: torch.nn.Module, source: TensorSource) -> None:
    """Hook each weight-loading unit of `model` (_units): its forward loads the parameters of the
    unit (a layer: all of them below it) from `source` (in the model's `weight_dtype`, float32
    unless weights_dtype says otherwise) just before and puts them back on the meta device just
    after, so a forward holds one layer's weights at a time."""
    setattr(model, DTYPE_ATTR, torch.float32)
    # Gemma 4's multimodal forward reads embed_tokens.weight itself, after the embedding's own forward
    embed = model.get_input_embeddings() if model.config.model_type in FORWARD_READS_EMBEDDING else None
    keep: list[bool] = [False]  # within a whole-model forward: the input embedding stays loaded
    for prefix, unit in _units(model):
        own = [(owner, attr, f"{prefix}.{n}" if prefix else n) for n, owner, attr in _parameters(unit)]
        if not own:
            continue
        if unit is embed:
            _keep_loaded(model, unit, own, source, keep)

        def load(_mod, _args, own=own):
            dtype = getattr(model, DTYPE_ATTR)
            for owner, attr, full in own:
                owner._parameters[attr] = torch.nn.Parameter(source.get(full).to(dtype), requires_grad=False)

        def drop(_mod, _args, _out, own=own, pinned=unit is embed):
            if pinned and keep[0]:
                return
            for owner, attr, _ in own:
                owner._parameters[attr] = torch.nn.Parameter(
                    torch.empty_like(owner._parameters[attr], device="meta"), requires_grad=False
                )

        unit.register_forward_pre_hook(load)
        unit.register_forward_hook(drop)


def _keep_loaded(model: torch.nn.Module, unit: torch.nn.Module, own: list, source: TensorSource, keep: list) -> None:
    """Keep the input embedding's weight loaded through a whole forward of `model`."""

    def start(_mod, _args):
        keep[0] = True
        dtype = getattr(model, DTYPE_ATTR)
        for owner, attr, full in own:
            owner._parameters[attr] = torch.nn.Parameter(source.get(full).to(dtype), requires_grad=False)

    def end(_mod, _args, _out):
        keep[0] = False
        for owner, attr, _ in own:
            owner._parameters[attr] = torch.nn.Parameter(
                torch.empty_like(owner._parameters[attr], device="meta"), requires_grad=False
            )

    model.register_forward_pre_hook(start)
    model.register_forward_hook(end)


def _parameters(unit: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str]]:
    """(name relative to unit, owning module, attribute) of every parameter below `unit`, a tied
    one under each name that holds it."""
    out = []
    for prefix, module in unit.named_modules(remove_duplicate=False):
        for attr, p in module._parameters.items():
            if p is not None:  # a bias may be None
                out.append((f"{prefix}.{attr}" if prefix else attr, module, attr))
    return out


@contextmanager
def weights_dtype(model: torch.nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """Run `model`'s forwards in `dtype` within the block: a streamed skeleton loads its weights in
    it; a loaded float32 model is converted in place and back (float32 -> float64 -> float32 is
    exact)."""
    if hasattr(model, DTYPE_ATTR):
        setattr(model, DTYPE_ATTR, dtype)
        try:
            yield
        finally:
            setattr(model, DTYPE_ATTR, torch.float32)
        return
    before = next(model.parameters()).dtype
    torch.nn.Module.to(model, dtype)  # not transformers' override, which refuses quantized-origin models
    try:
        yield
    finally:
        torch.nn.Module.to(model, before)


SOURCE_ATTR = "weight_source"  # where a streamed skeleton carries its TensorSource


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """{head weight name: embedding weight name} when the skeleton ties its output head to its
    input embedding (tie_word_embeddings), else {}: a head the checkpoint lacks reads the
    embedding (one it holds is used, untied, as transformers 5 unties a checkpoint holding both
    with different values)."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or head.weight is not embed.weight:
        return {}
    names = {id(m): n for n, m in model.named_modules()}
    return {f"{names[id(head)]}.weight": f"{names[id(embed)]}.weight"}


def attach(model: torch.nn.Module, source: TensorSource) -> torch.nn.Module:
    """Make a skeleton a streamed model of `source`: forwards load their module's weights from it
    (lazy_forward) and the graph writer reads them from it (source_of)."""
    lazy_forward(model, source)
    setattr(model, SOURCE_ATTR, source)
    return model


def open_streamed(folder: Path, config) -> torch.nn.Module:
    """The skeleton of `config` reading its weights from `folder`'s safetensors: a module that runs
    forwards like the loaded model (each module's weights loaded for its own forward only), whose
    source the graph writer reads (`source_of`). BuildError when the checkpoint's tensor names
    are not the model's parameter names (transformers renames some at load)."""
    model = skeleton(config)
    source = SafetensorsSource(folder, tied_aliases(model))
    missing = [n for n, _ in model.named_parameters(remove_duplicate=False) if not source.has(n)]
    if missing:
        raise BuildError(
            f"{Path(folder).name}: the checkpoint's tensor names are not the model's"
            f" ({len(missing)} missing, e.g. {missing[0]!r}); it cannot be streamed"
        )
    for prefix, module in model.named_modules():  # persistent buffers the checkpoint holds (layer_scalar)
        for attr, buffer in list(module._buffers.items()):
            full = f"{prefix}.{attr}" if prefix else attr
            if buffer is not None and attr not in module._non_persistent_buffers_set and source.has(full):
                module._buffers[attr] = source.get(full).to(buffer.dtype)
    attach(model, source)
    if (Path(folder) / "generation_config.json").is_file():  # eos ids, as from_pretrained reads them
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(folder)
    return model


def is_streamed(model) -> bool:
    """Whether `model` is a skeleton reading a checkpoint (no weight of its own loaded)."""
    return getattr(model, SOURCE_ATTR, None) is not None


def source_of(model: torch.nn.Module) -> TensorSource:
    """Where the writer reads `model`'s weights: a streamed skeleton's source, else its parameters."""
    source = getattr(model, SOURCE_ATTR, None)
    return source if source is not None else ModuleSource(model)


def input_embedding(model: torch.nn.Module) -> torch.Tensor:
    """The input embedding table [V, hidden] in its stored dtype, read from the model's source."""
    embed = model.get_input_embeddings()
    name = next(n for n, m in model.named_modules() if m is embed)
    return source_of(model).get(f"{name}.weight").detach()


@dataclass(frozen=True)
class Part:
    """One weight [N, K] of a Linear site by its Hugging Face name, read from its source only when
    a plan needs its values (a checkpoint plan that keeps the file's blocks never does)."""

    name: str
    shape: tuple[int, int]  # [N, K]
    read: Callable[[], torch.Tensor]  # -> the weight [N, K] in its stored dtype


@dataclass(frozen=True)
class Weights:
    """The model's weights by module: `of(module)` reads that module's weight from the source by
    its Hugging Face name (`paths`: id(module) -> its path in the model, taken when the writer
    starts; a parameter's name is its module's path and attribute)."""

    source: TensorSource
    paths: dict[int, str]

    def _full(self, module: torch.nn.Module, attr: str) -> str:
        return f"{self.paths[id(module)]}.{attr}"

    def name(self, module: torch.nn.Module, attr: str = "weight") -> str:
        """The name the source stores it under (a tied head: the embedding's)."""
        return self.source.canonical(self._full(module, attr))

    def of(self, module: torch.nn.Module, attr: str = "weight") -> torch.Tensor:
        return self.source.get(self._full(module, attr))

    def part(self, module: torch.nn.Module, transposed: bool = False) -> Part:
        """A linear module's weight as one part of a Linear site, read when a plan asks; its shape
        from the module (a skeleton's meta parameter). transposed: a transformers Conv1D, which
        stores [K, N] (GPT-2)."""
        shape = tuple(module.weight.shape)
        if transposed:
            return Part(self.name(module), (shape[1], shape[0]), lambda: self.of(module).t())
        return Part(self.name(module), shape, lambda: self.of(module))

    def bias(self, module: torch.nn.Module) -> torch.Tensor | None:
        return None if getattr(module, "bias", None) is None else self.of(module, "bias")
