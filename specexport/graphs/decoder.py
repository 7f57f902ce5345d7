"""The decoder graph, written once for both forms: each family's layers as ONNX nodes, one weight
at a time, with the operators of the graph's KV layout (docs/graph-contract.md):

- `head_major_inplace` (graph: fused; ops_fused.py): GroupQueryAttention with in-place caches and
  ONNX Runtime's contrib norms, for its CPU and CUDA providers;
- `time_major` (graph: portable; ops_portable.py): ONNX standard ops over a prefix view of the
  cache, for every provider and TensorRT.

Each weight is read from the model's TensorSource by its Hugging Face name (streaming.py: a
safetensors checkpoint read tensor by tensor, or a loaded model's parameters) and appended to
model.onnx.data as it is written. The family's row (architectures.py) says where each weight lives
and how the layer is wired, the normalized config (model_config.py) what it computes; validate.py
checks the numerics against transformers.

Layer (x: the residual stream [1, S, hidden]):
    h = attn_norm(x);  x = x + attn_post_norm(o(attention(qkv(h))))
    h = mlp_norm(x);   x = x + mlp_post_norm(down(act(gate(h)) * up(h)))
Logits only for logits_index's rows: final_norm, head, divisor, softcap, float32.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from onnx import TensorProto

from specexport_runtime import contract
from specexport_runtime.contract import GraphSpec

from ..models.architectures import arch_for, module_at
from ..models.config import CONV, GDN, MAMBA2, NormalizedConfig, UnsupportedConfig, check_hf_modules, normalize
from ..models.mixers import HYBRID, MLP
from ..models.streaming import Weights, source_of
from .conv import conv_mixer, conv_weights, state_interface
from .fused_slots import slot_rows
from .gdn import deltanet_mixer, deltanet_weights
from .layer_attention import head_norm, layer_attention
from .layer_weights import LayerWeights, gated_rows, layer_weights
from .mamba import mamba_mixer, mamba_weights
from .ops_fused import ops_for
from .per_layer_inputs import layer_scalar, per_layer_branch, per_layer_inputs
from .writer import (
    ONNX_DTYPE,
    AttentionShape,
    DataFile,
    ExportResult,
    FloatWeights,
    Graph,
    Linear,
    WeightPlan,
    save_graph,
    softcap,
)


def fused_supported(model_type: str) -> bool:
    """Families the fused form reproduces (rotary positions); GPT-2 is portable only."""
    return arch_for(model_type).positions != "learned"


def fused_refusal(cfg: NormalizedConfig) -> str | None:
    """Why the fused graphs (its tree graph included) cannot reproduce `cfg` (None: they can);
    known from the config alone."""
    if cfg.arch.positions == "learned":
        return f"architecture {cfg.family!r} has learned positions; use graph: portable"
    for _, rope in cfg.ropes:
        dims = rope.dims or cfg.rotary_dim
        if dims < cfg.head_dim and (dims // 2) % 8:  # ONNX Runtime: cos_cache width <= D/2 and a multiple of 8
            return (
                f"partial rotary over {dims} of {cfg.head_dim} dims: GroupQueryAttention needs"
                f" rotary_dim / 2 = {dims // 2} to be a multiple of 8; use graph: portable"
            )
    return None


def rotary_inv_freq(model: torch.nn.Module, norm: NormalizedConfig) -> dict[str, tuple[torch.Tensor, float]]:
    """rope key -> (inv_freq [rotary_dim / 2] float32, attention_scaling) as transformers' rotary
    module holds them (its initial tables: bounded kinds equal them below their bound)."""
    if not norm.ropes:
        return {}
    rotary = module_at(model, f"{norm.arch.decoder}.rotary_emb")
    tables = {}
    for key, rope in norm.ropes:
        prefix = "" if key == "all" else f"{key}_"
        inv = getattr(rotary, f"{prefix}original_inv_freq", None)
        if inv is None:
            inv = getattr(rotary, f"{prefix}inv_freq")
        scale = getattr(rotary, f"{prefix}attention_scaling", None)
        if scale is None:
            scale = rotary.attention_scaling
        inv = inv.detach().float().clone()
        if 2 * inv.shape[0] != (rope.dims or norm.rotary_dim):
            raise UnsupportedConfig(
                f"rotary table {key!r} covers {2 * inv.shape[0]} dims; the config says {rope.dims or norm.rotary_dim}"
            )
        tables[key] = (inv, float(scale))
    return tables


def _norm_weight(module: torch.nn.Module, offset: float, w: Weights) -> tuple[torch.Tensor, float]:
    eps = getattr(module, "variance_epsilon", None)
    if eps is None:
        eps = getattr(module, "eps", None)
    if eps is None or getattr(module, "weight", None) is None:
        raise UnsupportedConfig(f"norm module {type(module).__name__} has no weight/eps the graph can use")
    return w.of(module).float() + offset, float(eps)


class _Stream:
    """The residual stream: `residual` plus a `pending` addend that the next norm folds in (the
    fused form's SkipSimplifiedLayerNormalization: one node for the add and the norm)."""

    def __init__(self, g: Graph, ops, x: str, offset: float, weights: Weights):
        self.g, self.ops, self.residual, self.pending = g, ops, x, None
        self.offset, self.weights = offset, weights

    def _params(self, module: torch.nn.Module) -> tuple[str, float, str | None]:
        w, eps = _norm_weight(module, self.offset, self.weights)
        bias = self.weights.bias(module) if getattr(module, "bias", None) is not None else None
        return self.g.weight("norm", w), eps, (self.g.weight("norm_b", bias) if bias is not None else None)

    def norm(self, module: torch.nn.Module) -> str:
        """norm(residual + pending); residual := residual + pending."""
        w, eps, b = self._params(module)
        if self.pending is None:
            return self.ops.norm(self.g, self.residual, w, eps, b)
        h, self.residual = self.ops.add_norm(self.g, self.pending, self.residual, w, eps, b)
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


@dataclass(frozen=True)
class _Ctx:
    """What every layer of one graph reads."""

    g: Graph
    ops: object  # ops_fused.FusedOps | ops_portable.PortableOps
    cfg: NormalizedConfig
    shape: AttentionShape
    call: object  # the ops' per-call state (prepare())
    weights: WeightPlan
    ws: Weights
    per_layer: str | None = None  # per_layer_inputs.py: the inputs [1, S, L, P] (Gemma 4); None: none
    kv_rows: dict = field(default_factory=dict)  # owning layer i -> the (k, v) its attention was given
    slots: int = 1  # cache slots (feature cache_slots)
    slot_rows: tuple[str, str, str] | None = None  # fused_slots.slot_rows of a recurrent slots graph (conv.per_slot)

    def linear(self, x: str, site: Linear, bias: torch.Tensor | None) -> str:
        y = self.weights.linear(self.g, x, site)
        if bias is not None:
            (y,) = self.g.op("Add", [y, self.g.weight(f"{site.stem}_b", bias)])
        return y

    def rms(self, x: str, module: torch.nn.Module, stem: str) -> str:
        """RMSNorm of x over its last axis with `module`'s weight."""
        w, eps = _norm_weight(module, self.cfg.arch.norm_offset, self.ws)
        return self.ops.norm(self.g, x, self.g.weight(stem, w), eps)


def _attention(c: _Ctx, i: int, attn: torch.nn.Module, h: str, lw: LayerWeights) -> str:
    """h [1, S, hidden] -> layer i's attention output before o_proj [1, S, H D]; K/V to its cache
    (past_key_{n}: n counts the cache-owning attention layers before it). Layers of their own
    head_dim, value norms or K/V sharing: layer_attention.py."""
    arch, spec, g = c.cfg.arch, c.cfg.layers[i], c.g
    H, Hkv, D = c.cfg.heads, c.cfg.kv_heads, c.cfg.head_dim
    qkv = c.linear(h, lw.qkv, lw.qkv_b)  # [1, S, (H + 2 H_kv) D]
    if c.cfg.mup is not None and c.cfg.mup.key != 1.0:  # Falcon-H1: k_proj(x) times key_multiplier
        scale = np.concatenate([np.ones(H * D), np.full(Hkv * D, c.cfg.mup.key), np.ones(Hkv * D)])
        (qkv,) = g.op("Mul", [qkv, g.const("key_multiplier", scale.astype(g.np_dtype))])
    if arch.v_norm or spec.kv_source is not None or c.cfg.layer_head_dim(i) != D:
        return layer_attention(c, i, attn, qkv)
    if arch.qk_norm:  # RMSNorm of q and k before rotary
        q, k, v = g.op("Split", [qkv, g.const("split", np.array([H * D, Hkv * D, Hkv * D], np.int64))], 3, axis=-1)
        q_norm, k_norm = getattr(attn, arch.q_norm), getattr(attn, arch.k_norm)
        if arch.qk_norm == "head":
            q, k = head_norm(c, q, q_norm, H, D), head_norm(c, k, k_norm, Hkv, D)
        else:  # over all heads (OLMo 2)
            q, k = c.rms(q, q_norm, "qk_norm"), c.rms(k, k_norm, "qk_norm")
        qkv_inputs = [q, k, v]
    else:
        qkv_inputs = [qkv, "", ""]  # packed q|k|v
    return c.ops.attention(g, c.cfg.kv_layer(i), qkv_inputs, c.call, c.shape, spec.rope, spec.window)


def _branch(c: _Ctx, layer: torch.nn.Module, post: str | None, out: str) -> str:
    """An attention or MLP output as added to the residual stream: post-norm, residual multiplier."""
    if post is not None:
        out = c.rms(out, module_at(layer, post), "post_norm")
    if c.cfg.residual_multiplier is not None:
        (out,) = c.g.op("Mul", [out, c.g.scalar("residual_multiplier", c.cfg.residual_multiplier)])
    return out


def _layer(c: _Ctx, i: int, layer: torch.nn.Module, stream: _Stream, h: str, lw: LayerWeights) -> None:
    """One decoder layer on h, its attention input [1, S, hidden] (the stream entering it, normed)."""
    arch, g = c.cfg.arch, c.g
    kind = c.cfg.layers[i].kind
    if kind == MLP:  # a block that is only an MLP (Nemotron-H)
        stream.add(_branch(c, layer, arch.mlp_post_norm, _mlp(c, h, lw)))
        return
    if kind == CONV:  # recurrent mixers: their states are sites state_sites(i), ... (feature recurrent_state)
        mixed = conv_mixer(c, c.cfg.state_sites(i), h, conv_weights(c.ws, module_at(layer, arch.conv), i))
    elif kind == MAMBA2:
        mw = mamba_weights(c.ws, module_at(layer, arch.mamba), i)
        mixed = mamba_mixer(c, c.cfg.state_sites(i), h, mw, c.cfg.mamba)
    elif kind == GDN:
        dw = deltanet_weights(c.ws, module_at(layer, arch.deltanet), i)
        mixed = deltanet_mixer(c, c.cfg.state_sites(i), h, dw, c.cfg.deltanet)
    elif kind == HYBRID:  # Falcon-H1: mamba(h) ssm_out + attention(h attn_in) attn_out
        mup = c.cfg.mup
        mw = mamba_weights(c.ws, module_at(layer, arch.mamba), i)
        ssm = _times(g, mamba_mixer(c, c.cfg.state_sites(i), h, mw, c.cfg.mamba), mup.ssm_out, "ssm_out")
        a = _attention(c, i, module_at(layer, arch.attn), _times(g, h, mup.attention_in, "attn_in"), lw)
        attn = _times(g, c.linear(a, lw.o, lw.o_b), mup.attention_out, "attn_out")
        (mixed,) = g.op("Add", [ssm, attn])
    else:
        attn = module_at(layer, arch.attn)
        a = _attention(c, i, attn, h, lw)
        if arch.attn_gate:  # Qwen3.5: a * sigmoid(gate(h)), the gate the per-head second half of q_proj
            gate = Linear(f"l{i}_attn_gate", (gated_rows(c.ws.part(attn.q_proj), c.cfg.heads, c.cfg.head_dim, 1),))
            (a,) = g.op("Mul", [a, g.op("Sigmoid", [c.linear(h, gate, None)])[0]])
        mixed = c.linear(a, lw.o, lw.o_b)
    stream.add(_branch(c, layer, arch.attn_post_norm, mixed))
    if arch.block == "single":  # the block ends with its mixer
        return
    h = stream.norm(module_at(layer, arch.mlp_norm)) if arch.mlp_norm else stream.value()
    stream.add(_branch(c, layer, arch.mlp_post_norm, _mlp(c, h, lw)))
    if c.per_layer is not None:  # Gemma 4: the layer's per-layer input gated in (per_layer_inputs.py)
        stream.add(per_layer_branch(c, i, layer, stream.value(), c.per_layer))
    scale = layer_scalar(c, layer)
    if scale is not None:  # x := x * scalar, after everything the layer added
        (stream.residual,) = g.op("Mul", [stream.value(), g.scalar("layer_scalar", scale)])


def _times(g: Graph, x: str, m: float, stem: str) -> str:
    """x times the constant m (x itself when m is 1)."""
    return x if m == 1.0 else g.op("Mul", [x, g.scalar(stem, m)])[0]


def _mlp(c: _Ctx, h: str, lw: LayerWeights) -> str:
    """The MLP of h [1, S, hidden]: down(act(gate(h)) * up(h)), or down(act(up(h))) ungated;
    Falcon-H1 scales the gate before its activation and the down projection's output."""
    g, mup = c.g, c.cfg.mup
    up = c.linear(h, lw.gate_up, lw.gate_up_b)  # [1, S, 2 I]: one weight stream per MLP input
    if lw.gated:
        inter = lw.gate_up.out_features // 2
        gate, up = g.op("Split", [up, g.const("split", np.array([inter, inter], np.int64))], 2, axis=-1)
        gate = _times(g, gate, mup.mlp_gate, "mlp_gate") if mup is not None else gate
        (hidden,) = g.op("Mul", [c.ops.activation(g, gate, c.cfg.activation), up])
    else:
        hidden = c.ops.activation(g, up, c.cfg.activation)
    out = c.linear(hidden, lw.down, lw.down_b)
    return _times(g, out, mup.mlp_down, "mlp_down") if mup is not None else out


def _paths(model: torch.nn.Module) -> dict[int, str]:
    """id(module) -> its path in the model (a parameter's Hugging Face name is path.attribute)."""
    return {id(m): n for n, m in model.named_modules(remove_duplicate=False)}


def attention_shape(model: torch.nn.Module, cfg: NormalizedConfig) -> AttentionShape:
    return AttentionShape(
        cfg.heads,
        cfg.kv_heads,
        cfg.head_dim,
        cfg.attn_scale,
        cfg.attn_softcap,
        rotary_inv_freq(model, cfg),
        cfg.rotary_dim,
        cfg.windows,
    )


def build_decoder(
    model: torch.nn.Module,
    out_dir: Path,
    max_context: int | None = None,
    *,
    kv_layout: str = contract.HEAD_MAJOR_INPLACE,
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
    """Write out_dir/model.onnx (+ data) in `kv_layout` for `model` (a loaded transformers model,
    or a streamed skeleton: streaming.open_streamed), reading one weight at a time from its source
    and appending it to the data file as it is written.

    weights: how weights are stored (default FloatWeights: the graph dtype). dtype: the graph's
    float dtype (default: the model's); weights are converted one at a time. tie_lm_head=False
    stores the output projection as its own [hidden, V] MatMul weight, which weight-only
    quantizers of drafts compress. min_rows: the manifest's min_rows for this graph (feature row_padding:
    the runtime pads calls). pad_attention (fused): every GroupQueryAttention gets one row more
    than the call, a copy of its last row (row_padding's cache_pad 1): ONNX Runtime's
    GroupQueryAttention computes a 1-row call on another path than calls of 2 or more rows, while
    its MatMuls are row-invariant, so this keeps every row independent of its call's size without
    a padded MatMul; the copy's K/V land at cache row P + S, which the next call overwrites.
    feature_layers: indices i of the residual streams entering decoder layer i (transformers'
    output_hidden_states[i], 0 <= i < layers; i = layers: the stream after the final norm, what a
    Gemma 4 assistant reads) returned as `hidden_states` [1, S, F] float32 for every input row
    (what an EAGLE-3 head reads). norm: the model's normalized
    config (default: normalized from model.config). slots: K > 1 cache slots, rows packed slot
    after slot (features cache_slots, idle_slots). tree: the tree-verify graph (tree_verify):
    position_ids and tree_bias inputs, one slot, unpadded. table_rows (fused): rows of the
    rotary tables (default max_context + min_rows - 1 + pad); a graph that shares another's
    weights file takes that graph's. on_layer(i, n): called once layer i of n is written."""
    ops = ops_for(kv_layout)
    if max_context is None and table_rows is None and ops.layout.contrib_attention:
        raise UnsupportedConfig("the fused layout needs max_context (its rotary tables' rows)")
    weights = weights or FloatWeights()
    pad = 1 if pad_attention else 0
    start = time.perf_counter()
    cfg = norm or normalize(model.config, max_context)
    check_hf_modules(model, cfg)
    problem = fused_refusal(cfg) if ops.layout.contrib_attention else None
    if problem:
        raise UnsupportedConfig(problem)
    if pad and not ops.pads_attention:
        raise UnsupportedConfig(f"padded attention (cache_pad) needs the fused layout, not {kv_layout!r}")
    dtype = dtype or next(model.parameters()).dtype
    if dtype not in ONNX_DTYPE:
        raise UnsupportedConfig(f"dtype {dtype} is not supported (float32 or float16)")
    base = module_at(model, cfg.arch.decoder)
    layers = module_at(base, cfg.arch.layers)
    V = module_at(base, cfg.arch.embed).weight.shape[0]  # embedding [V, hidden]
    if slots < 1 or (slots > 1 and (feature_layers or tree)):
        raise UnsupportedConfig(
            f"slots must be >= 1; a tree graph has one slot and a batch graph no features; got {slots}"
        )
    if tree and (pad or min_rows > 1):
        raise UnsupportedConfig(f"a tree graph has unpadded rows; got cache_pad {pad}, min_rows {min_rows}")
    bad = [i for i in feature_layers if not 0 <= i <= len(layers)]
    if bad:
        raise UnsupportedConfig(f"feature layers {bad} are outside the target's 0..{len(layers)}")
    if cfg.state_shapes and tree:
        raise UnsupportedConfig(
            f"{cfg.family}: recurrent layers carry no state through tree graphs in contract"
            f" {contract.RECURRENT_SLOTS_VERSION}; build it with chain drafts"
        )
    spec = GraphSpec(
        len(cfg.attention_layers),
        cfg.kv_heads,
        cfg.head_dim,
        V,
        "float32" if dtype == torch.float32 else "float16",
        kv_layout=kv_layout,
        feature_width=len(feature_layers) * cfg.hidden,
        windows=cfg.windows if ops.layout.window_version else (),
        slots=slots,
        tree=tree,
        states=cfg.state_shapes,
    )
    g = Graph(dtype, data=DataFile(out_dir))
    try:
        ws = Weights(source_of(model), _paths(model))
        shape = attention_shape(model, cfg)
        rows = table_rows or (max_context or 0) + min_rows - 1 + pad
        call = ops.prepare(g, shape, slots, tree, pad=bool(pad), table_rows=rows)
        rows_of = slot_rows(g, slots, pad=False) if spec.states and slots > 1 else None
        c = _Ctx(g, ops, cfg, shape, call, weights, ws, slots=slots, slot_rows=rows_of)
        features = _write(c, model, base, layers, feature_layers, tie_lm_head, on_layer)
        inputs, outputs = state_interface(spec, *ops.interface(spec, g.elem, features))
        padded = pad or min_rows > 1 or feature_layers
        version = contract.version_for(
            kv_layout, 2 if padded else 1, windowed=bool(spec.windows), slots=slots, tree=tree, states=bool(spec.states)
        )
        return save_graph(g, "specexport_decoder", inputs, outputs, spec, version, out_dir, start)
    finally:
        if g.data is not None:
            g.data.close()


def _write(c: _Ctx, model, base, layers, feature_layers, tie_lm_head: bool, on_layer) -> bool:
    """Every node from the embedding to the logits; True when `hidden_states` is an output."""
    g, cfg, arch, ws = c.g, c.cfg, c.cfg.arch, c.ws
    embed_module = module_at(base, arch.embed)
    x, table = c.weights.embedding(g, contract.INPUT_IDS, Linear("embed", (ws.part(embed_module),)))
    if arch.embed_scale:  # [1, S, hidden]
        scale = getattr(embed_module, "embed_scale", None)
        (x,) = g.op("Mul", [x, g.scalar("embed_scale", float(scale) if scale is not None else cfg.hidden**0.5)])
    if cfg.embedding_multiplier is not None:
        (x,) = g.op("Mul", [x, g.scalar("embedding_multiplier", cfg.embedding_multiplier)])
    if arch.positions == "learned":  # x + position_embedding(positions) (GPT-2)
        wpe = g.weight("wpe", ws.of(module_at(base, arch.position_embed)))
        (x,) = g.op("Add", [x, g.op("Gather", [wpe, c.call.positions])[0]])

    if cfg.per_layer_input:
        c = replace(c, per_layer=per_layer_inputs(c, base, x))
    stream = _Stream(g, c.ops, x, arch.norm_offset, ws)
    entering: dict[int, str] = {}  # layer i -> the residual stream entering it [1, S, hidden]
    for i, layer in enumerate(layers):
        h = stream.norm(module_at(layer, arch.attn_norm)) if arch.attn_norm else stream.value()
        entering[i] = stream.residual  # the norm (or value()) has just folded the pending addend into it
        _layer(c, i, layer, stream, h, layer_weights(layer, arch, cfg, ws, i))
        if on_layer is not None:
            on_layer(i, len(layers))

    if len(layers) in feature_layers:  # the final norm over every row (output_hidden_states[L])
        entering[len(layers)] = c.rms(stream.value(), module_at(base, arch.final_norm), "final_norm")
    features = None
    if feature_layers:  # [1, S, F]: low | mid | high, float32 like the logits
        (features,) = g.op("Concat", [entering[i] for i in feature_layers], axis=-1)
        if g.dtype != torch.float32:
            (features,) = g.op("Cast", [features], to=TensorProto.FLOAT)
    _logits(c, model, stream, base, table if tie_lm_head else None)
    if features is not None:
        g.op("Identity", [features], [contract.HIDDEN_STATES])
    return features is not None


def _logits(c: _Ctx, model, stream: _Stream, base, table: str | None) -> None:
    """Logits only for the requested rows: gather, final norm, output projection, Granite's
    divisor and Gemma 2's softcap (in the model dtype, as transformers), then float32."""
    g, cfg, ws = c.g, c.cfg, c.ws
    pending = stream.pending and g.op("Gather", [stream.pending, contract.LOGITS_INDEX], axis=1)[0]  # [1, R, hidden]
    (res_rows,) = g.op("Gather", [stream.residual, contract.LOGITS_INDEX], axis=1)
    stream.residual, stream.pending = res_rows, pending
    h = stream.norm(module_at(base, cfg.arch.final_norm))  # [1, R, hidden]
    (h2,) = g.op("Squeeze", [h, g.const("axes", np.array([0], np.int64))])  # [R, hidden]
    head = model.get_output_embeddings()
    embed = module_at(base, cfg.arch.embed)
    tied = table is not None and ws.name(head) == ws.name(embed)
    logits = c.weights.head(g, h2, Linear("lm_head", (ws.part(head),)), table if tied else None)
    if getattr(head, "bias", None) is not None:
        (logits,) = g.op("Add", [logits, g.weight("lm_b", ws.bias(head))])
    if cfg.logits_divisor is not None:
        (logits,) = g.op("Div", [logits, g.scalar("logits_scaling", cfg.logits_divisor)])
    if cfg.mup is not None and cfg.mup.logits != 1.0:  # Falcon-H1: lm_head(h) times lm_head_multiplier
        (logits,) = g.op("Mul", [logits, g.scalar("lm_head_multiplier", cfg.mup.logits)])
    if cfg.final_softcap is not None:
        logits = softcap(g, logits, cfg.final_softcap)
    if g.dtype != torch.float32:
        (logits,) = g.op("Cast", [logits], to=TensorProto.FLOAT)
    g.op("Unsqueeze", [logits, g.const("axes", np.array([0], np.int64))], [contract.LOGITS])
