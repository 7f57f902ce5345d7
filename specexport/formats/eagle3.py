"""EAGLE-3 draft heads in their published format: loader and checks (the writer is eagle3_writer.py).

A head is one Llama decoder layer whose attention reads 2H inputs, plus an `fc` that mixes three
of the target's hidden states and an lm_head over a reduced draft vocabulary (the format of
the EAGLE reference code, SpecForge and vLLM). A folder holds `config.json` and `model.safetensors` (or sharded
`*.safetensors` with `model.safetensors.index.json`; a `pytorch_model.bin` pickle only with
allow_pickle=True, then read with torch.load(weights_only=True)). Its tensors:

    fc.weight                                      [H, 3 H_t]
    midlayer.input_layernorm.weight                [H]          norm of the token embedding
    midlayer.hidden_norm.weight                    [H]          norm of the incoming hidden h
    midlayer.self_attn.q_proj.weight               [heads * hd, 2H]
    midlayer.self_attn.{k,v}_proj.weight           [kv_heads * hd, 2H]
    midlayer.self_attn.o_proj.weight               [H, heads * hd]
    midlayer.post_attention_layernorm.weight       [H]
    midlayer.mlp.{gate,up}_proj.weight             [I, H]
    midlayer.mlp.down_proj.weight                  [H, I]
    norm.weight                                    [H]
    lm_head.weight                                 [draft_vocab, H]
    d2t  int64 [draft_vocab]   target id of draft id i = i + d2t[i]
    t2d  bool  [V_t]           True exactly at the target ids some draft id maps to
    embed_tokens.weight        [V_t, H]   optional; absent = the target's embedding is used

The architecture string varies between tools, so a head is recognised by these names.

Layer ids (which target hidden states feed `fc`), in the *entering-layer* convention used
everywhere in specexport: id i is the residual stream entering decoder layer i, i.e.
transformers' `output_hidden_states[i]` (0 = the embeddings). Valid ids are 0..L-1 for a target
of L layers: `output_hidden_states[L]` is the last layer's output *after* the final norm in
transformers, not a residual stream, and no published head uses it. Sources, in this order:
  - `layers=` given by the caller (the recipe's `layers: [i, j, k]`), entering convention;
  - config `eagle_config.eagle_aux_hidden_state_layer_ids` (ModelOpt / SpecForge / EAGLE
    training tools): "output of layer X" (a forward hook on layer X), so entering id X + 1;
  - default (2, L // 2, L - 3): SafeAILab EAGLE's `modeling_llama_kv.py` and vLLM's
    `get_eagle3_aux_hidden_state_layers` both capture the stream *before* those layers run.
A top-level `eagle_aux_hidden_state_layer_ids` (speculators / vLLM format) is refused unless
`layers=` is given: vLLM takes it as entering ids, while converters have written
output-of-layer ids there, and a wrong guess silently collapses acceptance.
Features are concatenated in the given order (low | mid | high for the default).

Only the plain Llama layer is supported: hidden_act "silu", rope without scaling (rope type
"default"), the residual of the attention block being h itself (`norm_before_residual` false).
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specexport_runtime.constants import default_feature_layers

from .blocks import FormatError
from .hf_quantized import read_safetensors

PICKLE_NAME = "pytorch_model.bin"

_LAYER = "midlayer."
_REQUIRED = (
    "fc.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
)
EMBED = "embed_tokens.weight"
FLOAT_NAMES = tuple(n for n in _REQUIRED if n.endswith(".weight")) + (EMBED,)
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_ROPE_TYPES = (None, "default")


@dataclass(frozen=True)
class TargetShape:
    """What the loader checks a head against, without loading the target model."""

    hidden_size: int  # H_t: width of each of the three feature rows
    num_layers: int  # L: decoder layers; valid entering layer ids are 0..L-1
    vocab_size: int  # V_t: rows of the target's embedding / lm_head (t2d length)
    embedding_width: int | None = None  # width of the target's token embedding; None = hidden_size

    @property
    def embed_width(self) -> int:
        return self.hidden_size if self.embedding_width is None else self.embedding_width

    @classmethod
    def from_hf_config(cls, config) -> TargetShape:
        """From a transformers config (its normalized form: a multimodal wrapper's decoder)."""
        from ..models.config import normalize

        norm = normalize(config)
        return cls(hidden_size=norm.hidden, num_layers=norm.num_layers, vocab_size=norm.vocab)


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int  # H
    target_hidden_size: int  # H_t (config `target_hidden_size`, default H)
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int  # config `head_dim`, default H // heads
    intermediate_size: int  # I
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # None or a rope type "default" dict (others refused)
    draft_vocab_size: int
    vocab_size: int  # V_t, the target's
    hidden_act: str  # "silu"
    layer_ids: tuple[int, int, int]  # entering-layer convention (module docstring)
    layer_ids_source: str  # "recipe" | "config" | "default"
    layer_ids_reason: str = ""  # one line for the build report: which ids and why


@dataclass(frozen=True, eq=False)
class Eagle3Head:
    config: Eagle3Config
    weights: dict[str, torch.Tensor]  # float32, names and shapes as in the module docstring
    d2t: np.ndarray  # int64 [draft_vocab]: offsets, target id = i + d2t[i]
    t2d: np.ndarray  # bool [V_t]: True at the target ids of the draft vocabulary

    def draft_to_target(self) -> np.ndarray:
        """int64 [draft_vocab]: the target id of each draft id."""
        return np.arange(self.d2t.shape[0], dtype=np.int64) + self.d2t

    @property
    def embed_tokens(self) -> torch.Tensor | None:
        return self.weights.get(EMBED)  # [V_t, H] or None (use the target's)


# ----------------------------------------------------------------------------------- loading


def load_eagle3_head(
    path: str | Path, target: TargetShape, allow_pickle: bool = False, *, layers: Sequence[int] | None = None
) -> Eagle3Head:
    """Read and check the head folder at `path` against `target` (module docstring).

    layers: entering-layer ids overriding the config and the default (the recipe's
    `layers: [i, j, k]`). Every failure is a one-line FormatError naming the values."""
    folder = Path(path)
    raw = _read_config(folder)
    tensors = _read_tensors(folder, allow_pickle)
    _check_names(tensors, folder)  # a head is recognised by its tensor names
    config = parse_config(raw, target, layers)
    weights = {name: _as_float32(name, tensors[name]) for name in FLOAT_NAMES if name in tensors}
    _check_shapes(weights, config, target)
    d2t = _index_array(tensors["d2t"])
    t2d = _mask_array(tensors["t2d"])
    check_vocab_maps(d2t, t2d, config.draft_vocab_size, target.vocab_size)
    return Eagle3Head(config=config, weights=weights, d2t=d2t, t2d=t2d)


def _read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise FormatError(f"{folder} has no config.json (an EAGLE-3 head folder needs one)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise FormatError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise FormatError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _read_tensors(folder: Path, allow_pickle: bool) -> dict:
    """Tensors by name: safetensors when the folder has any, else the pickle (flag needed)."""
    if (folder / "model.safetensors.index.json").is_file() or any(folder.glob("*.safetensors")):
        return read_safetensors(folder)
    path = folder / PICKLE_NAME
    if not path.is_file():
        raise FormatError(f"{folder} has neither *.safetensors nor {PICKLE_NAME}")
    if not allow_pickle:
        raise FormatError(
            f"{path} is a pickle; pass allow_pickle=True to read it "
            f"(torch.load with weights_only=True), or convert it to safetensors"
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, ValueError, EOFError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise FormatError(f"{path} could not be read with torch.load(weights_only=True): {first}") from exc
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise FormatError(f"{path} must hold a flat state dict of tensors, got {type(state).__name__}")
    return dict(state)


def parse_config(raw: Mapping, target: TargetShape, layers: Sequence[int] | None = None) -> Eagle3Config:
    """Eagle3Config of a head's config.json, checked against `target` (not the tensors)."""
    H = _int(raw, "hidden_size")
    heads = _int(raw, "num_attention_heads")
    layers_in_head = raw.get("num_hidden_layers", 1)
    if layers_in_head != 1:
        raise FormatError(f"num_hidden_layers {layers_in_head!r}: an EAGLE-3 head has exactly 1 decoder layer")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise FormatError(f"hidden_act {act!r} is not supported (EAGLE-3 heads here use 'silu')")
    if raw.get("norm_before_residual"):
        raise FormatError("norm_before_residual true is not supported (the residual must be h, not hidden_norm(h))")
    theta, scaling = _rope(raw)
    draft_vocab, vocab = _int(raw, "draft_vocab_size"), _int(raw, "vocab_size")
    _check_sizes(raw, H, draft_vocab, vocab, target)
    ids, source, reason = _layer_ids(raw, target.num_layers, layers)
    kv_heads = _int(raw, "num_key_value_heads") if raw.get("num_key_value_heads") is not None else heads
    if heads % kv_heads:
        raise FormatError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    return Eagle3Config(
        hidden_size=H,
        target_hidden_size=_int(raw, "target_hidden_size") if raw.get("target_hidden_size") is not None else H,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=int(raw.get("head_dim") or H // heads),
        intermediate_size=_int(raw, "intermediate_size"),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        draft_vocab_size=draft_vocab,
        vocab_size=vocab,
        hidden_act=act,
        layer_ids=ids,
        layer_ids_source=source,
        layer_ids_reason=reason,
    )


def _int(raw: Mapping, key: str) -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise FormatError(f"config.json {key} must be a positive integer, got {value!r}")
    return value


def _rope(raw: Mapping) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from `rope_theta` / `rope_scaling` or transformers 5's
    `rope_parameters`; only unscaled rope over the whole head_dim is supported."""
    scaling, params = raw.get("rope_scaling"), raw.get("rope_parameters")
    for entry in (scaling, params):
        if entry is not None and not isinstance(entry, Mapping):
            raise FormatError(f"rope_scaling / rope_parameters must be an object, got {entry!r}")
    entries = [e for e in (scaling, params) if e]
    for entry in entries:
        kind = entry.get("rope_type", entry.get("type"))
        if kind not in _ROPE_TYPES:
            raise FormatError(f"rope type {kind!r} is not supported yet (supported: none or 'default')")
    for entry in (raw, *entries):
        factor = entry.get("partial_rotary_factor", 1.0)
        if factor != 1.0:
            raise FormatError(f"partial_rotary_factor {factor!r} is not supported (rotary over all of head_dim only)")
    theta = raw.get("rope_theta", (params or {}).get("rope_theta", 10000.0))
    return float(theta), dict(scaling) if scaling else None


def _check_sizes(raw: Mapping, H: int, draft_vocab: int, vocab: int, target: TargetShape) -> None:
    H_t = _int(raw, "target_hidden_size") if raw.get("target_hidden_size") is not None else H
    if H_t != target.hidden_size:
        raise FormatError(f"head target_hidden_size {H_t} != the target's hidden size {target.hidden_size}")
    if vocab != target.vocab_size:
        raise FormatError(f"head vocab_size {vocab} != the target's vocab size {target.vocab_size}")
    if draft_vocab > target.vocab_size:
        raise FormatError(f"draft_vocab_size {draft_vocab} > the target's vocab size {target.vocab_size}")


def _layer_ids(raw: Mapping, L: int, layers: Sequence[int] | None) -> tuple[tuple[int, int, int], str, str]:
    """(entering-layer ids, source, reason) per the module docstring's rules."""
    eagle_config = raw.get("eagle_config") or {}
    if not isinstance(eagle_config, Mapping):
        raise FormatError(f"config.json eagle_config must be an object, got {eagle_config!r}")
    listed = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    if layers is not None:
        ids = _three_ints(layers, "layers")
        source, reason = "recipe", f"entering layers {list(ids)} given by the recipe"
    elif listed is not None:
        given = _three_ints(listed, "eagle_config.eagle_aux_hidden_state_layer_ids")
        ids = tuple(i + 1 for i in given)
        source = "config"
        reason = (
            f"entering layers {list(ids)}: config eagle_config.eagle_aux_hidden_state_layer_ids "
            f"{list(given)} name layer outputs, so +1"
        )
    elif raw.get("eagle_aux_hidden_state_layer_ids") is not None:
        raise FormatError(
            f"top-level eagle_aux_hidden_state_layer_ids {raw['eagle_aux_hidden_state_layer_ids']!r} "
            f"has no agreed convention (entering vs output of a layer): give the recipe's "
            f"draft.eagle3.layers explicitly"
        )
    else:
        ids = default_feature_layers(L)
        source, reason = "default", f"entering layers {list(ids)}: EAGLE-3 default (2, L//2, L-3) for L = {L}"
    bad = [i for i in ids if not 0 <= i < L]
    if bad:
        raise FormatError(
            f"layer ids {list(ids)} (entering convention, {source}) are outside the target's layers 0..{L - 1}: {bad}"
        )
    return ids, source, reason  # type: ignore[return-value]


def _three_ints(value: object, what: str) -> tuple[int, int, int]:
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 3
        or not all(isinstance(i, int) and not isinstance(i, bool) for i in value)
    ):
        raise FormatError(f"{what} must be 3 integers, got {value!r}")
    return tuple(int(i) for i in value)  # type: ignore[return-value]


def _check_names(tensors: Mapping, folder: Path) -> None:
    names = set(tensors)
    if "fc.weight" not in names or not any(n.startswith(_LAYER) for n in names):
        sample = sorted(names)[:4]
        raise FormatError(f"{folder} is not an EAGLE-3 head: no fc.weight / midlayer.* tensors (has e.g. {sample})")
    missing = [n for n in _REQUIRED if n not in names]
    if missing:
        raise FormatError(f"EAGLE-3 head tensor {missing[0]!r} is missing" + _more(missing))
    extra = sorted(names - set(_REQUIRED) - {EMBED})
    if extra:
        raise FormatError(f"unexpected tensor {extra[0]!r} in the EAGLE-3 head" + _more(extra))


def _more(names: list[str]) -> str:
    return f" (and {len(names) - 1} more)" if len(names) > 1 else ""


def _as_float32(name: str, value: torch.Tensor) -> torch.Tensor:
    if value.dtype not in _FLOAT_DTYPES:
        raise FormatError(f"tensor {name!r} has dtype {value.dtype}, expected float32, float16 or bfloat16")
    return value.detach().to(torch.float32).contiguous()


def expected_shapes(config: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """Shape of every float tensor of a head with this config (embed_tokens: [V_t, H])."""
    H, F = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    attn = "midlayer.self_attn."
    return {
        "fc.weight": (H, 3 * config.target_hidden_size),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.hidden_norm.weight": (H,),
        attn + "q_proj.weight": (q, 2 * H),
        attn + "k_proj.weight": (kv, 2 * H),
        attn + "v_proj.weight": (kv, 2 * H),
        attn + "o_proj.weight": (H, q),
        "midlayer.post_attention_layernorm.weight": (H,),
        "midlayer.mlp.gate_proj.weight": (F, H),
        "midlayer.mlp.up_proj.weight": (F, H),
        "midlayer.mlp.down_proj.weight": (H, F),
        "norm.weight": (H,),
        "lm_head.weight": (config.draft_vocab_size, H),
        EMBED: (config.vocab_size, H),
    }


def _check_shapes(weights: Mapping[str, torch.Tensor], config: Eagle3Config, target: TargetShape) -> None:
    H = config.hidden_size
    fc_in = weights["fc.weight"].shape[-1]
    if fc_in != 3 * target.hidden_size:
        raise FormatError(
            f"fc.weight input width {fc_in} != 3 x the target's hidden size "
            f"{target.hidden_size} = {3 * target.hidden_size}"
        )
    for name in ("q_proj", "k_proj", "v_proj"):
        width = weights[f"midlayer.self_attn.{name}.weight"].shape[-1]
        if width != 2 * H:
            raise FormatError(f"midlayer.self_attn.{name}.weight input width {width} != 2 x hidden_size {H} = {2 * H}")
    _check_embedding(weights, H, target)
    for name, shape in expected_shapes(config).items():
        if name in weights and tuple(weights[name].shape) != shape:
            raise FormatError(f"tensor {name!r} has shape {list(weights[name].shape)}, expected {list(shape)}")


def _check_embedding(weights: Mapping[str, torch.Tensor], H: int, target: TargetShape) -> None:
    """The head embeds tokens with its own embed_tokens [V_t, H] or else the target's, whose
    width must then be H."""
    embed = weights.get(EMBED)
    if embed is None:
        if target.embed_width != H:
            raise FormatError(
                f"the head has no embed_tokens, so it takes the target's embedding of width "
                f"{target.embed_width}, but its hidden_size is {H}"
            )
    elif embed.ndim != 2 or embed.shape[1] != H:
        raise FormatError(f"embed_tokens.weight width {list(embed.shape)[1:]} != the head's hidden_size {H}")


def _index_array(value: torch.Tensor) -> np.ndarray:
    if value.dtype.is_floating_point or value.dtype == torch.bool or value.is_complex():
        raise FormatError(f"d2t has dtype {value.dtype}, expected int64")
    return value.detach().cpu().numpy().astype(np.int64)


def _mask_array(value: torch.Tensor) -> np.ndarray:
    if value.dtype != torch.bool:
        raise FormatError(f"t2d has dtype {value.dtype}, expected bool")
    return value.detach().cpu().numpy().astype(np.bool_)


def check_vocab_maps(d2t: np.ndarray, t2d: np.ndarray, draft_vocab: int, target_vocab: int) -> None:
    """d2t [draft_vocab] maps draft ids into 0..V_t-1 one-to-one, and t2d [V_t] is True exactly at
    those target ids."""
    if d2t.shape != (draft_vocab,):
        raise FormatError(f"d2t has shape {list(d2t.shape)}, expected [{draft_vocab}] (draft_vocab_size)")
    if t2d.shape != (target_vocab,):
        raise FormatError(f"t2d has shape {list(t2d.shape)}, expected [{target_vocab}] (the target's vocab size)")
    ids = np.arange(draft_vocab, dtype=np.int64) + d2t
    bad = np.flatnonzero((ids < 0) | (ids >= target_vocab))
    if bad.size:
        i = int(bad[0])
        raise FormatError(
            f"d2t[{i}] = {int(d2t[i])} maps draft id {i} to target id {int(ids[i])}, outside 0..{target_vocab - 1}"
        )
    unique, counts = np.unique(ids, return_counts=True)
    if unique.size != draft_vocab:
        dup = int(unique[counts > 1][0])
        raise FormatError(f"d2t maps more than one draft id to target id {dup}")
    marked = np.flatnonzero(t2d)
    if marked.size != draft_vocab or not np.array_equal(marked, unique):
        unmarked = np.setdiff1d(unique, marked)
        stray = np.setdiff1d(marked, unique)
        detail = (
            f"target id {int(unmarked[0])} is mapped by d2t but False in t2d"
            if unmarked.size
            else f"target id {int(stray[0])} is True in t2d but no draft id maps to it"
        )
        raise FormatError(f"t2d marks {marked.size} target ids, d2t maps {draft_vocab}: {detail}")


__all__ = [
    "Eagle3Config",
    "Eagle3Head",
    "TargetShape",
    "check_vocab_maps",
    "expected_shapes",
    "load_eagle3_head",
    "parse_config",
]
