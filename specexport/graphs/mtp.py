"""A checkpoint's own MTP layer as one ONNX graph in either KV layout (feature mtp_head, kind mtp;
docs/graph-contract.md "MTP heads"), written with the decoder's own layer writer so its one
decoder layer is exactly the target family's (Qwen3.5: gated attention, q/k norms, partial
rotary, (1 + w) norms). Its model is models/mtp.mtp_model: a 1-layer skeleton reading the
target's embedding and head and the checkpoint's `mtp.*` tensors.

Per row (h = features + draft_hidden: the caller zeroes the side it does not use, exact):

    x      = fc([pre_fc_norm_embedding(embed(id)), pre_fc_norm_hidden(h)])    [1, S, H]
    y      = layer 0 (x)                                own cache, positions from the cursor
    out    = norm(y[rows])                                                    [1, R, H]
    logits = lm_head(out)                                                     [1, R, V]

    input_ids     int64    [1, S]      the token paired with each row (row t: position t, token t + 1)
    features      float32  [1, S, H]   the target's hidden_states rows (its final-normed stream)
    draft_hidden  float32  [1, S, H]   the graph's own earlier hidden_out rows
    logits_index  int64    [R]
    the layout's cursor and one layer's cache inputs (as a 1-layer decoder of that layout)
 -> logits        float32  [1, R, V]
    hidden_out    float32  [1, R, H]   `out`: the next chained step's draft_hidden
    the layout's K/V outputs for layer 0

The tree graph (tree=True, fused only; feature eagle3_head_tree, as an EAGLE-3 head's) has two more
inputs after the cursor inputs: position_ids [1, S] (each row's rotary position) and tree_bias
[S, M] (additive, over the last M cache rows, the call's S rows last), so each row of a draft
tree's depth attends to the head's past and to its own ancestors among the round's rows.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
from onnx import helper

from specexport_runtime import contract
from specexport_runtime.contract import GraphSpec

from ..models.architectures import module_at
from ..models.config import NormalizedConfig, UnsupportedConfig, check_hf_modules, normalize
from ..models.streaming import Weights, source_of
from .decoder import _Ctx, _layer, _paths, _Stream, attention_shape, fused_refusal
from .layer_weights import layer_weights
from .ops_fused import ops_for
from .writer import DataFile, ExportResult, FloatWeights, Graph, Linear, save_graph


def mtp_spec(cfg: NormalizedConfig, vocab: int, kv_layout: str, tree: bool = False) -> GraphSpec:
    """The MTP graph's cache facts: one layer of the target's K/V heads, float32; tree: its tree graph."""
    return GraphSpec(
        1,
        cfg.kv_heads,
        cfg.head_dim,
        vocab,
        "float32",
        kv_layout=kv_layout,
        feature_width=cfg.hidden,
        kind=contract.MTP,
        hidden_width=cfg.hidden,
        tree=tree,
    )


def build_mtp(
    model: torch.nn.Module, out_dir: Path, max_context: int, kv_layout: str, tree: bool = False
) -> ExportResult:
    """Write out_dir/model.onnx (+ data) for `model` (models/mtp.mtp_model) in `kv_layout`, fp32;
    tree (head_major_inplace only): the tree graph (module docstring), same weights."""
    ops = ops_for(kv_layout)
    if tree and not ops.layout.contrib_attention:
        raise UnsupportedConfig(f"an MTP head's tree graph needs the fused layout (graph: fused); got {kv_layout}")
    start = time.perf_counter()
    cfg = normalize(model.config, max_context)
    check_hf_modules(model, cfg)
    problem = fused_refusal(cfg) if ops.layout.contrib_attention else None
    if problem:
        raise UnsupportedConfig(problem)
    arch = cfg.arch
    base = module_at(model, arch.decoder)
    (layer,) = module_at(base, arch.layers)
    embed_module, head = module_at(base, arch.embed), model.get_output_embeddings()
    spec = mtp_spec(cfg, embed_module.weight.shape[0], kv_layout, tree)
    g = Graph(torch.float32, data=DataFile(out_dir))
    try:
        ws = Weights(source_of(model), _paths(model))
        shape = attention_shape(model, cfg)
        call = ops.prepare(g, shape, 1, tree, table_rows=max_context, span=True)
        c = _Ctx(g, ops, cfg, shape, call, FloatWeights(), ws)
        own = model.mtp
        e, table = c.weights.embedding(g, contract.INPUT_IDS, Linear("embed", (ws.part(embed_module),)))  # [1, S, H]
        (h,) = g.op("Add", [contract.HEAD_FEATURES, contract.HEAD_HIDDEN])  # [1, S, H]: one side is zero
        en = c.rms(e, own.pre_fc_norm_embedding, "pre_fc_norm_embedding")
        hn = c.rms(h, own.pre_fc_norm_hidden, "pre_fc_norm_hidden")
        (x,) = g.op("Concat", [en, hn], axis=-1)  # [1, S, 2H]: embedding first
        x = c.linear(x, Linear("fc", (ws.part(own.fc),)), None)  # [1, S, H]
        stream = _Stream(g, ops, x, arch.norm_offset, ws)
        h = stream.norm(module_at(layer, arch.attn_norm))  # [1, S, H]
        _layer(c, 0, layer, stream, h, layer_weights(layer, arch, cfg, ws, 0))
        (rows,) = g.op("Gather", [stream.value(), contract.LOGITS_INDEX], axis=1)  # [1, R, H]
        out = c.rms(rows, module_at(base, arch.final_norm), "mtp_norm")  # [1, R, H]
        g.op("Identity", [out], [contract.HEAD_HIDDEN_OUT])
        (out2,) = g.op("Squeeze", [out, g.const("axes", np.array([0], np.int64))])  # [R, H]
        tied = ws.name(head) == ws.name(embed_module)
        logits = c.weights.head(g, out2, Linear("lm_head", (ws.part(head),)), table if tied else None)  # [R, V]
        g.op("Unsqueeze", [logits, g.const("axes", np.array([0], np.int64))], [contract.LOGITS])
        inputs, outputs = _interface(spec, g.elem)
        version = contract.version_for(kv_layout, mtp=True, tree=tree)
        return save_graph(g, "specexport_mtp", inputs, outputs, spec, version, out_dir, start)
    finally:
        if g.data is not None:
            g.data.close()


def _interface(spec: GraphSpec, elem: int) -> tuple[list, list]:
    """The graph's inputs and outputs in the contract's order (GraphSpec.input_names)."""
    info = helper.make_tensor_value_info
    F, H, V, Hkv, D = spec.feature_width, spec.hidden_width, spec.embedding_rows, spec.num_kv_heads, spec.head_dim
    in_place = spec.layout.in_place
    past = [1, Hkv, "cache_rows", D] if in_place else [1, "past", Hkv, D]
    new = past if in_place else [1, "seq", Hkv, D]
    float32, int64, int32 = 1, 7, 6  # TensorProto.FLOAT, INT64, INT32
    shapes = {
        contract.INPUT_IDS: (int64, [1, "seq"]),
        contract.HEAD_FEATURES: (float32, [1, "seq", F]),
        contract.HEAD_HIDDEN: (float32, [1, "seq", H]),
        contract.LOGITS_INDEX: (int64, ["rows"]),
        contract.SEQLENS_K: (int32, [1]),
        contract.TOTAL_SEQUENCE_LENGTH: (int32, []),
        contract.POSITION_IDS: (int64, [1, "seq"]),
        contract.TREE_BIAS: (float32, ["seq", "span"]),
        contract.past_key(0): (elem, past),
        contract.past_value(0): (elem, past),
        contract.LOGITS: (float32, [1, "rows", V]),
        contract.HEAD_HIDDEN_OUT: (float32, [1, "rows", H]),
    }
    for name in spec.layout.kv_outputs(0):
        shapes[name] = (elem, new)
    return [info(n, *shapes[n]) for n in spec.input_names()], [info(n, *shapes[n]) for n in spec.output_names()]
