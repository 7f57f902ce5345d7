"""The shared decoder: wraps a Hugging Face *ForCausalLM and exposes the graph contract.

forward(input_ids, logits_index, past_key_0, past_value_0, ...) ->
    (logits, new_key_0, new_value_0, ...)
exactly as docs/graph-contract.md states. The HF model's norms, MLPs and projections are
called as they are (so weights are read, never copied); attention, rotary, the causal mask over
[past, new] and the row-gathered output projection are done here, identically for every family.
"""

from __future__ import annotations

import torch
from torch import nn

from specexport_runtime.errors import SpecExportError

from .architectures import ArchSpec, arch_for

STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class UnsupportedConfig(SpecExportError):
    """The model uses a feature the exporter does not reproduce exactly."""


def _get(root: nn.Module, path: str) -> nn.Module:
    for part in path.split("."):
        root = getattr(root, part)
    return root


class ContractDecoder(nn.Module):
    def __init__(self, model: nn.Module, arch: ArchSpec | None = None, tie_lm_head: bool = True):
        """tie_lm_head=False stores the output projection as its own [hidden, V] MatMul weight,
        so that weight-only quantizers (which act on MatMul) also compress it (drafts)."""
        super().__init__()
        config = model.config
        self.arch = arch or arch_for(config.model_type)
        self.model = model
        base = _get(model, self.arch.decoder)
        self.embed = _get(base, self.arch.embed)
        self.layers = _get(base, self.arch.layers)
        self.final_norm = _get(base, self.arch.final_norm)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.hidden_size = config.hidden_size
        self.embedding_rows = self.embed.weight.shape[0]
        self.tie_lm_head = tie_lm_head
        self.lm_weight = model.get_output_embeddings().weight  # [V, hidden]
        self.lm_bias = getattr(model.get_output_embeddings(), "bias", None)
        if not tie_lm_head:
            self.lm_weight_t = nn.Parameter(self.lm_weight.detach().t().contiguous(), requires_grad=False)
        self.window = None
        if self.arch.sliding_window and getattr(config, "sliding_window", None):
            self.window = int(config.sliding_window)
        if self.arch.positions == "rope":
            rope = getattr(config, "rope_parameters", None) or {}
            rope_type = rope.get("rope_type", "default")
            if rope_type not in STATIC_ROPE_TYPES:
                raise UnsupportedConfig(
                    f"rope_type {rope_type!r} is not supported (it depends on the sequence length); "
                    f"supported: {', '.join(STATIC_ROPE_TYPES)}"
                )
            rotary = _get(base, "rotary_emb")
            # inv_freq: [rotary_dim / 2]; rotary_dim < head_dim for partial rotary
            self.register_buffer("inv_freq", rotary.inv_freq.detach().float().clone(), persistent=False)
            self.rope_scale = float(rotary.attention_scaling)
        else:
            self.pos_embed = _get(base, self.arch.position_embed)
        self.scaling = self.head_dim**-0.5

    # --- pieces -------------------------------------------------------------------------
    def _qkv(self, attn: nn.Module, x: torch.Tensor):
        """x: [S, hidden] -> q [S, H, D], k [S, H_kv, D], v [S, H_kv, D]"""
        S = x.shape[0]
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        if self.arch.qkv == "separate":
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        else:
            qkv = attn.qkv_proj(x) if self.arch.qkv == "fused" else attn.c_attn(x)
            q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
        q, k, v = q.view(S, H, D), k.view(S, Hkv, D), v.view(S, Hkv, D)
        if self.arch.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        return q, k, v

    def _rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [S, heads, D]; cos, sin: [S, 1, rotary_dim] (rotate-half convention)."""
        rot = cos.shape[-1]
        x_rot, x_pass = x[..., :rot], x[..., rot:]
        half = rot // 2
        rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
        return torch.cat([x_rot * cos + rotated * sin, x_pass], dim=-1)

    def _attention(self, q, k_all, v_all, mask, scaling: float):
        """q [S, H, D]; k_all, v_all [T, H_kv, D]; mask [S, T] additive -> [S, H*D].

        KV heads are not repeated: q is grouped as [H_kv, rep, S, D] and broadcast against
        k [H_kv, 1, D, T] (HF head order: head = kv_head * rep + r)."""
        S = q.shape[0]
        Hkv, D = self.num_kv_heads, self.head_dim
        rep = self.num_heads // Hkv
        qg = q.view(S, Hkv, rep, D).permute(1, 2, 0, 3)  # [H_kv, rep, S, D]
        kt = k_all.permute(1, 2, 0).unsqueeze(1)  # [H_kv, 1, D, T]
        vg = v_all.permute(1, 0, 2).unsqueeze(1)  # [H_kv, 1, T, D]
        scores = torch.matmul(qg, kt).float() * scaling + mask  # [H_kv, rep, S, T] fp32
        probs = torch.softmax(scores, dim=-1).to(vg.dtype)
        out = torch.matmul(probs, vg)  # [H_kv, rep, S, D]
        return out.permute(2, 0, 1, 3).reshape(S, self.num_heads * D)

    # --- forward ------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, logits_index: torch.Tensor, *past: torch.Tensor):
        # input_ids: [1, S]; logits_index: [R]; past: 2 * L tensors [1, P, H_kv, D]
        ids = input_ids[0]  # [S]
        # Positions from shapes only, so the exported graph stays dynamic in S and P.
        new_ones = torch.ones_like(ids)  # [S] int64
        past_len = torch.ones_like(past[0][0, :, 0, 0], dtype=torch.int64).sum()  # P (0-d)
        q_pos = torch.cumsum(new_ones, 0) - 1 + past_len  # [S]
        k_pos = torch.cat([torch.cumsum(torch.ones_like(past[0][0, :, 0, 0], dtype=torch.int64), 0) - 1, q_pos])
        allowed = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)  # [S, T], T = P + S
        if self.window is not None:
            allowed = allowed & (k_pos.unsqueeze(0) > q_pos.unsqueeze(1) - self.window)
        mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)  # [S, T] fp32

        x = self.embed(ids)  # [S, hidden]
        if self.arch.embed_scale and not hasattr(self.embed, "embed_scale"):
            # transformers >= 5 scales inside the embedding module (GemmaTextScaledWordEmbedding)
            x = x * torch.tensor(self.hidden_size**0.5, dtype=x.dtype)
        if self.arch.positions == "rope":
            freqs = q_pos.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)  # [S, rot/2]
            emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)  # [S, 1, rot]
            cos = (emb.cos() * self.rope_scale).to(x.dtype)
            sin = (emb.sin() * self.rope_scale).to(x.dtype)
        else:
            x = x + self.pos_embed(q_pos)

        new_kv: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            attn = _get(layer, self.arch.attn)
            h = _get(layer, self.arch.attn_norm)(x)
            q, k, v = self._qkv(attn, h)
            if self.arch.positions == "rope":
                q, k = self._rotary(q, cos, sin), self._rotary(k, cos, sin)
            k_all = torch.cat([past[2 * i][0], k], dim=0)  # [T, H_kv, D]
            v_all = torch.cat([past[2 * i + 1][0], v], dim=0)
            a = self._attention(q, k_all, v_all, mask, float(getattr(attn, "scaling", self.scaling)))
            x = x + getattr(attn, self.arch.out_proj)(a)
            x = x + _get(layer, self.arch.mlp)(_get(layer, self.arch.mlp_norm)(x))
            new_kv += [k.unsqueeze(0), v.unsqueeze(0)]  # [1, S, H_kv, D]

        rows = self.final_norm(x.index_select(0, logits_index))  # [R, hidden]
        if self.tie_lm_head:
            logits = nn.functional.linear(rows, self.lm_weight, self.lm_bias)  # Gemm transB: one copy
        else:
            logits = torch.matmul(rows, self.lm_weight_t)
            if self.lm_bias is not None:
                logits = logits + self.lm_bias
        return (logits.float().unsqueeze(0), *new_kv)
