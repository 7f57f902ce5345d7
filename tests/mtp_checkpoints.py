"""Tiny Qwen3.5 checkpoints carrying a random MTP layer (`mtp.*` tensors written into the folder's
model.safetensors beside the model's own), and an MTP reference written from the published
equations (vLLM's and SGLang's Qwen3.5 MTP descriptions) in plain torch; its one decoder layer
and final norm are transformers' own Qwen3.5 modules, never this project's graph code."""

from __future__ import annotations

from pathlib import Path

import torch


def mtp_tensors(text_config, seed: int = 7, echo: bool = False) -> dict[str, torch.Tensor]:
    """One random Qwen3.5 MTP layer for `text_config`: a full-attention decoder layer, fc [H, 2H]
    and three (1 + w) norms with w spread around 0 (all-zero w would hide a graph ignoring them).
    echo: a layer whose output is the hidden row rescaled (fc = [0 | I], o_proj and down_proj 0,
    norms 1), so its draft is the target's own prediction of the token it is given: it is
    accepted where the target repeats a token, which makes rounds accept some drafts and not others."""
    from transformers import Qwen3_5TextModel

    torch.manual_seed(seed)
    config = _one_layer(text_config)
    layer = Qwen3_5TextModel(config).layers[0]
    H = config.hidden_size
    out = {f"mtp.layers.0.{n}": p.detach().clone() for n, p in layer.state_dict().items()}
    for name in out:
        if name.endswith("norm.weight"):
            out[name] = 0.3 * torch.randn_like(out[name])
    out["mtp.fc.weight"] = torch.randn(H, 2 * H) / (2 * H) ** 0.5
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        out[f"mtp.{name}.weight"] = 0.3 * torch.randn(H)
    if echo:  # every norm 1 + 0, the layer's two output projections 0: out = h / rms(h)
        zero = ("norm", "o_proj", "down_proj")
        out = {k: torch.zeros_like(v) if any(z in k for z in zero) else v for k, v in out.items()}
        out["mtp.fc.weight"] = torch.cat([torch.zeros(H, H), torch.eye(H)], 1)
    return out


def add_mtp(folder: Path, text_config, seed: int = 7, echo: bool = False) -> dict[str, torch.Tensor]:
    """Write an MTP layer into `folder`'s model.safetensors (its tensors kept); returns its tensors."""
    from safetensors.torch import load_file, save_file

    path = Path(folder) / "model.safetensors"
    tensors = load_file(str(path))
    mtp = mtp_tensors(text_config, seed, echo)
    save_file({**tensors, **{k: v.contiguous() for k, v in mtp.items()}}, str(path), metadata={"format": "pt"})
    return mtp


def _one_layer(text_config):
    import copy

    config = copy.deepcopy(text_config)
    config.num_hidden_layers, config.layer_types = 1, ["full_attention"]
    return config


def _rms1(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's RMSNorm: x / rms(x) * (1 + w), in float32."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


class MtpReference:
    """The MTP equations per row t at position t, with h_t the given hidden row (the target's
    final-normed hidden state of position t) or, where None, the previous row's output:

        x_t   = fc([rms(embed(id_t)) (1 + w_e), rms(h_t) (1 + w_h)])
        y     = decoder layer over x_0 .. x_t (causal)       out_t = norm(y_t)
        logits_t = lm_head(out_t)
    """

    def __init__(self, text_config, tensors: dict[str, torch.Tensor], embed: torch.Tensor, head: torch.Tensor):
        from transformers import Qwen3_5TextModel

        config = _one_layer(text_config)
        self.model = Qwen3_5TextModel(config).eval()  # its layer and norm are the MTP's
        state = {k[len("mtp.") :]: v for k, v in tensors.items() if k.startswith(("mtp.layers.", "mtp.norm."))}
        state["embed_tokens.weight"] = embed
        self.model.load_state_dict(state, strict=True)
        self.t, self.eps = tensors, config.rms_norm_eps
        self.embed, self.head = embed.float(), head.float()

    @torch.no_grad()
    def rows(self, ids, hidden: list[torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [n], hidden: n rows [H] or None -> (logits [n, V], out [n, H])."""
        xs, outs = [], []
        for t, token in enumerate(ids):
            h = hidden[t] if hidden[t] is not None else outs[-1]
            e = _rms1(self.embed[int(token)], self.t["mtp.pre_fc_norm_embedding.weight"], self.eps)
            hn = _rms1(h.float(), self.t["mtp.pre_fc_norm_hidden.weight"], self.eps)
            xs.append(torch.cat([e, hn]) @ self.t["mtp.fc.weight"].t())
            y = self.model(inputs_embeds=torch.stack(xs)[None], position_ids=torch.arange(t + 1)[None])
            outs.append(y.last_hidden_state[0, -1])
        out = torch.stack(outs)
        return out @ self.head.t(), out
