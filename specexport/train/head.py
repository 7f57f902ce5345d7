"""The EAGLE-3 head in torch for `specexport train-draft`: its modules, training-time test
(ttt_forward), the loss (ttt_losses) and agreement, initialisation from the target and export to
the published format (train_draft.py's docstring gives the alignment)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specexport_runtime.constants import default_feature_layers

from ..formats.eagle3 import Eagle3Config, Eagle3Head
from ..models.config import normalize

# ---------------------------------------------------------------------------------- the head


@dataclass(frozen=True)
class HeadShape:
    hidden: int  # H (= the target's hidden size)
    target_hidden: int  # H_t
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    rope_theta: float
    draft_vocab: int


class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _linear(n_in: int, n_out: int) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=False)


class _Attention(nn.Module):
    def __init__(self, s: HeadShape):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = s.heads, s.kv_heads, s.head_dim
        self.q_proj = _linear(2 * s.hidden, s.heads * s.head_dim)
        self.k_proj = _linear(2 * s.hidden, s.kv_heads * s.head_dim)
        self.v_proj = _linear(2 * s.hidden, s.kv_heads * s.head_dim)
        self.o_proj = _linear(s.heads * s.head_dim, s.hidden)


class _MLP(nn.Module):
    def __init__(self, s: HeadShape):
        super().__init__()
        self.gate_proj = _linear(s.hidden, s.intermediate)
        self.up_proj = _linear(s.hidden, s.intermediate)
        self.down_proj = _linear(s.intermediate, s.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Midlayer(nn.Module):
    def __init__(self, s: HeadShape):
        super().__init__()
        self.input_layernorm = _RMSNorm(s.hidden, s.eps)
        self.hidden_norm = _RMSNorm(s.hidden, s.eps)
        self.self_attn = _Attention(s)
        self.post_attention_layernorm = _RMSNorm(s.hidden, s.eps)
        self.mlp = _MLP(s)


class Eagle3Draft(nn.Module):
    """The trainable head; its state_dict names are exactly the published ones (formats/eagle3.py).
    The token embedding is the target's, frozen, passed in (never a parameter, never saved)."""

    def __init__(self, shape: HeadShape):
        super().__init__()
        self.shape = shape
        self.fc = _linear(3 * shape.target_hidden, shape.hidden)
        self.midlayer = _Midlayer(shape)
        self.norm = _RMSNorm(shape.hidden, shape.eps)
        self.lm_head = _linear(shape.hidden, shape.draft_vocab)

    def step(
        self, e: torch.Tensor, h: torch.Tensor, positions: torch.Tensor, cache: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """One training-time-test step k = len(cache) over S_k rows (module docstring).

        e [B, S_k, H] embeddings of the step's tokens; h [B, S_k, H] fc(features) at step 0 or the
        step-(k-1) hidden output of the same rows; positions [S_k] rotary positions (t + k).
        cache: (K_i, V_i) of steps 0..k-1, each [B, kv_heads, S_i, hd] rotated (S_i >= S_k); this
        step's keys are appended. Row t attends to the step-0 rows 0..t (causal) and to its own
        row of steps 1..k. Returns the hidden output [B, S_k, H]."""
        m, a = self.midlayer, self.midlayer.self_attn
        B, S, _ = h.shape
        x = torch.cat([m.input_layernorm(e), m.hidden_norm(h)], dim=-1)  # [B, S, 2H]
        q = a.q_proj(x).view(B, S, a.heads, a.head_dim).transpose(1, 2)  # [B, nh, S, hd]
        k = a.k_proj(x).view(B, S, a.kv_heads, a.head_dim).transpose(1, 2)  # [B, nkv, S, hd]
        v = a.v_proj(x).view(B, S, a.kv_heads, a.head_dim).transpose(1, 2)
        cos, sin = _rope(positions, a.head_dim, self.shape.rope_theta)  # [S, hd]
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        cache.append((k, v))
        step = len(cache) - 1
        groups = a.heads // a.kv_heads
        keys = torch.cat([ck[:, :, :S] for ck, _ in cache], dim=2).repeat_interleave(
            groups, dim=1
        )  # [B, nh, (k+1)S, hd]
        values = torch.cat([cv[:, :, :S] for _, cv in cache], dim=2).repeat_interleave(groups, dim=1)
        rows = torch.arange(S)
        causal = rows[None, :] <= rows[:, None]  # [S, S] block of the step-0 keys
        own = torch.eye(S, dtype=torch.bool).repeat(1, step)  # [S, k S]: row t sees its own row of steps 1..k
        mask = torch.cat([causal, own], dim=1)  # [S, (k+1) S]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)  # [B, nh, S, hd]
        out = a.o_proj(out.transpose(1, 2).reshape(B, S, a.heads * a.head_dim))
        r = out + h  # the attention block's residual is h itself
        return r + m.mlp(m.post_attention_layernorm(r))  # [B, S, H]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))  # [.., draft_vocab]


def _rope(positions: torch.Tensor, hd: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [S, hd] of the rotate-half rotary embedding (plain, unscaled: what the published
    format supports)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def ttt_forward(
    model: Eagle3Draft, embed: torch.Tensor, features: torch.Tensor, ids: torch.Tensor, steps: int
) -> list[torch.Tensor]:
    """Head logits of every training-time-test step (module docstring, "Alignment").

    embed [V_t, H] the target's embedding; features [B, S, 3 H_t] (row t from tokens x_0..x_t);
    ids [B, S]. Returns logits_k [B, S - 1 - k, draft_vocab] for k < steps: row t of step k
    predicts x_{t+2+k} and is trained against the target's logits row t+1+k."""
    S = ids.shape[1]
    cache: list[tuple[torch.Tensor, torch.Tensor]] = []
    h = model.fc(features[:, : S - 1])  # [B, S-1, H]: step 0 rows t = 0..S-2
    out = []
    for k in range(steps):
        n = S - 1 - k  # rows whose token x_{t+1+k} and target row t+1+k exist
        if n <= 0:
            break
        e = F.embedding(ids[:, 1 + k : 1 + k + n], embed)  # [B, n, H]: x_{t+1+k}
        h = model.step(e, h[:, :n], torch.arange(n) + k, cache)  # same row t, position t + k
        out.append(model.logits(h))
    return out


@dataclass
class TargetBatch:
    """The frozen target's view of a batch of right-padded windows."""

    ids: torch.Tensor  # int64 [B, S]
    features: torch.Tensor  # float32 [B, S, 3 H_t]
    draft_logits: (
        torch.Tensor | None
    )  # float32 [B, S, draft_vocab]: target logits at the draft ids (None for evaluation)
    argmax: torch.Tensor  # int64 [B, S]: argmax of the full target logits
    rows: torch.Tensor  # bool [B, S]: target rows in the loss region


def ttt_losses(logits: Sequence[torch.Tensor], batch: TargetBatch, t2d: torch.Tensor) -> list[torch.Tensor]:
    """Loss of every step k (module docstring): the soft cross-entropy -sum_v p_v log q_v of the
    head's draft softmax q (logits_k row t) against p = softmax of the target's logits row t+1+k
    restricted to the draft columns (renormalised over the draft vocabulary, temperature 1),
    averaged over the kept rows: loss region, and the target's full argmax in the draft vocabulary
    (t2d bool [V_t]), as EAGLE does."""
    losses = []
    for k, lg in enumerate(logits):
        n = lg.shape[1]
        target = batch.draft_logits[:, 1 + k : 1 + k + n]  # [B, n, Vd]: target rows t+1+k
        keep = batch.rows[:, 1 + k : 1 + k + n] & t2d[batch.argmax[:, 1 + k : 1 + k + n]]  # [B, n]
        p = torch.softmax(target, dim=-1)
        ce = -(p * torch.log_softmax(lg, dim=-1)).sum(-1)  # [B, n]
        losses.append((ce * keep).sum() / keep.sum().clamp_min(1))
    return losses


def agreement_counts(
    logits: Sequence[torch.Tensor], batch: TargetBatch, draft_ids: torch.Tensor
) -> list[tuple[int, int]]:
    """Per step k: (rows where draft_ids[argmax head] == the target's argmax, loss-region rows)."""
    counts = []
    for k, lg in enumerate(logits):
        n = lg.shape[1]
        rows = batch.rows[:, 1 + k : 1 + k + n]
        hit = (draft_ids[lg.argmax(-1)] == batch.argmax[:, 1 + k : 1 + k + n]) & rows
        counts.append((int(hit.sum()), int(rows.sum())))
    return counts


def default_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """formats/eagle3.py's default rule: entering layers (2, L // 2, L - 3)."""
    return default_feature_layers(num_layers)


def head_shape(config, draft_vocab: int) -> HeadShape:
    """One decoder layer's worth of the target (its heads, KV heads, head_dim, intermediate size),
    at the target's hidden size, from its normalized config; rope: the theta of the target's
    full-attention layers, unscaled."""
    norm = normalize(config)
    return HeadShape(
        hidden=norm.hidden,
        target_hidden=norm.hidden,
        heads=norm.heads,
        kv_heads=norm.kv_heads,
        head_dim=norm.head_dim,
        intermediate=norm.intermediate,
        eps=norm.norm_eps,
        rope_theta=norm.head_rope_theta,
        draft_vocab=draft_vocab,
    )


def init_from_target(model: Eagle3Draft, target, draft_ids: torch.Tensor, seed: int) -> str:
    """Initialise the head from the target (returns a one-line description for training.json):
    - midlayer from the target's LAST decoder layer where names and shapes match: o_proj, the MLP,
      post_attention_layernorm; q/k/v: the target's [out, H] weights in the hidden half (input
      columns H..2H, fed by hidden_norm(h)) and N(0, initializer_range) in the embedding half;
      hidden_norm = the layer's input_layernorm, input_layernorm = ones;
    - fc: identity on the high feature block (the stream entering layer L-3, the closest to the
      last layer's input) and zeros on the low and mid blocks, so the head starts as a shortcut
      through the target's last layer;
    - norm: the target's final norm; lm_head: the target's lm_head rows of the draft vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    std = float(getattr(target.config, "initializer_range", 0.02) or 0.02)
    for p in model.parameters():
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=gen) * std if p.ndim == 2 else torch.ones(p.shape))
    done, skipped = [], []
    H = model.shape.hidden
    decoder = getattr(target, "model", None)
    layers = getattr(decoder, "layers", None)
    last = layers[-1] if layers is not None and len(layers) else None
    own = dict(model.named_parameters())

    def take(dst: str, module, names: str, columns: slice | None = None) -> None:
        src = module
        for part in names.split("."):
            src = getattr(src, part, None)
        w = own[dst]
        target_w = w[:, columns] if columns is not None else w
        if not isinstance(src, torch.Tensor) or tuple(src.shape) != tuple(target_w.shape):
            skipped.append(dst)
            return
        with torch.no_grad():
            target_w.copy_(src.detach().float())
        done.append(dst)

    if last is not None:
        hidden_half = slice(H, 2 * H)
        for name in ("q_proj", "k_proj", "v_proj"):
            take(f"midlayer.self_attn.{name}.weight", last, f"self_attn.{name}.weight", hidden_half)
        take("midlayer.self_attn.o_proj.weight", last, "self_attn.o_proj.weight")
        for name in ("gate_proj", "up_proj", "down_proj"):
            take(f"midlayer.mlp.{name}.weight", last, f"mlp.{name}.weight")
        take("midlayer.post_attention_layernorm.weight", last, "post_attention_layernorm.weight")
        take("midlayer.hidden_norm.weight", last, "input_layernorm.weight")
    if decoder is not None:
        take("norm.weight", decoder, "norm.weight")
    with torch.no_grad():
        fc = own["fc.weight"]
        fc.zero_()
        fc[:, 2 * H : 3 * H] = torch.eye(H)
        head = target.get_output_embeddings()
        if head is not None and tuple(head.weight.shape[1:]) == (H,):
            own["lm_head.weight"].copy_(head.weight.detach().float()[draft_ids])
            done.append("lm_head.weight")
        else:
            skipped.append("lm_head.weight")
    note = (
        f"from the target's last decoder layer, final norm and lm_head ({len(done)} tensors);"
        " fc = identity on the high block"
    )
    return note + (f"; random: {', '.join(skipped)}" if skipped else "")


def export_head(
    model: Eagle3Draft, draft_ids: torch.Tensor, vocab: int, layer_ids: Sequence[int], reason: str
) -> Eagle3Head:
    s = model.shape
    config = Eagle3Config(
        hidden_size=s.hidden,
        target_hidden_size=s.target_hidden,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        head_dim=s.head_dim,
        intermediate_size=s.intermediate,
        rms_norm_eps=s.eps,
        rope_theta=s.rope_theta,
        rope_scaling=None,
        draft_vocab_size=s.draft_vocab,
        vocab_size=vocab,
        hidden_act="silu",
        layer_ids=tuple(layer_ids),
        layer_ids_source="recipe",
        layer_ids_reason=reason,
    )
    ids = draft_ids.numpy().astype(np.int64)
    t2d = np.zeros(vocab, dtype=np.bool_)
    t2d[ids] = True
    weights = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    return Eagle3Head(config=config, weights=weights, d2t=ids - np.arange(len(ids), dtype=np.int64), t2d=t2d)
