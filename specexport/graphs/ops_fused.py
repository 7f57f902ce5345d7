"""The fused operators: the decoder writer's (decoder_graph.py) attention, norms and activations
as ONNX Runtime contrib ops, for the `head_major_inplace` layout (docs/graph-contract.md).

Attention is one com.microsoft GroupQueryAttention node per layer (and slot, fused_slots.py) that
applies rotary itself from cos/sin tables [T_max, rotary_dim / 2] (one per rope key; none on a
NoPE layer), honours the layer's window and softcap and writes the new K/V in place into a
[1, H_kv, T_max, D] buffer bound as both past and present; norms are SimplifiedLayerNormalization
and SkipSimplifiedLayerNormalization (the residual add rides along). About 11 nodes per layer
instead of ~33 in the portable form: on a CPU, and more so for a quantized draft, per-node
overhead rivals the matrix work (docs/performance.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specexport_runtime import contract

from ..models.config import UnsupportedConfig
from . import fused_slots
from .ops_portable import PortableOps
from .writer import MS, AttentionShape, Graph, activation


@dataclass(frozen=True)
class FusedCall:
    caches: dict[str, tuple[str, str]]  # rope key -> (cos, sin) tables [rows, rotary_dim / 2]
    at: fused_slots.Layout  # each slot's attention rows and cursor
    tree: fused_slots.TreeInputs  # a tree graph's positions and biases per window; {} otherwise


class FusedOps:
    """Operators of the head_major_inplace layout (GroupQueryAttention, contrib norms)."""

    layout = contract.LAYOUTS[contract.HEAD_MAJOR_INPLACE]
    pads_attention = True

    def norm(self, g: Graph, x: str, weight: str, eps: float, bias: str | None = None) -> str:
        if bias is not None:
            raise UnsupportedConfig("LayerNorm with a bias (learned-position families) needs graph: portable")
        return g.op("SimplifiedLayerNormalization", [x, weight], axis=-1, epsilon=eps, stash_type=1)[0]

    def add_norm(self, g: Graph, addend: str, residual: str, weight: str, eps: float, bias: str | None = None):
        """(norm(residual + addend), residual + addend) in one SkipSimplifiedLayerNormalization."""
        if bias is not None:
            raise UnsupportedConfig("LayerNorm with a bias (learned-position families) needs graph: portable")
        h, _, _, total = g.op("SkipSimplifiedLayerNormalization", [addend, residual, weight], 4, domain=MS, epsilon=eps)
        return h, total

    def activation(self, g: Graph, x: str, act: str) -> str:
        return activation(g, x, act)

    def prepare(
        self,
        g: Graph,
        shape: AttentionShape,
        slots: int,
        tree: bool,
        pad: bool = False,
        table_rows: int = 0,
        span: bool = False,
    ) -> FusedCall:
        """Rotary tables of table_rows positions, computed as transformers does (fp32 product, then
        cos/sin, times the rope's attention scaling); each slot's rows and cursor; a tree graph's
        inputs (span: a head's tree bias over the last M cache rows, feature eagle3_head_tree)."""
        caches = {}
        pos = torch.arange(table_rows, dtype=torch.float32)
        for key, (inv_freq, scale) in shape.ropes.items():
            freqs = (inv_freq[:, None] @ pos[None, :]).t()  # [T_max, rot/2], fp32 like transformers
            cos, sin = (freqs.cos() * scale).numpy(), (freqs.sin() * scale).numpy()
            caches[key] = (g.const("cos_cache", cos.astype(g.np_dtype)), g.const("sin_cache", sin.astype(g.np_dtype)))
        at = fused_slots.layout(g, slots, pad)
        if not tree:
            trees: fused_slots.TreeInputs = {}
        elif span:
            trees = {None: fused_slots.tree_inputs(g, g.elem, span=True)}
        else:
            trees = fused_slots.tree_inputs_by_window(g, g.elem, shape.windows)
        return FusedCall(caches, at, trees)

    def attention(
        self,
        g: Graph,
        layer: int,
        qkv: list[str],
        call: FusedCall,
        shape: AttentionShape,
        rope,
        window,
        shared: bool = False,
    ) -> str:
        """qkv: [packed q|k|v, "", ""] or [q, k, v], each [1, N, C] -> [1, N, H D], K/V in place.
        shared: [q, k, v] with the k, v that layer `layer`'s owner has just written; its cache is
        read, not written (fused_slots.attention)."""
        attrs = dict(
            num_heads=shape.heads,
            kv_num_heads=shape.kv_heads,
            scale=shape.scale,
            do_rotary=int(rope is not None),
            rotary_interleaved=0,
        )
        if window is not None and not call.tree:  # a query sees the `window` most recent keys, its own
            attrs["local_window_size"] = window  # included (as transformers); a tree graph's bias holds it
        if shape.softcap is not None:
            attrs["softcap"] = shape.softcap
        rotary = list(call.caches[rope]) if rope is not None else []
        tree = call.tree.get(window, []) if call.tree else []
        return fused_slots.attention(g, layer, qkv, call.at, rotary, attrs, tree, shared)

    def interface(self, spec, elem: int, features: bool) -> tuple[list, list]:
        return fused_slots.interface(spec, elem, features)


def ops_for(kv_layout: str):
    """The operators that write graphs of `kv_layout`."""
    return {contract.HEAD_MAJOR_INPLACE: FusedOps, contract.TIME_MAJOR: PortableOps}[kv_layout]()
