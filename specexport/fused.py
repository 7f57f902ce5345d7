"""The fused graph: the same decoder written directly as ONNX with ONNX Runtime contrib ops.

Layout `head_major_inplace` of the graph contract (docs/graph-contract.md, contract 1.1):
attention is one com.microsoft GroupQueryAttention node per layer that applies rotary itself
and writes the new K/V in place into a [1, H_kv, T_max, D] buffer shared by its past and
present bindings; norms are SimplifiedLayerNormalization / SkipSimplifiedLayerNormalization
(the residual add rides along). About 11 nodes per layer instead of ~33 in the portable graph:
on a CPU, and more so for a quantized draft, per-node overhead rivals the matrix work
(docs/performance.md).

The graph is built from the Hugging Face modules' weights with onnx.helper (no tracing). It
reproduces the same families as the portable decoder except learned positions (GPT-2): the
ArchSpec table says where each weight lives; the numerics are checked against transformers
by validate.py exactly like the portable graph.

    input_ids              int64    [1, S]
    logits_index           int64    [R]
    seqlens_k              int32    [1]                  P + S - 1 (index of the last token)
    total_sequence_length  int32    []                   P + S
    past_key_{i}           kv_dtype [1, H_kv, T_max, D]  the whole buffer; rows >= P are ignored
    past_value_{i}         kv_dtype [1, H_kv, T_max, D]
 -> logits                 float32  [1, R, V]
    present_key_{i}        kv_dtype [1, H_kv, T_max, D]  the same buffer (bound to the same memory)
    present_value_{i}      kv_dtype [1, H_kv, T_max, D]
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from specexport_runtime import contract
from specexport_runtime.contract import GraphSpec

from .architectures import ArchSpec, arch_for
from .decoder import STATIC_ROPE_TYPES, UnsupportedConfig, _get
from .export import DATA_NAME, GRAPH_NAME, ExportResult

OPSET = 17
MS = "com.microsoft"
_ONNX_DTYPE = {torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16}
_NP_DTYPE = {torch.float32: np.float32, torch.float16: np.float16}
# hidden_act -> how the gate is activated (one or two nodes)
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu_new", "gelu")


def fused_supported(model_type: str) -> bool:
    """Families the fused builder reproduces (rotary positions); GPT-2 stays portable."""
    return arch_for(model_type).positions == "rope"


@dataclass
class _Graph:
    """A tiny ONNX graph writer: unique names, initializers from numpy."""

    dtype: torch.dtype
    nodes: list = field(default_factory=list)
    inits: list = field(default_factory=list)
    _n: int = 0

    def name(self, stem: str) -> str:
        self._n += 1
        return f"{stem}_{self._n}"

    def const(self, stem: str, array: np.ndarray) -> str:
        name = self.name(stem)
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    @property
    def np_dtype(self) -> type:
        """numpy dtype of the graph's float tensors (activations, scales)."""
        return _NP_DTYPE[self.dtype]

    def weight(self, stem: str, tensor: torch.Tensor) -> str:
        """A weight in the graph dtype."""
        return self.const(stem, tensor.detach().to(self.dtype).cpu().numpy())

    def op(self, op_type: str, inputs: list[str], outputs: int | list[str] = 1, domain: str = "", **attrs) -> list[str]:
        names = [self.name(op_type) for _ in range(outputs)] if isinstance(outputs, int) else outputs
        self.nodes.append(helper.make_node(op_type, inputs, names, name=self.name(f"n_{op_type}"), domain=domain or None, **attrs))
        return names


def _norm_weight(module: torch.nn.Module, offset: float) -> tuple[torch.Tensor, float]:
    eps = getattr(module, "variance_epsilon", None)
    if eps is None:
        eps = getattr(module, "eps", None)
    if eps is None or getattr(module, "weight", None) is None:
        raise UnsupportedConfig(f"norm module {type(module).__name__} has no weight/eps the fused graph can use")
    return module.weight.detach().float() + offset, float(eps)


def _rotary_tables(model: torch.nn.Module, arch: ArchSpec, head_dim: int, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin caches [T_max, D/2] computed as transformers does (fp32 product, then cos/sin)."""
    config = model.config
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") not in STATIC_ROPE_TYPES:
        raise UnsupportedConfig(f"rope_type {rope.get('rope_type')!r} is not supported; supported: {', '.join(STATIC_ROPE_TYPES)}")
    rotary = _get(_get(model, arch.decoder), "rotary_emb")
    inv_freq = rotary.inv_freq.detach().float()  # [rot/2]
    if 2 * inv_freq.shape[0] != head_dim:
        raise UnsupportedConfig(f"partial rotary ({2 * inv_freq.shape[0]} of {head_dim} dims) is not supported by the fused graph")
    pos = torch.arange(max_positions, dtype=torch.float32)
    freqs = (inv_freq[:, None] @ pos[None, :]).t()  # [T_max, D/2], fp32 like transformers
    scale = float(rotary.attention_scaling)
    return (freqs.cos() * scale).numpy(), (freqs.sin() * scale).numpy()


@dataclass(frozen=True)
class Linear:
    """One weight of the graph: `parts` stacked along the output dimension (q|k|v, gate|up)."""

    stem: str  # initializer name stem, e.g. "l3_qkv"
    parts: tuple[tuple[str, torch.Tensor], ...]  # (Hugging Face parameter name, weight [N_i, K])

    @property
    def out_features(self) -> int:
        return sum(w.shape[0] for _, w in self.parts)


class WeightPlan(Protocol):
    """How the graph stores its weights: float MatMuls (FloatWeights) or block-quantized
    MatMulNBits (quantized_target.QuantizedWeights)."""

    def linear(self, g: "_Graph", x: str, site: Linear) -> str:
        """x [1, S, K] -> [1, S, N]."""

    def embedding(self, g: "_Graph", ids: str, site: Linear) -> tuple[str, str | None]:
        """ids [1, S] -> ([1, S, hidden], the float table's initializer name or None); `site`
        holds the table [V, hidden]."""

    def head(self, g: "_Graph", h: str, site: Linear, table: str | None) -> str:
        """h [R, hidden] -> logits [R, V]; `table`: the float embedding initializer when the head
        is tied to it (a plan may share it), else None."""


class FloatWeights:
    """Weights in the graph dtype: MatMul [K, N] per linear; a tied head is a Gemm on the
    embedding table itself (stored once); an untied head its own [hidden, V] MatMul weight,
    which weight-only quantizers of drafts compress (quantize.py)."""

    def linear(self, g: "_Graph", x: str, site: Linear) -> str:
        w = torch.cat([w.detach() for _, w in site.parts], 0)  # [N, K]
        return g.op("MatMul", [x, g.weight(site.stem, w.t())])[0]

    def embedding(self, g: "_Graph", ids: str, site: Linear) -> tuple[str, str | None]:
        table = g.weight(site.stem, site.parts[0][1])
        return g.op("Gather", [table, ids])[0], table

    def head(self, g: "_Graph", h: str, site: Linear, table: str | None) -> str:
        if table is not None:  # Gemm transB on the embedding itself: the tied matrix is stored once
            return g.op("Gemm", [h, table], transB=1)[0]
        return self.linear(g, h, site)


def _names(model: torch.nn.Module) -> dict[int, str]:
    """id(parameter) -> its Hugging Face name (the first name of a tied parameter)."""
    return {id(p): n for n, p in model.named_parameters()}


def _layer_weights(layer: torch.nn.Module, arch: ArchSpec, H: int, Hkv: int, D: int, names: dict[int, str], i: int):
    """-> Linear sites qkv [(H + 2 H_kv) D, hidden] (+ bias), o, gate|up [2 I, hidden], down."""
    attn, mlp = _get(layer, arch.attn), _get(layer, arch.mlp)
    part = lambda m: (names[id(m.weight)], m.weight)  # noqa: E731
    if arch.qkv == "separate":
        mods = (attn.q_proj, attn.k_proj, attn.v_proj)
        qkv = Linear(f"l{i}_qkv", tuple(part(m) for m in mods))
        b = None
        if any(m.bias is not None for m in mods):
            b = torch.cat([m.bias.detach() if m.bias is not None else torch.zeros(m.weight.shape[0]) for m in mods])
    elif arch.qkv == "fused":
        qkv, b = Linear(f"l{i}_qkv", (part(attn.qkv_proj),)), getattr(attn.qkv_proj, "bias", None)
    else:
        raise UnsupportedConfig(f"qkv kind {arch.qkv!r} is not supported by the fused graph")
    if qkv.out_features != (H + 2 * Hkv) * D:
        raise UnsupportedConfig(f"q|k|v rows {qkv.out_features} != (H + 2 H_kv) D = {(H + 2 * Hkv) * D}")
    out = getattr(attn, arch.out_proj)
    if getattr(out, "bias", None) is not None:
        raise UnsupportedConfig("an output projection with bias is not supported by the fused graph")
    if arch.mlp_kind == "gated":
        if mlp.gate_proj.bias is not None or mlp.up_proj.bias is not None:
            raise UnsupportedConfig("gated MLP projections with bias are not supported")
        gate_up = Linear(f"l{i}_gate_up", (part(mlp.gate_proj), part(mlp.up_proj)))
    elif arch.mlp_kind == "fused_gated":  # rows [gate; up] already
        gate_up = Linear(f"l{i}_gate_up", (part(mlp.gate_up_proj),))
    else:
        raise UnsupportedConfig(f"mlp kind {arch.mlp_kind!r} is not supported by the fused graph")
    return (qkv, None if b is None else b.detach(), Linear(f"l{i}_o", (part(out),)), gate_up,
            Linear(f"l{i}_down", (part(mlp.down_proj),)))


def build_fused(model: torch.nn.Module, out_dir: Path, max_context: int, *, tie_lm_head: bool = True,
                weights: WeightPlan | None = None, min_rows: int = 1, pad_attention: bool = False,
                feature_layers: tuple[int, ...] = ()) -> ExportResult:
    """Write out_dir/model.onnx (+ data) in the head_major_inplace layout for `model`.

    weights: how weights are stored (default FloatWeights: the model's dtype). min_rows: the
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
    input row (contract 1.2: what an EAGLE-3 draft head reads)."""
    weights = weights or FloatWeights()
    pad = 1 if pad_attention else 0
    start = time.perf_counter()
    config = model.config
    arch = arch_for(config.model_type)
    if not fused_supported(config.model_type):
        raise UnsupportedConfig(f"architecture {config.model_type!r} has learned positions; use graph: portable")
    dtype = next(model.parameters()).dtype
    if dtype not in _ONNX_DTYPE:
        raise UnsupportedConfig(f"dtype {dtype} is not supported (float32 or float16)")
    act = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None)
    if act not in ACTIVATIONS:
        raise UnsupportedConfig(f"activation {act!r} is not supported by the fused graph; supported: {', '.join(ACTIVATIONS)}")
    base = _get(model, arch.decoder)
    layers = _get(base, arch.layers)
    H = config.num_attention_heads
    Hkv = getattr(config, "num_key_value_heads", None) or H
    D = getattr(config, "head_dim", None) or config.hidden_size // H
    V = _get(base, arch.embed).weight.shape[0]  # embedding [V, hidden]
    bad = [i for i in feature_layers if not 0 <= i < len(layers)]
    if bad:
        raise UnsupportedConfig(f"feature layers {bad} are outside the target's 0..{len(layers) - 1}")
    spec = GraphSpec(len(layers), Hkv, D, V, "float32" if dtype == torch.float32 else "float16",
                     kv_layout=contract.HEAD_MAJOR_INPLACE, feature_width=len(feature_layers) * config.hidden_size)
    scales = {float(getattr(_get(l, arch.attn), "scaling", D**-0.5)) for l in layers}
    if len(scales) != 1:
        raise UnsupportedConfig(f"per-layer attention scales {sorted(scales)} are not supported")
    attn_scale = scales.pop()
    window = int(config.sliding_window) if arch.sliding_window and getattr(config, "sliding_window", None) else None

    g = _Graph(dtype)
    elem = _ONNX_DTYPE[dtype]
    cos, sin = _rotary_tables(model, arch, D, max_context + min_rows - 1 + pad)
    cos_name, sin_name = g.const("cos_cache", cos.astype(_NP_DTYPE[dtype])), g.const("sin_cache", sin.astype(_NP_DTYPE[dtype]))
    names = _names(model)
    embed_module = _get(base, arch.embed)
    embed_site = Linear("embed", ((names[id(embed_module.weight)], embed_module.weight),))
    x, table = weights.embedding(g, contract.INPUT_IDS, embed_site)  # [1, S, hidden]
    if arch.embed_scale:
        scale = getattr(_get(base, arch.embed), "embed_scale", None)
        value = float(scale) if scale is not None else config.hidden_size**0.5
        (x,) = g.op("Mul", [x, g.const("embed_scale", np.array(value, _NP_DTYPE[dtype]))])
    offset = arch.norm_offset

    seqlens, total = contract.SEQLENS_K, contract.TOTAL_SEQUENCE_LENGTH
    if pad:  # the attention sees S + 1 rows: its cursor inputs grow by one
        (seqlens,) = g.op("Add", [seqlens, g.const("one", np.array([1], np.int32))])
        (total,) = g.op("Add", [total, g.const("one", np.array(1, np.int32))])
    residual = x  # running sum of the residual stream; `pending` is the next addend
    pending: str | None = None

    def norm(module: torch.nn.Module) -> str:
        nonlocal residual, pending
        w, eps = _norm_weight(module, offset)
        if pending is None:
            (h,) = g.op("SimplifiedLayerNormalization", [residual, g.weight("norm", w)], axis=-1, epsilon=eps, stash_type=1)
        else:  # residual := residual + pending, then norm: one node
            h, _, _, residual = g.op("SkipSimplifiedLayerNormalization", [pending, residual, g.weight("norm", w)],
                                     4, domain=MS, epsilon=eps)
            pending = None
        return h

    entering: dict[int, str] = {}  # layer i -> the residual stream entering it [1, S, hidden]
    for i, layer in enumerate(layers):
        attn = _get(layer, arch.attn)
        qkv_site, qkv_b, o_site, gate_up_site, down_site = _layer_weights(layer, arch, H, Hkv, D, names, i)
        h = norm(_get(layer, arch.attn_norm))
        entering[i] = residual  # norm() has just folded the pending addend into it
        qkv = weights.linear(g, h, qkv_site)  # [1, S, (H + 2 H_kv) D]
        if qkv_b is not None:
            (qkv,) = g.op("Add", [qkv, g.weight(f"l{i}_qkv_b", qkv_b)])
        if arch.qk_norm:  # Qwen3: per-head RMSNorm of q and k (before rotary, which GQA applies)
            q, k, v = g.op("Split", [qkv, g.const("split", np.array([H * D, Hkv * D, Hkv * D], np.int64))], 3, axis=-1)
            q = _head_norm(g, q, attn.q_norm, H, D)
            k = _head_norm(g, k, attn.k_norm, Hkv, D)
            qkv_inputs = [q, k, v]
        else:
            qkv_inputs = [qkv, "", ""]  # packed q|k|v
        if pad:  # [1, S, C] -> [1, S + 1, C]: the last row again
            qkv_inputs = [_append_last_row(g, t) if t else t for t in qkv_inputs]
        gqa_attrs = dict(num_heads=H, kv_num_heads=Hkv, scale=attn_scale, do_rotary=1, rotary_interleaved=0)
        if window is not None:
            # a query sees the `window` most recent keys including its own, as in transformers
            # (the parity test's Mistral window is shorter than its sequences)
            gqa_attrs["local_window_size"] = window
        a, _, _ = g.op(
            "GroupQueryAttention",
            [*qkv_inputs, contract.past_key(i), contract.past_value(i), seqlens, total, cos_name, sin_name],
            [g.name("attn"), contract.present_key(i), contract.present_value(i)],
            domain=MS,
            **gqa_attrs,
        )  # a: [1, S (+ 1 with pad), H D]
        if pad:
            (a,) = g.op("Slice", [a, g.const("start", np.array([0], np.int64)), g.const("end", np.array([-1], np.int64)),
                                  g.const("axis", np.array([1], np.int64))])  # [1, S, H D]
        pending = weights.linear(g, a, o_site)
        h = norm(_get(layer, arch.mlp_norm))
        inter = gate_up_site.out_features // 2
        gate_up = weights.linear(g, h, gate_up_site)  # [1, S, 2 I]: one weight stream per MLP input
        gate, up = g.op("Split", [gate_up, g.const("split", np.array([inter, inter], np.int64))], 2, axis=-1)
        (hidden,) = g.op("Mul", [_activation(g, gate, act), up])
        pending = weights.linear(g, hidden, down_site)

    features = None
    if feature_layers:  # [1, S, F]: low | mid | high, float32 like the logits
        (features,) = g.op("Concat", [entering[i] for i in feature_layers], axis=-1)
        if dtype != torch.float32:
            (features,) = g.op("Cast", [features], to=TensorProto.FLOAT)
    # logits only for the requested rows: gather, final norm, output projection
    (rows,) = g.op("Gather", [pending, contract.LOGITS_INDEX], axis=1)  # [1, R, hidden]
    (res_rows,) = g.op("Gather", [residual, contract.LOGITS_INDEX], axis=1)
    residual, pending = res_rows, rows
    h = norm(_get(base, arch.final_norm))  # [1, R, hidden]
    (h2,) = g.op("Squeeze", [h, g.const("axes", np.array([0], np.int64))])  # [R, hidden]
    head = model.get_output_embeddings()
    bias = getattr(head, "bias", None)
    tied = tie_lm_head and head.weight.data_ptr() == embed_module.weight.data_ptr()
    head_site = Linear("lm_head", ((names[id(head.weight)], head.weight),))
    logits = weights.head(g, h2, head_site, table if tied else None)  # [R, V]
    if bias is not None:
        (logits,) = g.op("Add", [logits, g.weight("lm_b", bias)])
    if dtype != torch.float32:
        (logits,) = g.op("Cast", [logits], to=TensorProto.FLOAT)
    g.op("Unsqueeze", [logits, g.const("axes", np.array([0], np.int64))], [contract.LOGITS])
    if features is not None:
        g.op("Identity", [features], [contract.HIDDEN_STATES])

    cache = [1, Hkv, "cache_rows", D]  # the runtime binds T_max = max_context + min_rows - 1 rows (in place)
    inputs = [
        helper.make_tensor_value_info(contract.INPUT_IDS, TensorProto.INT64, [1, "seq"]),
        helper.make_tensor_value_info(contract.LOGITS_INDEX, TensorProto.INT64, ["rows"]),
        helper.make_tensor_value_info(contract.SEQLENS_K, TensorProto.INT32, [1]),
        helper.make_tensor_value_info(contract.TOTAL_SEQUENCE_LENGTH, TensorProto.INT32, []),
    ]
    outputs = [helper.make_tensor_value_info(contract.LOGITS, TensorProto.FLOAT, [1, "rows", V])]
    if features is not None:
        outputs.append(helper.make_tensor_value_info(contract.HIDDEN_STATES, TensorProto.FLOAT, [1, "seq", spec.feature_width]))
    for i in range(spec.num_layers):
        inputs += [helper.make_tensor_value_info(n, elem, cache) for n in (contract.past_key(i), contract.past_value(i))]
        outputs += [helper.make_tensor_value_info(n, elem, cache) for n in (contract.present_key(i), contract.present_value(i))]
    # the contract's input/output order (GraphSpec), which the runtime checks by name
    order_in = {n: k for k, n in enumerate(spec.input_names())}
    order_out = {n: k for k, n in enumerate(spec.output_names())}
    inputs.sort(key=lambda v: order_in[v.name])
    outputs.sort(key=lambda v: order_out[v.name])
    padded = pad or min_rows > 1 or feature_layers
    return save_graph(g, "specexport_fused", inputs, outputs, spec, contract.ROW_PADDING_VERSION if padded else None,
                      out_dir, start)


def save_graph(g: _Graph, name: str, inputs: list, outputs: list, spec: GraphSpec, version: str | None,
               out_dir: Path, start: float) -> ExportResult:
    """Write g's nodes as out_dir/model.onnx with external data (model.onnx.data), its contract
    metadata (`version`: the contract minor the graph needs, None for the layout's own)."""
    graph = helper.make_graph(g.nodes, name, inputs, outputs, g.inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS, 1)],
                              producer_name="specexport")
    proto.ir_version = 8
    helper.set_model_props(proto, contract.graph_metadata(spec.kv_layout, version))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / DATA_NAME).unlink(missing_ok=True)
    path = out_dir / GRAPH_NAME
    onnx.save_model(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=DATA_NAME,
                    size_threshold=1024)
    size = path.stat().st_size + (out_dir / DATA_NAME).stat().st_size
    return ExportResult(path, spec, time.perf_counter() - start, len(g.nodes), size)


def _append_last_row(g: _Graph, x: str) -> str:
    """x [1, S, C] -> [1, S + 1, C], the last row repeated (one Pad node, edge mode)."""
    return g.op("Pad", [x, g.const("pads", np.array([0, 0, 0, 0, 1, 0], np.int64))], mode="edge")[0]


def _head_norm(g: _Graph, x: str, module: torch.nn.Module, heads: int, D: int) -> str:
    """RMSNorm over head_dim of x [1, S, heads D] -> [1, S, heads D]."""
    w, eps = _norm_weight(module, 0.0)
    (y,) = g.op("Reshape", [x, g.const("shape", np.array([1, -1, heads, D], np.int64))])
    (y,) = g.op("SimplifiedLayerNormalization", [y, g.weight("head_norm", w)], axis=-1, epsilon=eps, stash_type=1)
    (y,) = g.op("Reshape", [y, g.const("shape", np.array([1, -1, heads * D], np.int64))])
    return y


def _activation(g: _Graph, x: str, act: str) -> str:
    if act == "silu":  # x * sigmoid(x); ONNX Runtime fuses the pair
        (s,) = g.op("Sigmoid", [x])
        return g.op("Mul", [x, s])[0]
    if act in ("gelu_pytorch_tanh", "gelu_new"):
        return g.op("FastGelu", [x], domain=MS)[0]
    return g.op("Gelu", [x], domain=MS)[0]  # exact (erf) GELU

