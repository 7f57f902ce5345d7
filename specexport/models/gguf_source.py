"""A GGUF file as a TensorSource: tensors by Hugging Face name, read one at a time.

    header = read_header(path)                      # formats/gguf_config.py: refusals, config
    model = open_gguf(header)                       # a streamed skeleton (streaming.py)
    source = source_of(model)                       # GGUFSource
    source.get("model.layers.0.self_attn.q_proj.weight")      # float32 [N, K], dequantized
    source.blocks.get("model.layers.0.self_attn.q_proj.weight")  # BlockQuantized or None

Each read copies that tensor's bytes out of the file (os.preadv: no mapping stays resident;
with SPECEXPORT_STREAM_CACHE_MB set, the first CACHE_BYTES of float32 results are kept) and
puts them in Hugging Face layout: numpy order (GGUF's ne reversed: [N, K] for a weight),
attn_q / attn_k rows (and biases) un-permuted for the families llama.cpp permuted, Qwen3.5's
value heads put back in groups (GGUFArch.head_orders), the norm shift taken off Gemma's and
Qwen3.5's norms (the file holds 1 + w), a tied head read from the embedding. Trailing MTP
blocks (GGUFHeader.mtp_layers) are left unread.

Names map through gguf-py's own TensorNameMap (the table llama.cpp's converter writes with),
for the skeleton's parameter names: every parameter must find its tensor (else BuildError) and
every tensor its parameter (else FormatError), each naming the first one, before any tensor
is read.

`blocks` is a lazy mapping for quantized targets (quantized_target.QuantizedWeights): the
file's exact blocks for the types with a MatMulNBits form (formats/gguf.py LAYOUTS), None for
float tensors and for the types without one (those are dequantized to float32 by `get`; the
mapping counts both kinds by GGML type: `summary()`).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, MODEL_ARCH_NAMES, GGMLQuantizationType, get_tensor_name_map
from gguf.gguf_reader import ReaderTensor
from gguf.quants import dequantize

from ..errors import BuildError
from ..formats.blocks import BlockQuantized, FormatError, compatible, concat_rows
from ..formats.gguf import (
    LAYOUTS,
    decode_blocks,
    is_block_type,
    permute_columns,
    permute_rows,
    rotary_unpermutation,
    supported_types,
)
from ..formats.gguf_config import GGUFHeader, hf_config

# float32 bytes a source keeps after their first read (keep-first, not LRU: the validation
# reference reads the layers in the same order every forward, which an LRU cache smaller than
# the model never hits). Off by default: nothing holds the model in float32. Each forward then
# dequantizes again: building the default SmolLM2 recipe reads every tensor 10 times, 7.9 s of
# its 64 s CPU, for 0.55 GB less peak memory. SPECEXPORT_STREAM_CACHE_MB trades the other way.
CACHE_BYTES = int(os.environ.get("SPECEXPORT_STREAM_CACHE_MB", "0")) << 20
_NP = {"F32": np.float32, "F16": np.float16}  # types read as numbers; the others as bytes


def gguf_names(header: GGUFHeader, hf_names: list[str]) -> dict[str, tuple[str, ...]]:
    """HF parameter name -> the GGUF tensor names holding it for every parameter the file holds
    (a tied head, absent from the file, is left out): one tensor, or several whose rows the
    converter split from one parameter (GGUFArch.tensors: Granite 4.0-H's gate|up), in order."""
    arch = next(k for k, v in MODEL_ARCH_NAMES.items() if v == header.arch.name)
    table = get_tensor_name_map(arch, int(header.config["num_hidden_layers"]))
    explicit, prefix = header.arch.tensors, header.arch.table_prefix
    out = {}
    for hf in hf_names:
        match = _LAYER.match(hf)
        if match is not None and match.group(2) in explicit:
            out[hf] = tuple(f"blk.{match.group(1)}.{t}" for t in explicit[match.group(2)])
            continue
        name = hf  # as gguf-py's table spells it (Nemotron-H: backbone.layers.N.mixer...)
        if prefix is not None and name.startswith(prefix[0]):
            name = prefix[1] + name.removeprefix(prefix[0])
        whole = table.get_name(name)  # a tensor named without a suffix (Mamba2's A_log -> ssm_a, D -> ssm_d)
        if whole is not None:
            out[hf] = (whole,)
            continue
        stem, _, suffix = name.rpartition(".")
        gguf = table.get_name(stem)
        if gguf is not None:
            out[hf] = (f"{gguf}.{suffix}",)
    return out


_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")  # a decoder layer's parameter: (index, name within it)


class GGUFSource:
    """A GGUF file's tensors by Hugging Face name (module docstring).

    hf_names: the model's parameter names; tied: HF name -> the name it is tied to (a head the
    file lacks reads the embedding); partial: parameters the file lacks are left out (a file of
    some weights only, read for its blocks) instead of refused; shapes: the parameters' Hugging
    Face shapes, for tensors the converter reshaped without reordering (LFM2's conv [C, 1, L]
    stored [C, L]): read back in that shape, or refused when the element counts differ."""

    def __init__(
        self,
        header: GGUFHeader,
        hf_names: list[str],
        tied: dict[str, str] | None = None,
        cache_bytes: int = CACHE_BYTES,
        partial: bool = False,
        shapes: dict[str, tuple[int, ...]] | None = None,
    ):
        self.header, self.path = header, header.path
        self._shapes = shapes or {}
        self._cache: dict[str, torch.Tensor] = {}  # HF name -> float32 tensor, kept while within budget
        self._cache_left = cache_bytes
        infos = {t.name: t for t in header.reader.tensors}
        mapping = gguf_names(header, hf_names)
        self._aliases = {a: b for a, b in (tied or {}).items() if mapping.get(a, ("",))[0] not in infos}
        self._tensor: dict[str, ReaderTensor] = {}  # HF name -> its (first) tensor
        self._parts: dict[str, list[ReaderTensor]] = {}  # HF name -> the tensors whose rows it stacks
        for name in hf_names:
            if name in self._aliases:
                continue
            ggufs = mapping.get(name)
            missing = [g for g in ggufs or () if g not in infos]
            if (ggufs is None or missing) and partial:
                continue
            if ggufs is None or missing:
                raise BuildError(
                    f"{self.path.name}: no GGUF tensor for parameter {name!r} (expected {missing[0]!r})"
                    if ggufs
                    else f"{self.path.name}: parameter {name!r} has no GGUF name for {header.arch.name}"
                )
            self._tensor[name] = infos[ggufs[0]]
            if len(ggufs) > 1:
                self._parts[name] = [infos[g] for g in ggufs]
            want = self._shapes.get(name)
            size = sum(math.prod(_shape(infos[g])) for g in ggufs)
            if want is not None and math.prod(want) != size:
                raise FormatError(
                    f"{self.path.name}: GGUF tensor {ggufs[0]!r} has shape {list(_shape(infos[ggufs[0]]))}"
                    + (f" (+{len(ggufs) - 1} stacked)" if len(ggufs) > 1 else "")
                    + f", parameter {name!r} {list(want)}"
                )
        used = {t.name for t in self._tensor.values()} | {t.name for ts in self._parts.values() for t in ts}
        layers = int(header.config["num_hidden_layers"])
        mtp = {n for n in infos if header.mtp_layers and _block(n) >= layers}  # MTP blocks: read by no target
        unused = sorted(set(infos) - used - mtp)
        if unused:
            raise FormatError(
                f"{self.path.name}: GGUF tensor {unused[0]!r} has no Hugging Face name for {header.arch.name}"
                f" (no parameter of the {header.arch.model_type} model; {len(unused)} such tensors)"
            )
        cfg = header.config
        self._heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
        self._orders = header.arch.head_orders(cfg)  # tensor kind -> (axis, perm): axes the converter reordered
        self.blocks = GGUFBlocks(self)

    # -- TensorSource

    def canonical(self, name: str) -> str:
        return self._aliases.get(name, name)

    def has(self, name: str) -> bool:
        return self.canonical(name) in self._tensor

    def get(self, name: str) -> torch.Tensor:
        """float32 in Hugging Face layout ([N, K] for a weight); callers must not modify it (it
        may be the cached copy)."""
        name = self.canonical(name)
        cached = self._cache.get(name)
        if cached is not None:
            return cached
        value = self._dequantized(name)
        if value.nbytes <= self._cache_left:  # the first tensors read stay; the rest are read each time
            self._cache[name] = value
            self._cache_left -= value.nbytes
        return value

    def _dequantized(self, name: str) -> torch.Tensor:
        parts = self._parts.get(self.canonical(name))
        if parts is not None:  # rows the converter split into several tensors, stacked back
            value = np.concatenate([self._float(info) for info in parts])
        else:
            value = self._float(self._info(name))
        want = self._shapes.get(name)  # a converter's reshape undone (same elements, same order)
        return torch.from_numpy(value if want is None else value.reshape(want))

    def _float(self, info: ReaderTensor) -> np.ndarray:
        """One tensor's float32 values in Hugging Face layout (its own GGUF shape, reversed)."""
        shape = _shape(info)
        raw = self._read(info)
        if info.tensor_type in LAYOUTS and len(shape) == 2:
            # the blocks' own dequantization: gguf-py's bit for bit (tests), 1.5x faster
            value = decode_blocks(raw.reshape(shape[0], -1), info.tensor_type).dequantize()  # [N, K]
        else:
            if raw.dtype == np.uint8:  # blocks (or bf16 bytes): gguf-py dequantizes rows of bytes
                raw = raw.reshape(*shape[:-1], -1)
            value = dequantize(raw, info.tensor_type).astype(np.float32, copy=False).reshape(shape)
        return self._layout(info, value)

    def _layout(self, info: ReaderTensor, value: np.ndarray) -> np.ndarray:
        """A tensor's float32 values in Hugging Face layout: q/k rows un-permuted, norm shift off."""
        perm = self._perm(info, value.shape[0])
        if perm is not None:
            value = value[perm]
        arch, kind = self.header.arch, _kind(info.name)
        order = self._orders.get(kind)
        if order is not None:  # Qwen3.5's value heads back in groups (rows, or out_proj's inputs)
            value = np.take(value, order[1], axis=order[0])
        if arch.norm_shift and info.name.endswith("norm.weight") and kind not in arch.unshifted:
            value = value - np.float32(arch.norm_shift)  # the file holds shift + w
        decode = arch.decode.get(kind)
        if decode is not None:  # a value the converter transformed (Mamba2's A = -exp(A_log))
            value = decode(value).astype(np.float32, copy=False)
        return np.ascontiguousarray(value)

    # -- blocks

    def exact(self, name: str) -> BlockQuantized | None:
        """The tensor's own blocks when its type has a MatMulNBits form, else None (a parameter
        stacked from several tensors: their blocks stacked, when every one has such blocks and
        they fit one node)."""
        parts = self._parts.get(self.canonical(name))
        if parts is not None:
            blocks = [self._exact(info) for info in parts]
            if any(b is None for b in blocks) or not compatible(blocks):
                return None
            return concat_rows(blocks)
        return self._exact(self._info(name))

    def _exact(self, info: ReaderTensor) -> BlockQuantized | None:
        if info.tensor_type not in LAYOUTS or len(info.shape) != 2:
            return None
        N = _shape(info)[0]
        w = decode_blocks(self._read(info).reshape(N, -1), info.tensor_type)  # [N, K]
        perm = self._perm(info, N)
        if perm is not None:
            w = permute_rows(w, perm)
        order = self._orders.get(_kind(info.name))
        if order is None:
            return w
        axis, perm = order  # rows keep their blocks; inputs only when each head spans whole blocks
        return permute_rows(w, perm) if axis == 0 else permute_columns(w, perm)

    def gguf_name(self, name: str) -> str:
        return self._info(name).name

    def type_of(self, name: str) -> str:
        return self._info(name).tensor_type.name

    def names(self) -> list[str]:
        return list(self._tensor)

    # -- internals

    def _info(self, name: str) -> ReaderTensor:
        try:
            return self._tensor[self.canonical(name)]
        except KeyError:
            raise BuildError(f"{self.path.name}: no tensor {name!r} in the GGUF file") from None

    def _read(self, info: ReaderTensor) -> np.ndarray:
        """The tensor's bytes, copied out of the file: uint8 [n_bytes] for a block type, else
        its elements in their own dtype."""
        array = np.empty(int(info.n_bytes), np.uint8)  # read straight into it (no bytes object in between)
        view, got = memoryview(array), 0
        fd = os.open(self.path, os.O_RDONLY)
        try:
            while got < array.size:  # one call reads at most ~2 GiB on Linux
                n = os.preadv(fd, [view[got:]], int(info.data_offset) + got)
                if n == 0:
                    raise BuildError(
                        f"{self.path.name}: tensor {info.name!r} is truncated ({got} of {array.size} bytes)"
                    )
                got += n
        finally:
            os.close(fd)
        dtype = _NP.get(info.tensor_type.name)
        return array if dtype is None else array.view(dtype)

    def _perm(self, info: ReaderTensor, rows: int) -> np.ndarray | None:
        """Rows of attn_q / attn_k in Hugging Face order for a permuted family, else None."""
        if not self.header.arch.permute_qk:
            return None
        part = info.name.split(".")[2] if info.name.startswith("blk.") else ""
        heads = self._heads.get(part)
        return None if heads is None else rotary_unpermutation(rows, heads)


def _block(name: str) -> int:
    """A layer tensor's block index ("blk.3.ssm_a" -> 3), else -1."""
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "blk" and len(parts) > 2 and parts[1].isdecimal() else -1


def _kind(name: str) -> str:
    """A layer tensor's kind ("ssm_a" of "blk.3.ssm_a"), else ""."""
    parts = name.split(".")
    return parts[2] if parts[0] == "blk" and len(parts) > 2 else ""


def _shape(info: ReaderTensor) -> tuple[int, ...]:
    """numpy shape of a tensor: GGUF's ne reversed ([N, K] for a weight stored ne = [K, N])."""
    return tuple(int(n) for n in reversed(info.shape.tolist()))


class GGUFBlocks(Mapping):
    """The file's exact blocks by HF name, decoded when asked (one tensor at a time), and a count
    of what each quantized weight became (`summary`)."""

    def __init__(self, source: GGUFSource):
        self._source = source
        self._seen: dict[str, tuple[str, bool]] = {}  # name -> (GGML type, kept exactly)

    def get(self, name: str, default=None) -> BlockQuantized | None:  # type: ignore[override]
        if not self._source.has(name):
            return default
        w = self._source.exact(name)
        self._seen[self._source.canonical(name)] = (self._source.type_of(name), w is not None)
        return default if w is None else w

    def __getitem__(self, name: str) -> BlockQuantized:
        w = self.get(name)
        if w is None:
            raise KeyError(name)
        return w

    def __iter__(self) -> Iterator[str]:
        s = self._source
        return iter(n for n in s.names() if s._tensor[n].tensor_type in LAYOUTS and len(s._tensor[n].shape) == 2)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def summary(self) -> dict[str, dict[str, int]]:
        """{"exact": {"Q4_K": n, ...}, "dequantized": {"Q3_K": n, ...}, "float": {"F16": n}} of the
        weights asked for so far."""
        out: dict[str, dict[str, int]] = {"exact": {}, "dequantized": {}, "float": {}}
        for qtype, exact in self._seen.values():
            kind = "exact" if exact else "dequantized" if GGML_QUANT_SIZES[_type(qtype)][0] > 1 else "float"
            out[kind][qtype] = out[kind].get(qtype, 0) + 1
        return {k: dict(sorted(v.items())) for k, v in out.items() if v}


def _type(name: str):
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType[name]


def open_gguf(header: GGUFHeader) -> torch.nn.Module:
    """The streamed skeleton of a GGUF file (streaming.attach): forwards load each module's
    weights from the file, dequantized, for that forward only."""
    from .streaming import attach, skeleton, tied_aliases

    model = skeleton(hf_config(header))
    params = list(model.named_parameters(remove_duplicate=False))
    shapes = {n: tuple(p.shape) for n, p in params}
    source = GGUFSource(header, [n for n, _ in params], tied_aliases(model), shapes=shapes)
    attach(model, source)
    return model


def file_source(path: str | Path) -> GGUFSource:
    """The source of a GGUF file on its own (the skeleton of its config names the parameters;
    those the file lacks are left out): what read_gguf_blocks below reads."""
    from ..formats.gguf_config import read_header
    from .streaming import skeleton, tied_aliases

    header = read_header(path)
    model = skeleton(hf_config(header))
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    return GGUFSource(header, names, tied_aliases(model), cache_bytes=0, partial=True)


def gguf_path(location: str, gguf_file: str | None) -> Path:
    return Path(location) / gguf_file if gguf_file else Path(location)


def read_gguf_blocks(path: str | Path, names: Iterable[str] | None = None) -> dict[str, BlockQuantized]:
    """Every quantized 2-D weight of a GGUF file, keyed by Hugging Face parameter name, read
    through the file's streamed source (gguf_source.file_source: the architecture table, names
    and q/k row order of formats/gguf_config.py).

    Weights are [out_features, in_features] in Hugging Face row order. Plain-number tensors
    (F32, F16, BF16) are left out. With `names`, only those parameters are decoded; names the
    file does not hold quantized are absent from the result (a tied lm_head has no tensor of its
    own). Raises FormatError for an unsupported architecture, a tensor with no Hugging Face name,
    or a quantized tensor asked for whose type has no exact block form here (a build dequantizes
    those instead: gguf_source.GGUFBlocks)."""
    source = file_source(path)
    wanted = source.names() if names is None else [n for n in names if source.has(n)]
    out: dict[str, BlockQuantized] = {}
    for name in wanted:
        if source.canonical(name) != name:
            continue  # a tied head: the embedding's tensor
        qtype = GGMLQuantizationType[source.type_of(name)]
        if not is_block_type(qtype):
            continue
        if qtype not in LAYOUTS:
            raise FormatError(
                f"GGUF tensor {source.gguf_name(name)!r} has type {qtype.name}, which has no exact "
                f"block form here (supported: {supported_types()})"
            )
        w = source.exact(name)
        if w is None:
            raise FormatError(
                f"GGUF tensor {source.gguf_name(name)!r} has no exact blocks in Hugging Face order"
                " (not a 2-D weight, or its inputs reordered across blocks)"
            )
        out[name] = w
    return out
