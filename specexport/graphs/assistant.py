"""The Gemma 4 assistant's graph (kind `assistant`; docs/graph-contract.md, "Assistant"), written
for either target layout: it owns no cache and reads the target's K/V caches read-only.

Each of the S rows is one independent draft step at the same position P (the target's cursor:
the position of the last seen token), so a call's rows never see each other:

    input_ids              int64    [1, S]                 the token each row embeds (target's embedding)
    last_hidden            float32  [1, S, Hb]             the target's last hidden row (post final
                                                           norm) or the assistant's own hidden_out
    shared_key_{n}         kv_dtype [1, P, H_kv, D]        time_major: the valid prefix of target cache n
                                    [1, H_kv, T, D]        head_major_inplace: the whole buffer, with
    total_sequence_length  int32    []                     P (the rows it may read)
 -> logits                 float32  [1, S, V]
 -> hidden_out             float32  [1, S, Hb]             post_projection of the final norm

Per layer of type T (reading target cache n = shared_kv[T], whose D may exceed T's head_dim Dt:
the first Dt dims are read): q = rotary_P(q_norm(q_proj(norm(x)))), attention scale 1, over
the cache rows [0, P) (full layers) or the last W + 1 of them (sliding layers of window W:
transformers' bidirectional window flipped onto the past). The centroid head (use_ordered_
embeddings) scores the top-k centroids' tokens and gives every other token that row's lowest
selected logit minus 1, as transformers does (per row here; transformers takes the minimum over
the whole batch, the same for one row).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
from onnx import TensorProto, helper

from specexport_runtime import contract

from ..models.assistant import AssistantFacts
from ..models.errors import UnsupportedConfig
from .ops_fused import ops_for
from .writer import DataFile, ExportResult, Graph, activation, save_graph


def _i64(g: Graph, stem: str, v) -> str:
    return g.const(stem, np.array(v, np.int64))


class _Writer:
    def __init__(self, g: Graph, ops, model, facts: AssistantFacts, kv_layout: str):
        self.g, self.ops, self.model, self.facts = g, ops, model, facts
        self.in_place = contract.layout_of(kv_layout).in_place
        self.text = model.config.get_text_config()

    def norm(self, x: str, module, width: int | None = None) -> str:
        """Gemma 4's RMSNorm over the last axis (x * mean(x^2 + eps)^-1/2 * w); a weightless one
        (module None) multiplies by ones of `width`."""
        w = module.weight.detach().float() if module is not None else torch.ones(width)
        return self.ops.norm(self.g, x, self.g.weight("norm", w), float(self.text.rms_norm_eps))

    def linear(self, x: str, module) -> str:
        return self.g.op("MatMul", [x, self.g.weight("w", module.weight.detach().float().t())])[0]

    # --- per call --------------------------------------------------------------------------
    def cursor(self) -> str:
        """P [1] int64: the cache rows the call may read."""
        g = self.g
        if self.in_place:
            (p,) = g.op("Cast", [contract.TOTAL_SEQUENCE_LENGTH], to=TensorProto.INT64)
            return g.op("Reshape", [p, _i64(g, "shape", [1])])[0]
        first = contract.shared_key(min(self.facts.shared_kv.values()))
        return g.op("Shape", [first], start=1, end=2)[0]

    def rotary(self, P: str, kind: str, Dt: int) -> tuple[str, str]:
        """cos, sin [1, 1, 1, Dt] at position P for layer type `kind` (transformers' tables)."""
        g, rot = self.g, self.model.model.rotary_emb
        inv = getattr(rot, f"{kind}_original_inv_freq", None)
        inv = getattr(rot, f"{kind}_inv_freq") if inv is None else inv
        scale = float(getattr(rot, f"{kind}_attention_scaling", 1.0))
        if 2 * inv.shape[0] != Dt:
            raise UnsupportedConfig(f"assistant: rotary table {kind!r} covers {2 * inv.shape[0]} of {Dt} dims")
        (p,) = g.op("Cast", [P], to=TensorProto.FLOAT)  # [1]
        (freqs,) = g.op("Mul", [p, g.const("inv_freq", inv.detach().float().numpy())])  # [Dt / 2]
        (emb,) = g.op("Concat", [freqs, freqs], axis=0)  # [Dt]
        (emb,) = g.op("Reshape", [emb, _i64(g, "shape", [1, 1, 1, Dt])])
        cos, sin = (g.op(op, [emb])[0] for op in ("Cos", "Sin"))
        if scale != 1.0:
            cos, sin = (g.op("Mul", [t, g.scalar("rope_scale", scale)])[0] for t in (cos, sin))
        return cos, sin

    def keys(self, name: str, P: str, Dt: int, window: int | None) -> str:
        """Cache `name` as [1, H_kv, P', Dt]: its first Dt dims over rows [start, P), start 0 or,
        with a window W, max(0, P - W - 1)."""
        g = self.g
        start = _i64(g, "zero", [0])
        if window is not None:
            (start,) = g.op("Max", [start, g.op("Sub", [P, _i64(g, "w", [window + 1])])[0]])
        time_axis = 2 if self.in_place else 1
        (rows,) = g.op("Slice", [name, start, P, _i64(g, "axis", [time_axis])])
        (rows,) = g.op("Slice", [rows, _i64(g, "zero", [0]), _i64(g, "dt", [Dt]), _i64(g, "axis", [3])])
        return rows if self.in_place else g.op("Transpose", [rows], perm=[0, 2, 1, 3])[0]

    # --- the model ---------------------------------------------------------------------------
    def attention(self, i: int, h: str, P: str) -> str:
        """Layer i's attention of h [1, S, H] over its target cache -> [1, S, H]."""
        g, f, attn = self.g, self.facts, self.model.model.layers[i].self_attn
        kind = f.layer_types[i]
        Dt, Hq = f.head_dims[kind], self.text.num_attention_heads
        Hkv = int(self.text.num_key_value_heads)
        q = self.linear(h, attn.q_proj)  # [1, S, Hq Dt]
        (q,) = g.op("Reshape", [q, _i64(g, "shape", [1, -1, Hq, Dt])])
        q = self.norm(q, attn.q_norm)  # per head over Dt
        cos, sin = self.rotary(P, kind, Dt)
        half = Dt // 2
        a, b = g.op("Split", [q, _i64(g, "split", [half, half])], 2, axis=-1)
        (rot,) = g.op("Concat", [g.op("Neg", [b])[0], a], axis=-1)  # rotate_half(q)
        (q,) = g.op("Add", [g.op("Mul", [q, cos])[0], g.op("Mul", [rot, sin])[0]])  # [1, S, Hq, Dt]
        (q,) = g.op("Transpose", [q], perm=[0, 2, 1, 3])  # [1, Hq, S, Dt]; head j reads kv head j // G
        (q,) = g.op("Reshape", [q, _i64(g, "shape", [1, Hkv, -1, Dt])])  # [1, Hkv, G S, Dt]
        window = int(self.text.sliding_window) if kind == "sliding_attention" else None
        n = f.shared_kv[kind]
        k = self.keys(contract.shared_key(n), P, Dt, window)  # [1, Hkv, P', Dt]
        v = self.keys(contract.shared_value(n), P, Dt, window)
        (kt,) = g.op("Transpose", [k], perm=[0, 1, 3, 2])
        scores = g.op("MatMul", [q, kt])[0]  # [1, Hkv, G S, P'], scale 1
        if g.dtype_name != "float32":
            (scores,) = g.op("Cast", [scores], to=TensorProto.FLOAT)
        (probs,) = g.op("Softmax", [scores], axis=-1)
        if g.dtype_name != "float32":
            (probs,) = g.op("Cast", [probs], to=g.elem)
        (out,) = g.op("MatMul", [probs, v])  # [1, Hkv, G S, Dt]
        (out,) = g.op("Reshape", [out, _i64(g, "shape", [1, Hq, -1, Dt])])
        (out,) = g.op("Transpose", [out], perm=[0, 2, 1, 3])  # [1, S, Hq, Dt]
        (out,) = g.op("Reshape", [out, _i64(g, "shape", [1, -1, Hq * Dt])])
        return self.linear(out, attn.o_proj)

    def layer(self, i: int, x: str, P: str) -> str:
        g, layer = self.g, self.model.model.layers[i]
        a = self.attention(i, self.norm(x, layer.input_layernorm), P)
        (x,) = g.op("Add", [x, self.norm(a, layer.post_attention_layernorm)])
        h = self.norm(x, layer.pre_feedforward_layernorm)
        mlp = layer.mlp
        gate = activation(g, self.linear(h, mlp.gate_proj), self.text.hidden_activation)
        (m,) = g.op("Mul", [gate, self.linear(h, mlp.up_proj)])
        (x,) = g.op("Add", [x, self.norm(self.linear(m, mlp.down_proj), layer.post_feedforward_layernorm)])
        scalar = float(layer.layer_scalar.detach().float().reshape(-1)[0])
        return x if scalar == 1.0 else g.op("Mul", [x, g.scalar("layer_scalar", scalar)])[0]

    def head(self, h: str) -> str:
        """h [1, S, H] -> logits [1, S, V] float32 (the full head, or the centroid-masked one)."""
        g, f = self.g, self.facts
        table = g.weight("lm_head", self.model.lm_head.weight.detach().float())  # [V, H], tied: stored once
        if not f.centroids:
            return g.op("MatMul", [h, g.op("Transpose", [table], perm=[1, 0])[0]])[0]
        per = f.vocab // f.centroids
        emb = self.model.masked_embedding
        c = self.linear(h, emb.centroids)  # [1, S, C]
        _, top = g.op("TopK", [c, _i64(g, "k", [f.top_k])], 2, axis=-1)  # [1, S, k]
        order = g.const("token_ordering", emb.token_ordering.detach().long().reshape(f.centroids, per).numpy())
        (ids,) = g.op("Gather", [order, top], axis=0)  # [1, S, k, per]
        (ids,) = g.op("Reshape", [ids, _i64(g, "shape", [1, -1, f.top_k * per])])  # [1, S, k per]
        (rows,) = g.op("Gather", [table, ids], axis=0)  # [1, S, k per, H]
        (hq,) = g.op("Unsqueeze", [h, _i64(g, "axes", [2])])  # [1, S, 1, H]
        (sel,) = g.op("MatMul", [hq, g.op("Transpose", [rows], perm=[0, 1, 3, 2])[0]])  # [1, S, 1, k per]
        (sel,) = g.op("Squeeze", [sel, _i64(g, "axes", [2])])  # [1, S, k per]
        (low,) = g.op("ReduceMin", [sel], axes=[-1], keepdims=1)  # [1, S, 1]
        (low,) = g.op("Sub", [low, g.scalar("one", 1.0)])
        (shape,) = g.op("Concat", [g.op("Shape", [h], end=2)[0], _i64(g, "v", [f.vocab])], axis=0)
        (full,) = g.op("Expand", [low, shape])  # [1, S, V]
        return g.op("ScatterElements", [full, ids, sel], axis=2)[0]

    def write(self) -> None:
        g, model, f = self.g, self.model, self.facts
        P = self.cursor()
        (e,) = g.op("Gather", [g.weight("embed", self.target_embed), contract.INPUT_IDS], axis=0)  # [1, S, Hb]
        hidden = contract.ASSISTANT_HIDDEN
        if g.dtype_name != "float32":
            (hidden,) = g.op("Cast", [hidden], to=g.elem)
        (x,) = g.op("Concat", [e, hidden], axis=-1)  # [1, S, 2 Hb]
        x = self.linear(x, model.pre_projection)  # [1, S, H]
        for i in range(len(f.layer_types)):
            x = self.layer(i, x, P)
        h = self.norm(x, model.model.norm)
        out = self.linear(h, model.post_projection)  # [1, S, Hb]
        logits = self.head(h)
        if g.dtype_name != "float32":
            out, logits = (g.op("Cast", [t], to=TensorProto.FLOAT)[0] for t in (out, logits))
        g.op("Identity", [logits], [contract.LOGITS])
        g.op("Identity", [out], [contract.HEAD_HIDDEN_OUT])


def assistant_spec(facts: AssistantFacts, kv_heads: int, head_dim: int, kv_layout: str, dtype: str):
    """The GraphSpec of an assistant graph (kind assistant): the target cache shape it reads."""
    return contract.GraphSpec(
        len(set(facts.shared_kv.values())),
        kv_heads,
        head_dim,
        facts.vocab,
        dtype,
        kv_layout=kv_layout,
        kind=contract.ASSISTANT,
        hidden_width=facts.backbone,
        shared_kv=tuple(sorted(set(facts.shared_kv.values()))),
    )


def build_assistant(
    model,
    target_embedding: torch.Tensor,
    facts: AssistantFacts,
    out_dir: Path,
    *,
    kv_heads: int,
    head_dim: int,
    kv_layout: str = contract.TIME_MAJOR,
    dtype: torch.dtype = torch.float32,
) -> ExportResult:
    """Write out_dir/model.onnx (+ data) for the assistant `model` (Gemma4AssistantForCausalLM)
    reading target caches of [H_kv = kv_heads, D = head_dim] in `kv_layout`; the token embedding
    is the target's as its decoder sees it (`target_embedding` [V, Hb], times Gemma's embedding
    scale: build/eagle.py target_embedding), copied into the graph."""
    start = time.perf_counter()
    ops = ops_for(kv_layout)
    g = Graph(dtype, data=DataFile(out_dir))
    spec = assistant_spec(facts, kv_heads, head_dim, kv_layout, g.dtype_name)
    try:
        w = _Writer(g, ops, model, facts, kv_layout)
        w.target_embed = target_embedding
        w.write()
        kv = helper.make_tensor_value_info
        cache = ["P", kv_heads, head_dim] if not w.in_place else [kv_heads, "T", head_dim]
        inputs = [
            kv(contract.INPUT_IDS, TensorProto.INT64, [1, "S"]),
            kv(contract.ASSISTANT_HIDDEN, TensorProto.FLOAT, [1, "S", facts.backbone]),
        ]
        if w.in_place:
            inputs.append(kv(contract.TOTAL_SEQUENCE_LENGTH, TensorProto.INT32, []))
        for n in spec.shared_kv:
            for name in (contract.shared_key(n), contract.shared_value(n)):
                inputs.append(kv(name, g.elem, [1, *cache]))
        outputs = [
            kv(contract.LOGITS, TensorProto.FLOAT, [1, "S", facts.vocab]),
            kv(contract.HEAD_HIDDEN_OUT, TensorProto.FLOAT, [1, "S", facts.backbone]),
        ]
        version = contract.version_for(kv_layout, assistant=True)
        return save_graph(g, "specexport_assistant", inputs, outputs, spec, version, out_dir, start)
    finally:
        if g.data is not None:
            g.data.close()
