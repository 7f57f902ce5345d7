"""The EAGLE-3 head as a portable graph: ONNX standard ops only, the contract's time-major cache.

The same head as eagle_graph.py (inputs, outputs and semantics; docs/graph-contract.md), written
as a small torch module traced with torch.onnx.export like the portable decoder (export.py), so
that providers without ONNX Runtime's contrib ops (TensorRT) run it. Per row, with e the target's
embedding of the row's token and h = fc(features) + draft_hidden (the caller zeroes the side it
does not use; fc has no bias, so this is exact):

    x      = [input_layernorm(e), hidden_norm(h)]                 [S, 2H]
    r      = attention(x) + h                                     rotary at positions P .. P+S-1
    hidden = r + mlp(post_attention_layernorm(r))                 [S, H]
    logits = lm_head(norm(hidden[rows]))                          [R, V_draft]

    input_ids       int64     [1, S]
    features        float32   [1, S, F]         F = 3 H_t
    draft_hidden    float32   [1, S, H]
    logits_index    int64     [R]
    past_key_0      kv_dtype  [1, P, H_kv, D]   the head's valid cache prefix (rotary applied)
    past_value_0    kv_dtype  [1, P, H_kv, D]
 -> logits          float32   [1, R, V_draft]
    hidden_out      float32   [1, R, H]
    new_key_0       kv_dtype  [1, S, H_kv, D]   the S new rows, written by the runtime at P
    new_value_0     kv_dtype  [1, S, H_kv, D]

Precision: fp32, or fp16 (weights, activations and cache in float16; the I/O above stays float32;
norms and attention scores are computed in float32). int8 weight-only needs MatMulNBits, a contrib
op, so it exists in the fused form only (recipe validation refuses portable + int8).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import nn

from specexport_runtime import contract
from specexport_runtime.contract import GraphSpec

from .decoder import call_positions, past_positions
from .eagle_graph import head_spec
from .export import ExportResult, fix_output_dims, save_traced, trace_module

PORTABLE_HEAD_PRECISIONS = ("fp32", "fp16")
_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
# distinct example sizes so that no dynamic dimension is frozen while tracing (as export.py)
_EXAMPLE_S, _EXAMPLE_P, _EXAMPLE_R = 5, 7, 3


def _frozen(tensor: torch.Tensor, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(tensor.detach().to(dtype).contiguous(), requires_grad=False)


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in `dtype`; no node when it already is (the tracer records every .to() as a Cast)."""
    return x if x.dtype == dtype else x.to(dtype)


class PortableHead(nn.Module):
    """One head step over S rows (module docstring); weights stored pre-transposed [K, N] so each
    projection traces to one MatMul on its initializer."""

    def __init__(self, head, embedding: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        c, w = head.config, head.weights
        self.H, self.Hq, self.Hkv, self.D = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.F, self.I = 3 * c.target_hidden_size, c.intermediate_size
        self.eps, self.dtype = float(c.rms_norm_eps), dtype
        attn, mlp = "midlayer.self_attn.", "midlayer.mlp."
        self.embed = _frozen(embedding, dtype)  # [V_t, H]
        self.fc_t = _frozen(w["fc.weight"].t(), dtype)  # [F, H]
        self.qkv_t = _frozen(torch.cat([w[f"{attn}{p}_proj.weight"] for p in "qkv"]).t(), dtype)  # [2H, (Hq + 2 Hkv) D]
        self.o_t = _frozen(w[f"{attn}o_proj.weight"].t(), dtype)  # [Hq D, H]
        gate_up = torch.cat([w[f"{mlp}gate_proj.weight"], w[f"{mlp}up_proj.weight"]])  # [2I, H]
        self.gate_up_t = _frozen(gate_up.t(), dtype)  # [H, 2I]
        self.down_t = _frozen(w[f"{mlp}down_proj.weight"].t(), dtype)  # [I, H]
        self.lm_t = _frozen(w["lm_head.weight"].t(), dtype)  # [H, V_draft]
        self.norms = nn.ParameterDict(
            {
                key: _frozen(w[name], dtype)
                for key, name in (
                    ("input", "midlayer.input_layernorm.weight"),
                    ("hidden", "midlayer.hidden_norm.weight"),
                    ("post", "midlayer.post_attention_layernorm.weight"),
                    ("final", "norm.weight"),
                )
            }
        )
        # the default rotary embedding (formats.eagle3 refuses others): fp32 like transformers
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, self.D, 2, dtype=torch.float32) / self.D))  # [D/2]
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _rms(self, x: torch.Tensor, key: str) -> torch.Tensor:
        """RMSNorm over the last axis in float32, back to the graph dtype, times the weight."""
        xf = _as(x, torch.float32)
        return _as(xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps), self.dtype) * self.norms[key]

    def _rotary(self, q_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [S, 1, D] (graph dtype) of positions q_pos [S]."""
        freqs = q_pos.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)  # [S, D/2] fp32
        emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)  # [S, 1, D]
        return _as(emb.cos(), self.dtype), _as(emb.sin(), self.dtype)

    def _attention(self, q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [S, Hq, D] (pre-scaled), k_all / v_all [T, Hkv, D], mask [S, T] -> [S, Hq D]; query head
        j reads KV head j // rep (grouped, KV heads not repeated)."""
        rep = self.Hq // self.Hkv
        qg = q.reshape(-1, self.Hkv, rep, self.D).permute(1, 2, 0, 3)  # [Hkv, rep, S, D]
        kt = k_all.permute(1, 2, 0).unsqueeze(1)  # [Hkv, 1, D, T]
        vg = v_all.permute(1, 0, 2).unsqueeze(1)  # [Hkv, 1, T, D]
        scores = _as(torch.matmul(qg, kt), torch.float32) + mask  # [Hkv, rep, S, T] fp32
        probs = _as(torch.softmax(scores, dim=-1), self.dtype)
        out = torch.matmul(probs, vg)  # [Hkv, rep, S, D]
        return out.permute(2, 0, 1, 3).reshape(-1, self.Hq * self.D)

    def forward(self, input_ids, features, draft_hidden, logits_index, past_key, past_value):
        # input_ids [1, S]; features [1, S, F] fp32; draft_hidden [1, S, H] fp32; logits_index [R];
        # past_key / past_value [1, P, Hkv, D]
        ids = input_ids.reshape(-1)  # [S]
        past_pos = past_positions(past_key)  # [P]
        q_pos = call_positions(past_pos, ids)  # [S]: P .. P+S-1
        k_pos = torch.cat([past_pos, q_pos])  # [T], T = P + S
        mask = torch.where(k_pos.unsqueeze(0) <= q_pos.unsqueeze(1), 0.0, torch.finfo(torch.float32).min)  # [S, T]

        e = nn.functional.embedding(ids, self.embed)  # [S, H]
        h = torch.matmul(_as(features.reshape(-1, self.F), self.dtype), self.fc_t)  # [S, H]
        h = h + _as(draft_hidden.reshape(-1, self.H), self.dtype)
        x = torch.cat([self._rms(e, "input"), self._rms(h, "hidden")], dim=-1)  # [S, 2H]
        qkv = torch.matmul(x, self.qkv_t).reshape(-1, self.Hq + 2 * self.Hkv, self.D)  # [S, Hq + 2 Hkv, D]
        qk, v = qkv.split([self.Hq + self.Hkv, self.Hkv], dim=1)  # [S, Hq + Hkv, D], [S, Hkv, D]
        cos, sin = self._rotary(q_pos)
        half = self.D // 2
        qk = qk * cos + torch.cat([-qk[..., half:], qk[..., :half]], dim=-1) * sin  # rotate_half
        q, k = qk.split([self.Hq, self.Hkv], dim=1)  # [S, Hq, D], [S, Hkv, D]
        q = q * torch.tensor(self.D**-0.5, dtype=self.dtype)
        k_all = torch.cat([past_key[0], k], dim=0)  # [T, Hkv, D]
        v_all = torch.cat([past_value[0], v], dim=0)
        r = torch.matmul(self._attention(q, k_all, v_all, mask), self.o_t) + h  # [S, H]
        gate, up = torch.matmul(self._rms(r, "post"), self.gate_up_t).split(self.I, dim=-1)  # [S, I] each
        hidden = r + torch.matmul(nn.functional.silu(gate) * up, self.down_t)  # [S, H]
        rows = hidden.index_select(0, logits_index)  # [R, H]
        logits = torch.matmul(self._rms(rows, "final"), self.lm_t)  # [R, V_draft]
        f32 = torch.float32
        return _as(logits, f32).unsqueeze(0), _as(rows, f32).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)


def portable_head_spec(config, precision: str) -> GraphSpec:
    """head_spec in the time-major layout."""
    return head_spec(config, precision, contract.TIME_MAJOR)


def _example_inputs(spec: GraphSpec, dtype: torch.dtype, vocab: int) -> tuple[torch.Tensor, ...]:
    ids = torch.arange(_EXAMPLE_S, dtype=torch.int64).unsqueeze(0) % vocab  # [1, S]
    features = torch.randn(1, _EXAMPLE_S, spec.feature_width)  # [1, S, F]
    hidden = torch.randn(1, _EXAMPLE_S, spec.hidden_width)  # [1, S, H]
    rows = torch.arange(_EXAMPLE_S - _EXAMPLE_R, _EXAMPLE_S, dtype=torch.int64)  # [R]
    past = [torch.randn(1, _EXAMPLE_P, spec.num_kv_heads, spec.head_dim, dtype=dtype) for _ in range(2)]
    return (ids, features, hidden, rows, *past)


def _dynamic_axes() -> dict[str, dict[int, str]]:
    seq = {1: "seq"}
    return {
        contract.INPUT_IDS: seq,
        contract.HEAD_FEATURES: seq,
        contract.HEAD_HIDDEN: seq,
        contract.LOGITS_INDEX: {0: "rows"},
        contract.past_key(0): {1: "past"},
        contract.past_value(0): {1: "past"},
        contract.LOGITS: {1: "rows"},
        contract.HEAD_HIDDEN_OUT: {1: "rows"},
        contract.new_key(0): seq,
        contract.new_value(0): seq,
    }


def build_portable_head(head, embedding: torch.Tensor, out_dir: Path, precision: str = "fp32") -> ExportResult:
    """Write out_dir/model.onnx (+ data) for `head` (formats.eagle3.Eagle3Head) in the time-major
    layout; `embedding` is the target's input embedding [V_target, H]."""
    if precision not in PORTABLE_HEAD_PRECISIONS:
        raise ValueError(
            f"portable head precision {precision!r}: expected one of {', '.join(PORTABLE_HEAD_PRECISIONS)}"
            " (int8 heads use MatMulNBits: graph: fused)"
        )
    start = time.perf_counter()
    dtype = _DTYPES[precision]
    module = PortableHead(head, embedding, dtype).eval()
    spec = portable_head_spec(head.config, precision)
    inputs = _example_inputs(spec, dtype, embedding.shape[0])
    proto = trace_module(module, inputs, spec, _dynamic_axes(), out_dir)
    c = head.config
    fix_output_dims(
        proto,
        {contract.LOGITS: (1, "rows", c.draft_vocab_size), contract.HEAD_HIDDEN_OUT: (1, "rows", c.hidden_size)},
        spec,
    )
    return save_traced(proto, spec, contract.PORTABLE_HEAD_VERSION, out_dir, start)
