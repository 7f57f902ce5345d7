"""The fused graph: the same decoder written directly as ONNX with ONNX Runtime contrib ops.

Layout `head_major_inplace` of the graph contract (docs/graph-contract.md, contract 1.1):
attention is one com.microsoft GroupQueryAttention node per layer that applies rotary itself
(its own table per layer: Gemma 3's local and global thetas; none on NoPE layers; a table
narrower than the head for partial rotary), honours the layer's sliding window and softcap, and
writes the new K/V in place into a [1, H_kv, T_max, D] buffer shared by its past and present
bindings; norms are SimplifiedLayerNormalization / SkipSimplifiedLayerNormalization (the
residual add rides along). About 11 nodes per layer instead of ~33 in the portable graph: on a
CPU, and more so for a quantized draft, per-node overhead rivals the matrix work
(docs/performance.md).

The graph is written with onnx.helper (no tracing), one weight at a time: each is read from the
model's TensorSource by its Hugging Face name (streaming.py: a safetensors checkpoint read tensor
by tensor, or a loaded model's parameters) and appended to model.onnx.data as it is written. It
reproduces the same families as the portable decoder except learned positions (GPT-2): the
family's row (architectures.py) says where each weight lives and how the layer is wired, the
normalized config (model_config.py) what it computes; validate.py checks the numerics against
transformers exactly like the portable graph.

    input_ids              int64    [1, S]
    logits_index           int64    [R]
    seqlens_k              int32    [1]                  P + S - 1 (index of the last token)
    total_sequence_length  int32    []                   P + S
    past_key_{i}           kv_dtype [1, H_kv, T_max, D]  the whole buffer; rows >= P are ignored
    past_value_{i}         kv_dtype [1, H_kv, T_max, D]
 -> logits                 float32  [1, R, V]
    present_key_{i}        kv_dtype [1, H_kv, T_max, D]  the same buffer (bound to the same memory)
    present_value_{i}      kv_dtype [1, H_kv, T_max, D]

GroupQueryAttention's local_window_size counts the query's own key since ONNX Runtime 1.23
(before: one key more); contract.WINDOW_MIN_ORT is the runtime floor for windowed graphs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from onnx import TensorProto

from specexport_runtime import contract
from specexport_runtime.contract import GraphSpec

from . import fused_slots
from .architectures import ArchSpec, arch_for, module_at
from .decoder import rotary_inv_freq
from .export import ExportResult
from .graph_writer import (
    MS,
    ONNX_DTYPE,
    DataFile,
    FloatWeights,
    Graph,
    Linear,
    WeightPlan,
    activation,
    save_graph,
    softcap,
)
from .model_config import NormalizedConfig, UnsupportedConfig, check_hf_modules, normalize
from .streaming import Weights, source_of


def fused_supported(model_type: str) -> bool:
    """Families the fused builder reproduces (rotary positions); GPT-2 stays portable."""
    return arch_for(model_type).positions == "rope"


def fused_refusal(cfg: NormalizedConfig) -> str | None:
    """Why the fused graphs (its tree graph included) cannot reproduce `cfg` (None: they can);
    known from the config alone."""
    if cfg.arch.positions != "rope":
        return f"architecture {cfg.family!r} has learned positions; use graph: portable"
    half = cfg.rotary_dim // 2
    if cfg.rotary_dim < cfg.head_dim and half % 8:  # ONNX Runtime: cos_cache width <= D/2 and a multiple of 8
        return (
            f"partial rotary over {cfg.rotary_dim} of {cfg.head_dim} dims: GroupQueryAttention needs"
            f" rotary_dim / 2 = {half} to be a multiple of 8; use graph: portable"
        )
    return None


def _norm_weight(module: torch.nn.Module, offset: float, w: Weights) -> tuple[torch.Tensor, float]:
    eps = getattr(module, "variance_epsilon", None)
    if eps is None:
        eps = getattr(module, "eps", None)
    if eps is None or getattr(module, "weight", None) is None:
        raise UnsupportedConfig(f"norm module {type(module).__name__} has no weight/eps the fused graph can use")
    return w.of(module).float() + offset, float(eps)


def _rope_caches(g: Graph, model: torch.nn.Module, cfg: NormalizedConfig, positions: int) -> dict[str, tuple[str, str]]:
    """rope key -> (cos, sin) initializers [T_max, rotary_dim / 2], computed as transformers does
    (fp32 product, then cos/sin, times the rope's attention scaling)."""
    caches = {}
    pos = torch.arange(positions, dtype=torch.float32)
    for key, (inv_freq, scale) in rotary_inv_freq(model, cfg).items():
        freqs = (inv_freq[:, None] @ pos[None, :]).t()  # [T_max, rot/2], fp32 like transformers
        cos, sin = (freqs.cos() * scale).numpy(), (freqs.sin() * scale).numpy()
        caches[key] = (g.const("cos_cache", cos.astype(g.np_dtype)), g.const("sin_cache", sin.astype(g.np_dtype)))
    return caches


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's weight sites: q|k|v [(H + 2 H_kv) D, hidden], o, gate|up [2 I, hidden],
    down, each with its bias or None."""

    qkv: Linear
    qkv_b: torch.Tensor | None
    o: Linear
    o_b: torch.Tensor | None
    gate_up: Linear
    gate_up_b: torch.Tensor | None
    down: Linear
    down_b: torch.Tensor | None


def _bias(w: Weights, *modules: torch.nn.Module) -> torch.Tensor | None:
    if all(getattr(m, "bias", None) is None for m in modules):
        return None
    return torch.cat([w.bias(m) if m.bias is not None else torch.zeros(m.weight.shape[0]) for m in modules])


def _layer_weights(layer: torch.nn.Module, arch: ArchSpec, cfg: NormalizedConfig, w: Weights, i: int) -> LayerWeights:
    """Layer i's weights, read from the source (one layer's weights at a time)."""
    attn, mlp = module_at(layer, arch.attn), module_at(layer, arch.mlp)
    part = w.part
    if arch.qkv == "separate":
        mods = (attn.q_proj, attn.k_proj, attn.v_proj)
    elif arch.qkv == "fused":
        mods = (attn.qkv_proj,)
    else:
        raise UnsupportedConfig(f"qkv kind {arch.qkv!r} is not supported by the fused graph")
    qkv = Linear(f"l{i}_qkv", tuple(part(m) for m in mods))
    H, Hkv, D = cfg.heads, cfg.kv_heads, cfg.head_dim
    if qkv.out_features != (H + 2 * Hkv) * D:
        raise UnsupportedConfig(f"q|k|v rows {qkv.out_features} != (H + 2 H_kv) D = {(H + 2 * Hkv) * D}")
    out = getattr(attn, arch.out_proj)
    if arch.mlp_kind == "gated":
        up_mods = (mlp.gate_proj, mlp.up_proj)
    elif arch.mlp_kind == "fused_gated":  # rows [gate; up] already
        up_mods = (mlp.gate_up_proj,)
    else:
        raise UnsupportedConfig(f"mlp kind {arch.mlp_kind!r} is not supported by the fused graph")
    return LayerWeights(
        qkv,
        _bias(w, *mods),
        Linear(f"l{i}_o", (part(out),)),
        _bias(w, out),
        Linear(f"l{i}_gate_up", tuple(part(m) for m in up_mods)),
        _bias(w, *up_mods),
        Linear(f"l{i}_down", (part(mlp.down_proj),)),
        _bias(w, mlp.down_proj),
    )


class _Stream:
    """The residual stream: `residual` plus a `pending` addend that the next norm folds in
    (SkipSimplifiedLayerNormalization: one node for the add and the norm)."""

    def __init__(self, g: Graph, x: str, offset: float, weights: Weights):
        self.g, self.residual, self.pending, self.offset, self.weights = g, x, None, offset, weights

    def norm(self, module: torch.nn.Module) -> str:
        """norm(residual + pending); residual := residual + pending."""
        w, eps = _norm_weight(module, self.offset, self.weights)
        if self.pending is None:
            return self.g.op(
                "SimplifiedLayerNormalization",
                [self.residual, self.g.weight("norm", w)],
                axis=-1,
                epsilon=eps,
                stash_type=1,
            )[0]
        h, _, _, self.residual = self.g.op(
            "SkipSimplifiedLayerNormalization",
            [self.pending, self.residual, self.g.weight("norm", w)],
            4,
            domain=MS,
            epsilon=eps,
        )
        self.pending = None
        return h

    def value(self) -> str:
        """residual + pending as a tensor (one Add when an addend is pending)."""
        if self.pending is not None:
            (self.residual,) = self.g.op("Add", [self.residual, self.pending])
            self.pending = None
        return self.residual

    def add(self, branch: str) -> None:
        assert self.pending is None, "two addends pending"
        self.pending = branch


def _linear(g: Graph, weights: WeightPlan, x: str, site: Linear, bias: torch.Tensor | None) -> str:
    y = weights.linear(g, x, site)
    if bias is not None:
        (y,) = g.op("Add", [y, g.weight(f"{site.stem}_b", bias)])
    return y


def _head_norm(g: Graph, x: str, module: torch.nn.Module, heads: int, D: int, offset: float, ws: Weights) -> str:
    """RMSNorm over head_dim of x [1, S, heads D] -> [1, S, heads D]."""
    w, eps = _norm_weight(module, offset, ws)
    (y,) = g.op("Reshape", [x, g.const("shape", np.array([1, -1, heads, D], np.int64))])
    (y,) = g.op("SimplifiedLayerNormalization", [y, g.weight("head_norm", w)], axis=-1, epsilon=eps, stash_type=1)
    (y,) = g.op("Reshape", [y, g.const("shape", np.array([1, -1, heads * D], np.int64))])
    return y


def _full_norm(g: Graph, x: str, module: torch.nn.Module, offset: float, ws: Weights) -> str:
    """RMSNorm over the whole last dim of x [1, S, C] (OLMo 2's q/k norm)."""
    w, eps = _norm_weight(module, offset, ws)
    return g.op("SimplifiedLayerNormalization", [x, g.weight("qk_norm", w)], axis=-1, epsilon=eps, stash_type=1)[0]


def _attention(
    g: Graph,
    i: int,
    attn: torch.nn.Module,
    cfg: NormalizedConfig,
    h: str,
    lw: LayerWeights,
    weights: WeightPlan,
    caches: dict[str, tuple[str, str]],
    at: fused_slots.Layout,
    tree: fused_slots.TreeInputs,
    ws: Weights,
) -> str:
    """h [1, S, hidden] -> the attention output before o_proj [1, S, H D], K/V written in place
    (at: each slot's rows and cursor, fused_slots.layout; tree: a tree graph's
    fused_slots.tree_inputs per window, else empty)."""
    arch, spec = cfg.arch, cfg.layers[i]
    H, Hkv, D = cfg.heads, cfg.kv_heads, cfg.head_dim
    qkv = _linear(g, weights, h, lw.qkv, lw.qkv_b)  # [1, S, (H + 2 H_kv) D]
    if arch.qk_norm:  # RMSNorm of q and k before rotary (which GQA applies)
        q, k, v = g.op("Split", [qkv, g.const("split", np.array([H * D, Hkv * D, Hkv * D], np.int64))], 3, axis=-1)
        if arch.qk_norm == "head":
            q, k = (
                _head_norm(g, q, attn.q_norm, H, D, arch.norm_offset, ws),
                _head_norm(g, k, attn.k_norm, Hkv, D, arch.norm_offset, ws),
            )
        else:
            q, k = (
                _full_norm(g, q, attn.q_norm, arch.norm_offset, ws),
                _full_norm(g, k, attn.k_norm, arch.norm_offset, ws),
            )
        qkv_inputs = [q, k, v]
    else:
        qkv_inputs = [qkv, "", ""]  # packed q|k|v
    attrs = dict(
        num_heads=H, kv_num_heads=Hkv, scale=cfg.attn_scale, do_rotary=int(spec.rope is not None), rotary_interleaved=0
    )
    if spec.window is not None and not tree:  # a query sees the `window` most recent keys including its own
        attrs["local_window_size"] = spec.window  # (as in transformers); a tree graph's bias holds its window
    if cfg.attn_softcap is not None:
        attrs["softcap"] = cfg.attn_softcap
    rotary = list(caches[spec.rope]) if spec.rope is not None else []
    return fused_slots.attention(g, i, qkv_inputs, at, rotary, attrs, tree.get(spec.window, []) if tree else [])


def _branch(g: Graph, layer: torch.nn.Module, post: str | None, out: str, cfg: NormalizedConfig, ws: Weights) -> str:
    """An attention or MLP output as added to the residual stream: post-norm, residual multiplier."""
    if post is not None:
        w, eps = _norm_weight(module_at(layer, post), cfg.arch.norm_offset, ws)
        (out,) = g.op(
            "SimplifiedLayerNormalization", [out, g.weight("post_norm", w)], axis=-1, epsilon=eps, stash_type=1
        )
    if cfg.residual_multiplier is not None:
        (out,) = g.op("Mul", [out, g.scalar("residual_multiplier", cfg.residual_multiplier)])
    return out


def _layer(
    g: Graph,
    i: int,
    layer: torch.nn.Module,
    cfg: NormalizedConfig,
    stream: _Stream,
    h: str,
    lw: LayerWeights,
    weights: WeightPlan,
    caches,
    at: fused_slots.Layout,
    tree: fused_slots.TreeInputs,
) -> None:
    """One decoder layer on h, its attention input [1, S, hidden] (the stream entering it, normed)."""
    arch, ws = cfg.arch, stream.weights
    attn = module_at(layer, arch.attn)
    a = _attention(g, i, attn, cfg, h, lw, weights, caches, at, tree, ws)
    stream.add(_branch(g, layer, arch.attn_post_norm, _linear(g, weights, a, lw.o, lw.o_b), cfg, ws))
    h = stream.norm(module_at(layer, arch.mlp_norm)) if arch.mlp_norm else stream.value()
    inter = lw.gate_up.out_features // 2
    gate_up = _linear(g, weights, h, lw.gate_up, lw.gate_up_b)  # [1, S, 2 I]: one weight stream per MLP input
    gate, up = g.op("Split", [gate_up, g.const("split", np.array([inter, inter], np.int64))], 2, axis=-1)
    (hidden,) = g.op("Mul", [activation(g, gate, cfg.activation), up])
    stream.add(_branch(g, layer, arch.mlp_post_norm, _linear(g, weights, hidden, lw.down, lw.down_b), cfg, ws))


def _paths(model: torch.nn.Module) -> dict[int, str]:
    """id(module) -> its path in the model (a parameter's Hugging Face name is path.attribute)."""
    return {id(m): n for n, m in model.named_modules(remove_duplicate=False)}


def build_fused(
    model: torch.nn.Module,
    out_dir: Path,
    max_context: int,
    *,
    tie_lm_head: bool = True,
    weights: WeightPlan | None = None,
    min_rows: int = 1,
    pad_attention: bool = False,
    feature_layers: tuple[int, ...] = (),
    norm: NormalizedConfig | None = None,
    slots: int = 1,
    tree: bool = False,
    table_rows: int | None = None,
    dtype: torch.dtype | None = None,
    on_layer: Callable[[int, int], None] | None = None,
) -> ExportResult:
    """Write out_dir/model.onnx (+ data) in the head_major_inplace layout for `model` (a loaded
    transformers model, or a streamed skeleton: streaming.open_streamed), reading one weight at a
    time from its source and appending it to the data file as it is written.

    weights: how weights are stored (default FloatWeights: the graph dtype). dtype: the graph's
    float dtype (default: the model's); weights are converted one at a time. min_rows: the
    manifest's min_rows for this graph (contract 1.2: the runtime pads calls). pad_attention:
    every GroupQueryAttention gets one row more than the call, a copy of its last row (contract
    1.2 cache_pad 1): ONNX Runtime's GroupQueryAttention computes a 1-row call on another path
    than calls of 2 or more rows (low-bit differences that int8-activation MatMulNBits turn into
    whole logits), while its MatMuls are row-invariant, so this keeps every row of the graph
    independent of its call's size without paying for a padded MatMul. The copy's K/V land at
    cache row P + S, past the call, and the next call overwrites them. The rotary tables get
    max_context + min_rows - 1 + pad rows so that padding rows have positions too.
    feature_layers: indices i of the residual streams entering decoder layer i (transformers'
    output_hidden_states[i], 0 <= i < layers) returned as `hidden_states` [1, S, F] for every
    input row (contract 1.2: what an EAGLE-3 draft head reads). norm: the model's normalized
    config (default: normalized from model.config). slots: cache slots (contract 1.5,
    fused_slots): K > 1 serves K sequences per call, rows packed slot after slot. tree: the
    tree-verify graph (contract 1.7): position_ids and tree_bias inputs, one slot, unpadded.
    table_rows: rows of the rotary tables (default max_context + min_rows - 1 + pad); a graph
    that shares another's weights file takes that graph's. on_layer(i, n): called once layer i of
    n is written (progress)."""
    weights = weights or FloatWeights()
    pad = 1 if pad_attention else 0
    start = time.perf_counter()
    cfg = norm or normalize(model.config, max_context)
    check_hf_modules(model, cfg)
    arch = cfg.arch
    problem = fused_refusal(cfg)
    if problem:
        raise UnsupportedConfig(problem)
    dtype = dtype or next(model.parameters()).dtype
    if dtype not in ONNX_DTYPE:
        raise UnsupportedConfig(f"dtype {dtype} is not supported (float32 or float16)")
    base = module_at(model, arch.decoder)
    layers = module_at(base, arch.layers)
    V = module_at(base, arch.embed).weight.shape[0]  # embedding [V, hidden]
    if slots < 1 or (slots > 1 and feature_layers):
        raise UnsupportedConfig(f"slots must be >= 1 and a graph of several slots has no features; got {slots}")
    if tree and (slots > 1 or pad or min_rows > 1):
        raise UnsupportedConfig(f"a tree graph has one slot and unpadded rows; got slots {slots}, pad {pad}")
    bad = [i for i in feature_layers if not 0 <= i < len(layers)]
    if bad:
        raise UnsupportedConfig(f"feature layers {bad} are outside the target's 0..{len(layers) - 1}")
    spec = GraphSpec(
        len(layers),
        cfg.kv_heads,
        cfg.head_dim,
        V,
        "float32" if dtype == torch.float32 else "float16",
        kv_layout=contract.HEAD_MAJOR_INPLACE,
        feature_width=len(feature_layers) * cfg.hidden,
        windows=cfg.windows,
        slots=slots,
        tree=tree,
    )

    g = Graph(dtype, data=DataFile(out_dir))
    try:
        return _write(
            g,
            model,
            cfg,
            spec,
            weights,
            max_context,
            min_rows,
            pad,
            feature_layers,
            tree,
            table_rows,
            on_layer,
            start,
            out_dir,
            tie_lm_head,
        )
    finally:
        if g.data is not None:
            g.data.close()


def _write(
    g: Graph,
    model,
    cfg: NormalizedConfig,
    spec: GraphSpec,
    weights: WeightPlan,
    max_context: int,
    min_rows: int,
    pad: int,
    feature_layers: tuple[int, ...],
    tree: bool,
    table_rows: int | None,
    on_layer,
    start: float,
    out_dir: Path,
    tie_lm_head: bool,
) -> ExportResult:
    arch, dtype, slots = cfg.arch, g.dtype, spec.slots
    base = module_at(model, arch.decoder)
    layers = module_at(base, arch.layers)
    caches = _rope_caches(g, model, cfg, table_rows or max_context + min_rows - 1 + pad)
    ws = Weights(source_of(model), _paths(model))
    embed_module = module_at(base, arch.embed)
    x, table = weights.embedding(g, contract.INPUT_IDS, Linear("embed", (ws.part(embed_module),)))
    if arch.embed_scale:  # [1, S, hidden]
        scale = getattr(embed_module, "embed_scale", None)
        (x,) = g.op("Mul", [x, g.scalar("embed_scale", float(scale) if scale is not None else cfg.hidden**0.5)])
    if cfg.embedding_multiplier is not None:
        (x,) = g.op("Mul", [x, g.scalar("embedding_multiplier", cfg.embedding_multiplier)])

    at = fused_slots.layout(g, slots, bool(pad))  # each slot's attention rows and cursor
    tree_in = fused_slots.tree_inputs_by_window(g, ONNX_DTYPE[dtype], cfg.windows) if tree else {}
    stream = _Stream(g, x, arch.norm_offset, ws)
    entering: dict[int, str] = {}  # layer i -> the residual stream entering it [1, S, hidden]
    for i, layer in enumerate(layers):
        h = stream.norm(module_at(layer, arch.attn_norm)) if arch.attn_norm else stream.value()
        entering[i] = stream.residual  # the norm (or value()) has just folded the pending addend into it
        _layer(g, i, layer, cfg, stream, h, _layer_weights(layer, arch, cfg, ws, i), weights, caches, at, tree_in)
        if on_layer is not None:
            on_layer(i, len(layers))

    features = None
    if feature_layers:  # [1, S, F]: low | mid | high, float32 like the logits
        (features,) = g.op("Concat", [entering[i] for i in feature_layers], axis=-1)
        if dtype != torch.float32:
            (features,) = g.op("Cast", [features], to=TensorProto.FLOAT)
    _logits(g, model, cfg, stream, base, table if tie_lm_head else None, ws, dtype, weights)
    if features is not None:
        g.op("Identity", [features], [contract.HIDDEN_STATES])
    inputs, outputs = fused_slots.interface(spec, ONNX_DTYPE[dtype], features is not None)
    padded = pad or min_rows > 1 or feature_layers
    version = contract.version_for(
        spec.kv_layout, 2 if padded else 1, windowed=bool(spec.windows), slots=slots, tree=tree
    )
    return save_graph(g, "specexport_fused", inputs, outputs, spec, version, out_dir, start)


def _logits(
    g: Graph,
    model,
    cfg: NormalizedConfig,
    stream: _Stream,
    base,
    table: str | None,
    ws: Weights,
    dtype,
    weights: WeightPlan,
) -> None:
    """Logits only for the requested rows: gather, final norm, output projection, Granite's
    divisor and Gemma 2's softcap (in the model dtype, as transformers), then float32."""
    (rows,) = g.op("Gather", [stream.pending, contract.LOGITS_INDEX], axis=1)  # [1, R, hidden]
    (res_rows,) = g.op("Gather", [stream.residual, contract.LOGITS_INDEX], axis=1)
    stream.residual, stream.pending = res_rows, rows
    h = stream.norm(module_at(base, cfg.arch.final_norm))  # [1, R, hidden]
    (h2,) = g.op("Squeeze", [h, g.const("axes", np.array([0], np.int64))])  # [R, hidden]
    head = model.get_output_embeddings()
    embed = module_at(base, cfg.arch.embed)
    tied = table is not None and ws.name(head) == ws.name(embed)
    logits = weights.head(g, h2, Linear("lm_head", (ws.part(head),)), table if tied else None)
    if getattr(head, "bias", None) is not None:
        (logits,) = g.op("Add", [logits, g.weight("lm_b", ws.bias(head))])
    if cfg.logits_divisor is not None:
        (logits,) = g.op("Div", [logits, g.scalar("logits_scaling", cfg.logits_divisor)])
    if cfg.final_softcap is not None:
        logits = softcap(g, logits, cfg.final_softcap)
    if dtype != torch.float32:
        (logits,) = g.op("Cast", [logits], to=TensorProto.FLOAT)
    g.op("Unsqueeze", [logits, g.const("axes", np.array([0], np.int64))], [contract.LOGITS])
