"""EAGLE-3 heads for tests: a random head folder in the published format and an independent
PyTorch reference forward, written from the EAGLE-3 paper's description with plain torch / json /
safetensors code (nothing here imports specexport, so the exporter and the loader are checked
against it, not against themselves).

One draft step over S rows, H the head's hidden size:

    e = embed(token)                                   [S, H]  the target's embedding (or the head's)
    h = fc(features)  or the head's previous hidden    [S, H]  features [S, 3 H_t] = low | mid | high
    x = [input_layernorm(e), hidden_norm(h)]           [S, 2H]
    a = o_proj(attention(q, k, v of x)) + h            [S, H]  rotary, GQA, the head's own KV cache
    hidden = a + mlp(post_attention_layernorm(a))      [S, H]  SiLU-gated MLP
    logits = lm_head(norm(hidden))                     [S, draft_vocab]; draft id i = target id i + d2t[i]

Token alignment (SafeAILab EAGLE `topK_genrate`: `input_ids = input_ids[:, 1:]` beside the
target's hidden states): head row t pairs the target's feature of position t (computed from
tokens x_0..x_t) with the embedding of token x_{t+1}, sits at head cache position t, and its
logits predict token x_{t+2}. In decoding, once the target has produced x_n and its features for
rows 0..n-1 are known, the head catches up on rows up to t = n-1 (tokens x_1..x_n) and its last
row drafts x_{n+1}; each chained step then feeds the drafted token with h = the head's own hidden
output of the row before (no features), at the next cache position, and drafts the token after.

Layer ids here are in the entering-layer convention: id i = transformers'
`output_hidden_states[i]`, the residual stream entering decoder layer i (0 = embeddings); config
files store "output of layer" ids, i.e. entering - 1.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

# Entering-layer ids of the tiny heads: the 2-layer tiny target has only ids 0 and 1, and the
# default rule (2, L//2, L-3) does not fit it. Not sorted on purpose (order is part of the format).
TINY_LAYER_IDS = (1, 0, 1)
HEAD_HEADS, HEAD_KV_HEADS, HEAD_DIM, HEAD_INTERMEDIATE = 4, 2, 16, 128
RMS_EPS = 1e-5
ROPE_THETA = 10000.0

# The head tests' probe and tolerances (both graph forms): float32 graphs against float32 PyTorch
# on the same weights, absolute (summation order only); lower precisions relative to the largest
# |value| of the compared rows (fp16 weights, activations and cache; int8 weights and activations).
PROBE_IDS = [17, 88, 203, 5, 61, 144, 9, 250, 33, 71, 120, 8, 199, 42, 66, 3]
TOL = 1e-4
HEAD_TOL = {"fp32": None, "fp16": 2e-2, "int8": 8e-2}  # relative to max |reference| (None: absolute TOL)


def assert_close_at(got: np.ndarray, want: np.ndarray, precision: str) -> None:
    """got against the reference within HEAD_TOL[precision] (module comment above)."""
    rel = HEAD_TOL[precision]
    atol = TOL if rel is None else rel * float(np.abs(want).max())
    np.testing.assert_allclose(got, want, atol=atol, rtol=0)


# ------------------------------------------------------------------------------ head folder


def make_tiny_head_folder(
    folder: Path,
    target_model,
    draft_vocab: int,
    seed: int,
    layer_ids: tuple[int, int, int] | None = None,
    *,
    config_layer_ids: bool = True,
    dtype: torch.dtype = torch.float32,
    embed_tokens: bool = False,
) -> dict:
    """Write a random EAGLE-3 head for `target_model` (a transformers causal LM, e.g. tiny.py's
    make_model("llama")) into `folder`: config.json + model.safetensors with the published names.

    H = the target's hidden size; 4 heads, 2 KV heads, head_dim 16, intermediate 128; the draft
    vocabulary is a random sorted subset of `draft_vocab` target ids, d2t = selected - arange,
    t2d True at the selected ids. Weights ~ N(0, 0.2) (norm weights 1 + N(0, 0.1)) so logits spread.
    layer_ids: entering-layer ids (default TINY_LAYER_IDS), written to config.json as
    eagle_config.eagle_aux_hidden_state_layer_ids = entering - 1; config_layer_ids=False omits
    them (the loader's default rule applies). dtype: of the float tensors (bf16 tests the cast).
    embed_tokens: also store the target's embedding as embed_tokens.weight.

    Returns {"folder", "config" (the config.json dict), "tensors" (float32 torch tensors by
    published name, d2t int64, t2d bool), "selected" (int64 [draft_vocab] target ids),
    "layer_ids" (entering ids)}."""
    tcfg = target_model.config
    H, V = int(tcfg.hidden_size), int(tcfg.vocab_size)
    ids = TINY_LAYER_IDS if layer_ids is None else tuple(layer_ids)
    gen = torch.Generator().manual_seed(seed)
    selected = torch.sort(torch.randperm(V, generator=gen)[:draft_vocab]).values.to(torch.int64)
    tensors = _random_weights(gen, H, draft_vocab)
    if embed_tokens:
        tensors["embed_tokens.weight"] = target_model.get_input_embeddings().weight.detach().float().clone()
    tensors["d2t"] = selected - torch.arange(draft_vocab, dtype=torch.int64)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[selected] = True
    tensors["t2d"] = t2d
    config = _head_config(H, V, draft_vocab, ids if config_layer_ids else None)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    stored = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}
    save_file(stored, str(folder / "model.safetensors"))
    as_loaded = {k: (v.float() if v.is_floating_point() else v) for k, v in stored.items()}
    return {"folder": folder, "config": config, "tensors": as_loaded, "selected": selected, "layer_ids": ids}


def _random_weights(gen: torch.Generator, H: int, draft_vocab: int) -> dict[str, torch.Tensor]:
    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.2

    def norm() -> torch.Tensor:
        return 1.0 + torch.randn(H, generator=gen) * 0.1

    q, kv = HEAD_HEADS * HEAD_DIM, HEAD_KV_HEADS * HEAD_DIM
    return {
        "fc.weight": w(H, 3 * H),  # [H, 3 H_t]
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": w(q, 2 * H),  # [heads * hd, 2H]
        "midlayer.self_attn.k_proj.weight": w(kv, 2 * H),  # [kv * hd, 2H]
        "midlayer.self_attn.v_proj.weight": w(kv, 2 * H),
        "midlayer.self_attn.o_proj.weight": w(H, q),  # [H, heads * hd]
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.mlp.gate_proj.weight": w(HEAD_INTERMEDIATE, H),
        "midlayer.mlp.up_proj.weight": w(HEAD_INTERMEDIATE, H),
        "midlayer.mlp.down_proj.weight": w(H, HEAD_INTERMEDIATE),
        "norm.weight": norm(),
        "lm_head.weight": w(draft_vocab, H),  # [draft_vocab, H]
    }


def _head_config(H: int, V: int, draft_vocab: int, layer_ids: tuple[int, ...] | None) -> dict:
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": H,
        "intermediate_size": HEAD_INTERMEDIATE,
        "num_attention_heads": HEAD_HEADS,
        "num_key_value_heads": HEAD_KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "rms_norm_eps": RMS_EPS,
        "rope_theta": ROPE_THETA,
        "rope_scaling": None,
        "max_position_embeddings": 512,
        "vocab_size": V,
        "draft_vocab_size": draft_vocab,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    if layer_ids is not None:
        config["eagle_config"] = {
            "use_aux_hidden_state": True,
            "eagle_aux_hidden_state_layer_ids": [i - 1 for i in layer_ids],
        }
    return config


# ------------------------------------------------------------------------- reference forward


def target_features(model, ids: list[int], layer_ids) -> torch.Tensor:
    """[S, 3 H_t]: transformers' output_hidden_states[i] of the target for the tokens `ids`
    (one sequence, from position 0), for the three entering-layer ids, concatenated in order.
    Ids must be < L: output_hidden_states[L] is after the final norm, not a residual stream."""
    L = int(model.config.num_hidden_layers)
    if any(not 0 <= int(i) < L for i in layer_ids):
        raise ValueError(f"layer ids {list(layer_ids)} outside 0..{L - 1}")
    with torch.no_grad():
        out = model(torch.tensor([list(ids)], dtype=torch.int64), output_hidden_states=True)
    return torch.cat([out.hidden_states[int(i)][0].float() for i in layer_ids], dim=-1)


def reference_fc(tensors: dict, features: torch.Tensor) -> torch.Tensor:
    """fc(features): [S, 3 H_t] @ fc.weight^T [3 H_t, H] -> [S, H] (no bias)."""
    fc = _t(tensors["fc.weight"], features.dtype)  # [H, 3 H_t]
    return features @ fc.T


def reference_step(
    tensors: dict,
    cfg: dict,
    embed: torch.Tensor,
    tokens: list[int],
    h_in: torch.Tensor,
    past: tuple[torch.Tensor, torch.Tensor] | None,
    start: int,
    dtype: torch.dtype = torch.float32,
):
    """One head call over S = len(tokens) rows at cache positions start..start+S-1.

    tensors: published names -> weights; cfg: the head's config.json dict; embed [V_t, H];
    h_in [S, H]: fc(features) (reference_fc) on rows that have target features, or the head's
    own previous hidden_out on chained steps (the caller decides, row by row);
    past: (k, v), each [kv_heads, P, head_dim] with rotary already applied to k, or None.
    Row i attends to all P past rows and to new rows 0..i (causal).
    Returns (draft_logits [S, draft_vocab], hidden_out [S, H], new_past = past + the S new rows)."""
    H = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    hd = int(cfg.get("head_dim") or H // heads)
    eps = float(cfg.get("rms_norm_eps", 1e-6))
    w = {name: _t(value, dtype) for name, value in tensors.items() if name not in ("d2t", "t2d")}
    S = len(tokens)
    e = _t(embed, dtype)[torch.tensor(tokens, dtype=torch.int64)]  # [S, H]
    h = h_in.to(dtype)  # [S, H]
    x = torch.cat(
        [_rms(e, w["midlayer.input_layernorm.weight"], eps), _rms(h, w["midlayer.hidden_norm.weight"], eps)], dim=-1
    )  # [S, 2H]
    q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(S, heads, hd).transpose(0, 1)  # [heads, S, hd]
    k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(S, kv_heads, hd).transpose(0, 1)  # [kv, S, hd]
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(S, kv_heads, hd).transpose(0, 1)  # [kv, S, hd]
    cos, sin = _rope_tables(torch.arange(start, start + S), hd, _rope_theta(cfg), dtype)  # [S, hd]
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    if past is not None:
        k = torch.cat([past[0].to(dtype), k], dim=1)  # [kv, P + S, hd]
        v = torch.cat([past[1].to(dtype), v], dim=1)
    attn = _attention(q, k, v, heads // kv_heads)  # [S, heads * hd]
    a = attn @ w["midlayer.self_attn.o_proj.weight"].T + h  # [S, H]: residual is h itself
    m = _rms(a, w["midlayer.post_attention_layernorm.weight"], eps)
    gate = torch.nn.functional.silu(m @ w["midlayer.mlp.gate_proj.weight"].T)  # [S, I]
    mlp = (gate * (m @ w["midlayer.mlp.up_proj.weight"].T)) @ w["midlayer.mlp.down_proj.weight"].T  # [S, H]
    hidden = a + mlp  # [S, H]
    logits = _rms(hidden, w["norm.weight"], eps) @ w["lm_head.weight"].T  # [S, draft_vocab]
    return logits, hidden, (k, v)


def draft_to_target(tensors: dict) -> torch.Tensor:
    """int64 [draft_vocab]: target id of each draft id (i + d2t[i])."""
    d2t = torch.as_tensor(np.asarray(tensors["d2t"]), dtype=torch.int64)
    return torch.arange(d2t.shape[0], dtype=torch.int64) + d2t


def _t(value, dtype: torch.dtype) -> torch.Tensor:
    return torch.as_tensor(np.asarray(value) if not isinstance(value, torch.Tensor) else value).to(dtype)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last axis: x / sqrt(mean(x^2) + eps) * weight."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rope_theta(cfg: dict) -> float:
    return float(cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)))


def _rope_tables(positions: torch.Tensor, hd: int, theta: float, dtype: torch.dtype):
    """cos, sin [S, hd] of the non-interleaved (rotate-half) rotary embedding."""
    inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)  # [hd / 2]
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]  # [S, hd / 2]
    angles = torch.cat([angles, angles], dim=-1)  # [S, hd]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, S, hd] rotated: x * cos + rotate_half(x) * sin, rotate_half(a | b) = (-b | a)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """q [heads, S, hd], k/v [kv, T, hd] (T = P + S; the S new rows last) -> [S, heads * hd].
    Query head j uses KV head j // groups; new row i sees cache rows 0..P+i."""
    heads, S, hd = q.shape
    T = k.shape[1]
    k = k.repeat_interleave(groups, dim=0)  # [heads, T, hd]
    v = v.repeat_interleave(groups, dim=0)
    scores = q @ k.transpose(1, 2) / math.sqrt(hd)  # [heads, S, T]
    visible = torch.arange(T)[None, :] <= (T - S + torch.arange(S))[:, None]  # [S, T]
    scores = scores.masked_fill(~visible, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v  # [heads, S, hd]
    return out.transpose(0, 1).reshape(S, heads * hd)


def assert_head_follows_reference(
    model, target, info: dict, embed: torch.Tensor, ids: list[int], close, n: int = 10, chained: int = 3
) -> None:
    """The head graph in `model` (a runtime OrtModel, either cache layout) against reference_step:
    catch-up over n rows from the target's features, then `chained` steps from the head's own
    hidden; close(got, want) asserts each logits and hidden_out block. The reference is fed its own
    hidden and tokens, so a low-precision head's error does not compound."""
    tensors, cfg = info["tensors"], info["config"]
    feats = target_features(target, ids, info["layer_ids"])  # [S, F]
    got = model.forward(ids[1 : n + 1], last_rows=n, features=feats[:n].numpy()).copy()
    want, hidden, past = reference_step(tensors, cfg, embed, ids[1 : n + 1], reference_fc(tensors, feats[:n]), None, 0)
    close(got, want.numpy())
    close(model.hidden_out, hidden.numpy())
    h_prev, token = hidden[-1:], int(want[-1].argmax())
    for step in range(chained):
        got = model.forward([token], hidden=h_prev.numpy()).copy()
        want, h_new, past = reference_step(tensors, cfg, embed, [token], h_prev, past, n + step)
        close(got, want.numpy())
        close(model.hidden_out, h_new.numpy())
        h_prev, token = h_new, int(want[-1].argmax())


def tiny_target_and_head(root: Path, draft_vocab: int = 160, seed: int = 0):
    """(a tiny random llama target, its head folder's info, the head loaded by the loader under test)."""
    from tiny import make_model

    from specexport.formats.eagle3 import TargetShape, load_eagle3_head

    target = make_model("llama")
    info = make_tiny_head_folder(root / "head", target, draft_vocab=draft_vocab, seed=seed)
    return target, info, load_eagle3_head(info["folder"], TargetShape.from_hf_config(target.config))


def assert_head_catches_up_after_rollback(
    model, target, info: dict, embed: torch.Tensor, ids: list[int], atol: float
) -> None:
    """Rows written by chained steps are dropped by a cursor move (truncate); catching up again with
    real features gives reference_step's rows: stale cache rows past the cursor are never read."""
    tensors, cfg = info["tensors"], info["config"]
    feats = target_features(target, ids, info["layer_ids"])  # [S, F]
    model.forward(ids[1:7], last_rows=1, features=feats[:6].numpy())
    for token in (5, 6, 7):  # chain rows 6, 7, 8 from own hidden: stale after the rollback
        model.forward([token], hidden=model.hidden_out[-1:].copy())
    model.truncate(6)
    got = model.forward(ids[7:12], last_rows=5, features=feats[6:11].numpy()).copy()
    want, _, _ = reference_step(tensors, cfg, embed, ids[1:12], reference_fc(tensors, feats[:11]), None, 0)
    np.testing.assert_allclose(got, want[6:].numpy(), atol=atol, rtol=0)
