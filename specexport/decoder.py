"""The shared decoder: wraps a Hugging Face *ForCausalLM and exposes the graph contract.

forward(input_ids, logits_index, past_key_0, past_value_0, ...) ->
    (logits, [hidden_states,] new_key_0, new_value_0, ...)
exactly as docs/graph-contract.md states (hidden_states only with feature_layers, contract 1.2;
position_ids and tree_bias after logits_index in the tree-verify form, contract 1.9; slot_rows
after logits_index and per-slot caches with several cache slots, contract 1.10).
The HF model's norms and weights are used as they are; attention, rotary, the causal (and
per-layer sliding-window) mask over [past, new] and the row-gathered output projection are
written here once for every family. What differs between families comes from the family's row
(architectures.py) and the normalized config (model_config.py): the norms around attention and
MLP, q/k norms, windows, one rotary table per layer type or none (NoPE layers), partial rotary,
softcaps and multipliers.

The traced graph is kept small because on a CPU, and more so for a quantized draft, per-node
overhead rivals the matrix work (docs/performance.md): q|k|v and gate|up are one MatMul each,
rotary is one [D, D] signed-permutation MatMul on q|k|v at once (cos = 1, sin = 0 on v heads,
so v passes exactly), reshapes use constant shapes, and positions/masks are computed once.
"""

from __future__ import annotations

import torch
from torch import nn

from .architectures import module_at
from .model_config import NormalizedConfig, UnsupportedConfig, check_hf_modules, normalize

__all__ = ["ContractDecoder", "UnsupportedConfig", "call_positions", "past_positions", "rotary_inv_freq"]


# Positions from shapes only, so that a traced graph stays dynamic in S and P.
def past_positions(past_key: torch.Tensor) -> torch.Tensor:
    """0 .. P-1 [P] of a past key [1, P, H_kv, D]."""
    return torch.cumsum(torch.ones_like(past_key[0, :, 0, 0], dtype=torch.int64), 0) - 1


def call_positions(past_pos: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """P .. P+S-1 [S] of a chain call's S ids after the past positions [P]."""
    return torch.cumsum(torch.ones_like(ids), 0) - 1 + past_pos.numel()


def _linear_parts(*modules: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate nn.Linear weights [out_i, in] -> [sum out, in] (bias zeros where absent)."""
    weight = torch.cat([m.weight.detach() for m in modules], dim=0)
    if all(m.bias is None for m in modules):
        return weight, None
    bias = torch.cat(
        [
            m.bias.detach() if m.bias is not None else torch.zeros(m.weight.shape[0], dtype=m.weight.dtype)
            for m in modules
        ]
    )
    return weight, bias


def rotary_inv_freq(model: nn.Module, norm: NormalizedConfig) -> dict[str, tuple[torch.Tensor, float]]:
    """rope key -> (inv_freq [rotary_dim / 2] float32, attention_scaling) as transformers' rotary
    module holds them (its initial tables: bounded kinds equal them below their bound)."""
    rotary = module_at(model, f"{norm.arch.decoder}.rotary_emb")
    tables = {}
    for key, _ in norm.ropes:
        prefix = "" if key == "all" else f"{key}_"
        inv = getattr(rotary, f"{prefix}original_inv_freq", None)
        if inv is None:
            inv = getattr(rotary, f"{prefix}inv_freq")
        scale = getattr(rotary, f"{prefix}attention_scaling", None)
        if scale is None:
            scale = rotary.attention_scaling
        inv = inv.detach().float().clone()
        if 2 * inv.shape[0] != norm.rotary_dim:
            raise UnsupportedConfig(
                f"rotary table {key!r} covers {2 * inv.shape[0]} dims; the config says {norm.rotary_dim}"
            )
        tables[key] = (inv, float(scale))
    return tables


class ContractDecoder(nn.Module):
    def __init__(
        self,
        model: nn.Module,
        norm: NormalizedConfig | None = None,
        tie_lm_head: bool = True,
        feature_layers: tuple[int, ...] = (),
        tree: bool = False,
        slots: int = 1,
    ):
        """tie_lm_head=False stores the output projection as its own [hidden, V] MatMul weight,
        so that weight-only quantizers (which act on MatMul) also compress it (drafts).
        feature_layers: indices i of the residual streams entering decoder layer i (transformers'
        output_hidden_states[i], 0 <= i < layers), returned in that order as one more output
        `hidden_states` [1, S, len * hidden] float32 for every input row (contract 1.2: what an
        EAGLE-3 head reads; the fused graph's output of the same name).
        tree: the tree-verify form (contract 1.9): forward takes position_ids [1, S] and tree_bias
        [S, S] after logits_index, and each row attends to the past and its ancestors (_tree_masks).
        slots: K > 1 cache slots (contract 1.10): forward takes slot_rows [K] after logits_index
        and each slot's caches; the rows are packed slot after slot and each slot's attend over
        its own past with the batch-1 graph's operators."""
        super().__init__()
        if slots < 1 or (slots > 1 and (tree or feature_layers)):
            raise UnsupportedConfig(f"slots must be >= 1, and a graph of several has no tree or features; got {slots}")
        self.tree, self.slots = tree, slots
        self.cfg = cfg = norm or normalize(model.config)
        check_hf_modules(model, cfg)
        self.arch = arch = cfg.arch
        self.model = model
        base = module_at(model, arch.decoder)
        self.embed = module_at(base, arch.embed)
        self.layers = module_at(base, arch.layers)
        bad = [i for i in feature_layers if not 0 <= i < len(self.layers)]
        if bad:
            raise UnsupportedConfig(f"feature layers {bad} are outside the target's 0..{len(self.layers) - 1}")
        self.feature_layers = tuple(feature_layers)
        self.final_norm = module_at(base, arch.final_norm)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.hidden_size = cfg.hidden
        self.embedding_rows = self.embed.weight.shape[0]
        self.tie_lm_head = tie_lm_head
        head = model.get_output_embeddings()
        self.lm_weight, self.lm_bias = head.weight, getattr(head, "bias", None)  # [V, hidden]
        if not tie_lm_head:
            self.lm_weight_t = nn.Parameter(self.lm_weight.detach().t().contiguous(), requires_grad=False)
        self._fuse_weights()
        if arch.positions == "rope":
            self._init_rotary(model)
        else:
            self.pos_embed = module_at(base, arch.position_embed)

    # --- construction -------------------------------------------------------------------
    def _fuse_weights(self) -> None:
        """Per layer: one q|k|v weight [(H + 2 H_kv) D, hidden] (+ bias) and one gate|up weight (+ bias)."""
        self.qkv_w, self.qkv_b = nn.ParameterList(), nn.ParameterList()
        self.gate_up_w, self.gate_up_b = nn.ParameterList(), nn.ParameterList()
        self._has_qkv_bias = self._has_mlp_bias = False
        for layer in self.layers:
            attn, mlp = module_at(layer, self.arch.attn), module_at(layer, self.arch.mlp)
            if self.arch.qkv == "separate":
                w, b = _linear_parts(attn.q_proj, attn.k_proj, attn.v_proj)
                self.qkv_w.append(nn.Parameter(w, requires_grad=False))
                if b is not None:
                    self._has_qkv_bias = True
                    self.qkv_b.append(nn.Parameter(b, requires_grad=False))
            if self.arch.mlp_kind == "gated":
                w, b = _linear_parts(mlp.gate_proj, mlp.up_proj)
                self.gate_up_w.append(nn.Parameter(w, requires_grad=False))
                if b is not None:
                    self._has_mlp_bias = True
                    self.gate_up_b.append(nn.Parameter(b, requires_grad=False))

    def _init_rotary(self, model: nn.Module) -> None:
        self.rope_keys = [key for key, _ in self.cfg.ropes]
        for n, (_, (inv_freq, scale)) in enumerate(rotary_inv_freq(model, self.cfg).items()):
            self.register_buffer(f"inv_freq_{n}", inv_freq, persistent=False)  # [rot / 2]
            setattr(self, f"rope_scale_{n}", scale)
        rot, D = self.cfg.rotary_dim, self.head_dim
        # rotate_half as a signed permutation: (x @ R)[j] = -x[j + rot/2] (j < rot/2), x[j - rot/2] (j < rot)
        R = torch.zeros(D, D)
        half = rot // 2
        for j in range(half):
            R[j + half, j] = -1.0
            R[j, j + half] = 1.0
        self.register_buffer("rot_matrix", R, persistent=False)

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

    def _qk_norm(self, attn: nn.Module, qkv: torch.Tensor) -> torch.Tensor:
        """RMSNorm of q and k (HF's own modules): per head [1, S, heads, D], or over all heads [1, S, heads D]."""
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = qkv.split([H, Hkv, Hkv], dim=2)
        if self.arch.qk_norm == "head":
            q, k = attn.q_norm(q), attn.k_norm(k)
        else:
            q = attn.q_norm(q.reshape(1, -1, H * D)).reshape(1, -1, H, D)
            k = attn.k_norm(k.reshape(1, -1, Hkv * D)).reshape(1, -1, Hkv, D)
        return torch.cat([q, k, v], dim=2)

    def _mlp(self, i: int, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        mlp = module_at(layer, self.arch.mlp)
        if self.arch.mlp_kind == "module":
            return mlp(x)
        if self.arch.mlp_kind == "gated":
            bias = self.gate_up_b[i] if self._has_mlp_bias else None
            gate_up, act = nn.functional.linear(x, self.gate_up_w[i], bias), mlp.act_fn
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
        if self.cfg.attn_softcap is not None:
            cap = self.cfg.attn_softcap
            scores = torch.tanh(scores / cap) * cap
        scores = scores + mask
        probs = torch.softmax(scores, dim=-1).to(vg.dtype)
        out = torch.matmul(probs, vg)  # [H_kv, rep, S, D]
        return out.permute(2, 0, 1, 3).reshape(-1, self.num_heads * D)

    def _rotary(self, q_pos: torch.Tensor, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """rope key -> (cos, sin) [S, H + 2 H_kv, D] (broadcast as [1, S, heads, D]): rotary on q and
        k heads, identity on v heads and past rotary_dim; the attention scale folded into q's heads."""
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        is_qk = torch.cat([torch.ones(1, H + Hkv, 1), torch.zeros(1, Hkv, 1)], dim=1)  # [1, heads, 1]
        q_scale = torch.cat([torch.full((1, H, 1), self.cfg.attn_scale), torch.ones(1, 2 * Hkv, 1)], dim=1)
        tables = {}
        for n, key in enumerate(self.rope_keys):
            freqs = q_pos.float().unsqueeze(1) * getattr(self, f"inv_freq_{n}").unsqueeze(0)  # [S, rot/2]
            scale = getattr(self, f"rope_scale_{n}")
            emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)  # [S, 1, rot]
            cos, sin = emb.cos() * scale, emb.sin() * scale
            pad = D - 2 * freqs.shape[1]
            if pad:  # partial rotary: the pass-through dims get cos 1, sin 0
                cos = torch.cat([cos, torch.ones_like(cos[..., :1]).expand(-1, -1, pad)], dim=-1)
                sin = torch.cat([sin, torch.zeros_like(sin[..., :1]).expand(-1, -1, pad)], dim=-1)
            tables[key] = (((cos * is_qk + (1 - is_qk)) * q_scale).to(dtype), (sin * is_qk * q_scale).to(dtype))
        return tables

    def _branch(self, layer: nn.Module, post: str | None, out: torch.Tensor) -> torch.Tensor:
        """An attention or MLP output as added to the residual stream: post-norm, multiplier."""
        if post is not None:
            out = module_at(layer, post)(out)
        if self.cfg.residual_multiplier is not None:
            out = out * self.cfg.residual_multiplier
        return out

    def _chain_masks(self, past_pos: torch.Tensor, q_pos: torch.Tensor) -> dict:
        """window -> additive mask [S, T] fp32 of a chain call: causal over [past, new] (rows at
        positions P .. P+S-1); a window hides the keys `window` or more positions back."""
        k_pos = torch.cat([past_pos, q_pos])  # [T]
        causal = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)  # [S, T], T = P + S
        masks = {None: torch.where(causal, 0.0, torch.finfo(torch.float32).min)}
        for window in self.cfg.windows:  # a query sees the `window` most recent keys, itself included
            allowed = causal & (k_pos.unsqueeze(0) > q_pos.unsqueeze(1) - window)
            masks[window] = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
        return masks

    def _slot_rows(self, ids: torch.Tensor, slot_rows: torch.Tensor | None, past: tuple) -> list:
        """Per slot: (its rows' span in the packed call or None for all of them, positions [n],
        masks by window). One slot (slot_rows None): the whole call at the past's length."""
        K = self.slots
        ends = torch.cumsum(slot_rows, 0) if slot_rows is not None else None  # [K]
        out = []
        for b in range(K):
            past_pos = past_positions(past[2 * b])  # [P_b] from layer 0's past key of slot b
            span = None if ends is None else (ends[b] - slot_rows[b], ends[b])
            rows = ids if span is None else ids[span[0] : span[1]]  # [n_b]
            q_pos = call_positions(past_pos, rows)  # [n_b]: P_b .. P_b+n_b-1
            out.append((span, q_pos, self._chain_masks(past_pos, q_pos)))
        return out

    def _tree_masks(self, past_pos: torch.Tensor, q_pos: torch.Tensor, tree_bias: torch.Tensor) -> dict:
        """window -> additive mask [S, T] fp32 of a tree call: the whole past (positions < P <=
        every row's), then tree_bias [S, S] over the call's rows (its ancestors and itself); a
        window also hides the keys at or below the row's position - window, as a chain decoding
        of the row's path would (positions: past 0 .. P-1, new rows P + depth)."""
        lowest = torch.finfo(torch.float32).min
        past = torch.where(past_pos.unsqueeze(0) <= q_pos.unsqueeze(1), 0.0, lowest)  # [S, P]: zeros
        masks = {None: torch.cat([past, tree_bias.float()], dim=1)}  # [S, T]
        k_pos = torch.cat([past_pos, q_pos])  # [T]
        for window in self.cfg.windows:  # Min, not a sum: two lowest values would overflow to -inf
            inside = torch.where(k_pos.unsqueeze(0) > q_pos.unsqueeze(1) - window, 0.0, lowest)
            masks[window] = torch.minimum(masks[None], inside)
        return masks

    # --- forward ------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, logits_index: torch.Tensor, *past: torch.Tensor):
        # input_ids: [1, S] (K slots: [1, N], every slot's rows packed); logits_index: [R]; past:
        # 2 * L tensors [1, P, H_kv, D], after position_ids [1, S] (P + depth) and tree_bias [S, S]
        # in the tree form; K slots: slot_rows [K] first, then 2 * L * K (layer i, slot b at 2 (i K + b))
        cfg, arch = self.cfg, self.arch
        ids = input_ids.reshape(-1)  # [S]
        H, Hkv, K = self.num_heads, self.num_kv_heads, self.slots
        slot_rows = None
        if self.tree:
            position_ids, tree_bias, *past = past
        elif K > 1:
            slot_rows, *past = past
        if self.tree:
            past_pos = past_positions(past[0])  # [P]
            q_pos = position_ids.reshape(-1)  # [S]: P + depth
            slots = [(None, q_pos, self._tree_masks(past_pos, q_pos, tree_bias))]
        else:
            slots = self._slot_rows(ids, slot_rows, tuple(past))  # per slot: (span, positions, masks)
            q_pos = slots[0][1] if K == 1 else torch.cat([p for _, p, _ in slots])  # [S]

        x = self.embed(ids)  # [S, hidden]
        if arch.embed_scale and not hasattr(self.embed, "embed_scale"):
            # transformers >= 5 scales inside the embedding module (GemmaTextScaledWordEmbedding)
            x = x * torch.tensor(self.hidden_size**0.5, dtype=x.dtype)
        if cfg.embedding_multiplier is not None:
            x = x * cfg.embedding_multiplier
        if arch.positions == "rope":
            rotary = self._rotary(q_pos, x.dtype)
        else:
            x = x + self.pos_embed(q_pos)

        new_kv: list[torch.Tensor] = []
        entering: dict[int, torch.Tensor] = {}  # layer i -> the residual stream entering it [S, hidden]
        for i, layer in enumerate(self.layers):
            spec = cfg.layers[i]
            entering[i] = x
            attn = module_at(layer, arch.attn)
            h = module_at(layer, arch.attn_norm)(x) if arch.attn_norm else x
            qkv = self._qkv(i, attn, h)  # [1, S, H + 2 H_kv, D]
            if arch.qk_norm:
                qkv = self._qk_norm(attn, qkv)
            scaling = cfg.attn_scale
            if spec.rope is not None:
                cos_all, sin_all = rotary[spec.rope]
                qkv = qkv * cos_all + torch.matmul(qkv, self.rot_matrix.to(qkv.dtype)) * sin_all
                scaling = None  # folded into q by the rotary tables
            q, k, v = qkv.split([H, Hkv, Hkv], dim=2)  # k, v: [1, S, H_kv, D] = the new_* outputs
            outs = []
            for b, (span, _, masks) in enumerate(slots):  # slot b: its rows against its own past
                qb, kb, vb = (q, k, v) if span is None else (t[:, span[0] : span[1]] for t in (q, k, v))
                k_all = torch.cat([past[2 * (i * K + b)], kb], dim=1)  # [1, T_b, H_kv, D]
                v_all = torch.cat([past[2 * (i * K + b) + 1], vb], dim=1)
                outs.append(self._attention(qb, k_all, v_all, masks[spec.window], scaling))  # [n_b, H D]
                new_kv += [kb, vb]
            a = outs[0] if K == 1 else torch.cat(outs, dim=0)  # [S, H D]
            x = x + self._branch(layer, arch.attn_post_norm, getattr(attn, arch.out_proj)(a))
            h = module_at(layer, arch.mlp_norm)(x) if arch.mlp_norm else x
            x = x + self._branch(layer, arch.mlp_post_norm, self._mlp(i, layer, h))

        rows = self.final_norm(x.index_select(0, logits_index))  # [R, hidden]
        if self.tie_lm_head:
            logits = nn.functional.linear(rows, self.lm_weight, self.lm_bias)  # Gemm transB: one copy
        else:
            logits = torch.matmul(rows, self.lm_weight_t)
            if self.lm_bias is not None:
                logits = logits + self.lm_bias
        if cfg.logits_divisor is not None:
            logits = logits / cfg.logits_divisor
        if cfg.final_softcap is not None:
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        logits = logits.float().unsqueeze(0)  # [1, R, V]
        if not self.feature_layers:
            return (logits, *new_kv)
        features = torch.cat([entering[i] for i in self.feature_layers], dim=-1)  # [S, F]: low | mid | high
        return (logits, features.float().unsqueeze(0), *new_kv)  # hidden_states [1, S, F] float32
