"""The shared decoder: wraps a Hugging Face *ForCausalLM and exposes the graph contract.

forward(input_ids, logits_index, past_key_0, past_value_0, ...) ->
    (logits, [hidden_states,] new_key_0, new_value_0, ...)
exactly as docs/graph-contract.md states (hidden_states only with feature_layers, contract 1.2).
The HF model's norms and weights are used as they are; attention, rotary, the causal mask over
[past, new] and the row-gathered output projection are written here once for every family.

The traced graph is kept small because on a CPU, and more so for a quantized draft, per-node
overhead rivals the matrix work (docs/performance.md): q|k|v and gate|up are one MatMul each,
rotary is one [D, D] signed-permutation MatMul on q|k|v at once (cos = 1, sin = 0 on v heads,
so v passes exactly), reshapes use constant shapes, and positions/mask are computed once.
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


def _linear_parts(*modules: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate nn.Linear weights [out_i, in] -> [sum out, in] (bias zeros where absent)."""
    weight = torch.cat([m.weight.detach() for m in modules], dim=0)
    if all(m.bias is None for m in modules):
        return weight, None
    bias = torch.cat([m.bias.detach() if m.bias is not None else torch.zeros(m.weight.shape[0], dtype=m.weight.dtype)
                      for m in modules])
    return weight, bias


class ContractDecoder(nn.Module):
    def __init__(self, model: nn.Module, arch: ArchSpec | None = None, tie_lm_head: bool = True,
                 feature_layers: tuple[int, ...] = ()):
        """tie_lm_head=False stores the output projection as its own [hidden, V] MatMul weight,
        so that weight-only quantizers (which act on MatMul) also compress it (drafts).
        feature_layers: indices i of the residual streams entering decoder layer i (transformers'
        output_hidden_states[i], 0 <= i < layers), returned in that order as one more output
        `hidden_states` [1, S, len * hidden] float32 for every input row (contract 1.2: what an
        EAGLE-3 head reads; the fused graph's output of the same name)."""
        super().__init__()
        config = model.config
        self.arch = arch = arch or arch_for(config.model_type)
        self.model = model
        base = _get(model, arch.decoder)
        self.embed = _get(base, arch.embed)
        self.layers = _get(base, arch.layers)
        bad = [i for i in feature_layers if not 0 <= i < len(self.layers)]
        if bad:
            raise UnsupportedConfig(f"feature layers {bad} are outside the target's 0..{len(self.layers) - 1}")
        self.feature_layers = tuple(feature_layers)
        self.final_norm = _get(base, arch.final_norm)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.hidden_size = config.hidden_size
        self.embedding_rows = self.embed.weight.shape[0]
        self.tie_lm_head = tie_lm_head
        head = model.get_output_embeddings()
        self.lm_weight, self.lm_bias = head.weight, getattr(head, "bias", None)  # [V, hidden]
        if not tie_lm_head:
            self.lm_weight_t = nn.Parameter(self.lm_weight.detach().t().contiguous(), requires_grad=False)
        self.window = int(config.sliding_window) if arch.sliding_window and getattr(config, "sliding_window", None) else None
        self._fuse_weights()
        self.rotary = arch.positions == "rope"
        if self.rotary:
            self._init_rotary(config, base)
            scales = {self._scaling(_get(layer, arch.attn)) for layer in self.layers}
            if len(scales) != 1:
                raise UnsupportedConfig(f"per-layer attention scales {sorted(scales)} are not supported with rotary")
            self.q_scale = scales.pop()
        else:
            self.pos_embed = _get(base, arch.position_embed)

    # --- construction -------------------------------------------------------------------
    def _fuse_weights(self) -> None:
        """Per layer: one q|k|v weight [(H + 2 H_kv) D, hidden] and one gate|up weight."""
        self.qkv_w, self.qkv_b = nn.ParameterList(), nn.ParameterList()
        self.gate_up_w = nn.ParameterList()
        self._has_qkv_bias = False
        for layer in self.layers:
            attn, mlp = _get(layer, self.arch.attn), _get(layer, self.arch.mlp)
            if self.arch.qkv == "separate":
                w, b = _linear_parts(attn.q_proj, attn.k_proj, attn.v_proj)
                self.qkv_w.append(nn.Parameter(w, requires_grad=False))
                if b is not None:
                    self._has_qkv_bias = True
                    self.qkv_b.append(nn.Parameter(b, requires_grad=False))
            if self.arch.mlp_kind == "gated":
                w, b = _linear_parts(mlp.gate_proj, mlp.up_proj)
                if b is not None:
                    raise UnsupportedConfig("gated MLP projections with bias are not supported")
                self.gate_up_w.append(nn.Parameter(w, requires_grad=False))

    def _init_rotary(self, config, base: nn.Module) -> None:
        rope = getattr(config, "rope_parameters", None) or {}
        rope_type = rope.get("rope_type", "default")
        if rope_type not in STATIC_ROPE_TYPES:
            raise UnsupportedConfig(
                f"rope_type {rope_type!r} is not supported (it depends on the sequence length); "
                f"supported: {', '.join(STATIC_ROPE_TYPES)}"
            )
        rotary = _get(base, "rotary_emb")
        inv_freq = rotary.inv_freq.detach().float()  # [rot / 2]; rot < D for partial rotary
        rot, D = 2 * inv_freq.shape[0], self.head_dim
        self.register_buffer("inv_freq", inv_freq.clone(), persistent=False)
        self.rope_scale = float(rotary.attention_scaling)
        # rotate_half as a signed permutation: (x @ R)[j] = -x[j + rot/2] (j < rot/2), x[j - rot/2] (j < rot)
        R = torch.zeros(D, D)
        half = rot // 2
        for j in range(half):
            R[j + half, j] = -1.0
            R[j, j + half] = 1.0
        self.register_buffer("rot_matrix", R, persistent=False)

    def _scaling(self, attn: nn.Module) -> float:
        return float(getattr(attn, "scaling", self.head_dim**-0.5))

    # --- pieces -------------------------------------------------------------------------
    def _qkv(self, i: int, attn: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x: [S, hidden] -> q|k|v [1, S, H + 2 H_kv, D]"""
        if self.arch.qkv == "separate":
            qkv = nn.functional.linear(x, self.qkv_w[i], self.qkv_b[i] if self._has_qkv_bias else None)
        elif self.arch.qkv == "fused":
            qkv = attn.qkv_proj(x)
        else:
            qkv = attn.c_attn(x)
        return qkv.reshape(1, -1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)

    def _mlp(self, i: int, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        mlp = _get(layer, self.arch.mlp)
        if self.arch.mlp_kind == "module":
            return mlp(x)
        if self.arch.mlp_kind == "gated":
            gate_up, act = nn.functional.linear(x, self.gate_up_w[i]), mlp.act_fn
        else:
            gate_up, act = mlp.gate_up_proj(x), mlp.activation_fn
        gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)  # one Split node (chunk traces as 2 Slices)
        return mlp.down_proj(act(gate) * up)

    def _attention(self, q, k_all, v_all, mask, scaling: float | None):
        """q [1, S, H, D]; k_all, v_all [1, T, H_kv, D]; mask [S, T] additive -> [S, H*D].

        KV heads are not repeated: q is grouped as [H_kv, rep, S, D] and broadcast against
        k [H_kv, 1, D, T] (HF head order: head = kv_head * rep + r). With batch 1 every
        permute below is one Transpose of the cache view, no copy of the cache buffer."""
        Hkv, D = self.num_kv_heads, self.head_dim
        rep = self.num_heads // Hkv
        qg = q.reshape(-1, Hkv, rep, D).permute(1, 2, 0, 3)  # [H_kv, rep, S, D]
        # 3-D permutes hit ONNX Runtime's fast transpose paths (4-D ones with a unit dim did not)
        kt = k_all.reshape(-1, Hkv, D).permute(1, 2, 0).unsqueeze(1)  # [H_kv, 1, D, T]
        vg = v_all.reshape(-1, Hkv, D).permute(1, 0, 2).unsqueeze(1)  # [H_kv, 1, T, D]
        scores = torch.matmul(qg, kt).float()  # [H_kv, rep, S, T] fp32
        if scaling is not None:  # None: q arrives pre-scaled (folded into rotary)
            scores = scores * scaling
        scores = scores + mask
        probs = torch.softmax(scores, dim=-1).to(vg.dtype)
        out = torch.matmul(probs, vg)  # [H_kv, rep, S, D]
        return out.permute(2, 0, 1, 3).reshape(-1, self.num_heads * D)

    # --- forward ------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, logits_index: torch.Tensor, *past: torch.Tensor):
        # input_ids: [1, S]; logits_index: [R]; past: 2 * L tensors [1, P, H_kv, D]
        ids = input_ids.reshape(-1)  # [S]
        H, Hkv = self.num_heads, self.num_kv_heads
        # Positions from shapes only, so the exported graph stays dynamic in S and P.
        past_pos = torch.cumsum(torch.ones_like(past[0][0, :, 0, 0], dtype=torch.int64), 0) - 1  # [P]
        q_pos = torch.cumsum(torch.ones_like(ids), 0) - 1 + past_pos.numel()  # [S]: P .. P+S-1
        k_pos = torch.cat([past_pos, q_pos])  # [T]
        allowed = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)  # [S, T], T = P + S
        if self.window is not None:
            allowed = allowed & (k_pos.unsqueeze(0) > q_pos.unsqueeze(1) - self.window)
        mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)  # [S, T] fp32

        x = self.embed(ids)  # [S, hidden]
        if self.arch.embed_scale and not hasattr(self.embed, "embed_scale"):
            # transformers >= 5 scales inside the embedding module (GemmaTextScaledWordEmbedding)
            x = x * torch.tensor(self.hidden_size**0.5, dtype=x.dtype)
        if self.rotary:
            freqs = q_pos.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)  # [S, rot/2]
            pad = self.head_dim - 2 * freqs.shape[1]
            emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)  # [S, 1, rot]
            cos, sin = emb.cos() * self.rope_scale, emb.sin() * self.rope_scale
            if pad:  # partial rotary: the pass-through dims get cos 1, sin 0
                cos = torch.cat([cos, torch.ones_like(cos[..., :1]).expand(-1, -1, pad)], dim=-1)
                sin = torch.cat([sin, torch.zeros_like(sin[..., :1]).expand(-1, -1, pad)], dim=-1)
            # [S, H + 2 H_kv, D] (broadcast as [1, S, heads, D]): rotary on q and k heads, identity on v
            is_qk = torch.cat([torch.ones(1, H + Hkv, 1), torch.zeros(1, Hkv, 1)], dim=1)  # [1, heads, 1]
            # the attention scale is folded into the q heads' cos/sin: one Mul fewer per layer
            q_scale = torch.cat([torch.full((1, H, 1), self.q_scale), torch.ones(1, 2 * Hkv, 1)], dim=1)
            cos_all = ((cos * is_qk + (1 - is_qk)) * q_scale).to(x.dtype)
            sin_all = (sin * is_qk * q_scale).to(x.dtype)
        else:
            x = x + self.pos_embed(q_pos)

        new_kv: list[torch.Tensor] = []
        entering: dict[int, torch.Tensor] = {}  # layer i -> the residual stream entering it [S, hidden]
        for i, layer in enumerate(self.layers):
            entering[i] = x
            attn = _get(layer, self.arch.attn)
            qkv = self._qkv(i, attn, _get(layer, self.arch.attn_norm)(x))  # [1, S, H + 2 H_kv, D]
            if self.arch.qk_norm:  # Qwen3: per-head RMSNorm of q and k before rotary
                q, k, v = qkv.split([H, Hkv, Hkv], dim=2)
                qkv = torch.cat([attn.q_norm(q), attn.k_norm(k), v], dim=2)
            if self.rotary:
                qkv = qkv * cos_all + torch.matmul(qkv, self.rot_matrix.to(qkv.dtype)) * sin_all
            q, k, v = qkv.split([H, Hkv, Hkv], dim=2)  # k, v: [1, S, H_kv, D] = the new_* outputs
            k_all = torch.cat([past[2 * i], k], dim=1)  # [1, T, H_kv, D]
            v_all = torch.cat([past[2 * i + 1], v], dim=1)
            a = self._attention(q, k_all, v_all, mask, None if self.rotary else self._scaling(attn))
            x = x + getattr(attn, self.arch.out_proj)(a)
            x = x + self._mlp(i, layer, _get(layer, self.arch.mlp_norm)(x))
            new_kv += [k, v]

        rows = self.final_norm(x.index_select(0, logits_index))  # [R, hidden]
        if self.tie_lm_head:
            logits = nn.functional.linear(rows, self.lm_weight, self.lm_bias)  # Gemm transB: one copy
        else:
            logits = torch.matmul(rows, self.lm_weight_t)
            if self.lm_bias is not None:
                logits = logits + self.lm_bias
        logits = logits.float().unsqueeze(0)  # [1, R, V]
        if not self.feature_layers:
            return (logits, *new_kv)
        features = torch.cat([entering[i] for i in self.feature_layers], dim=-1)  # [S, F]: low | mid | high
        return (logits, features.float().unsqueeze(0), *new_kv)  # hidden_states [1, S, F] float32
