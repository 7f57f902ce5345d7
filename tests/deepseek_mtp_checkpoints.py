"""Tiny dense checkpoints carrying a random DeepSeek-style MTP layer, written into the folder's
model.safetensors beside the model's own tensors in one of two layouts, and an MTP reference
written from the published equations (the DeepSeek-V3 report's MTP module; vLLM's deepseek_mtp /
mimo_mtp and SGLang's deepseek_nextn descriptions) in plain torch. Its decoder layer and output
norm are transformers' own modules of the target's family, never this project's graph code.

    deepseek_v3   model.layers.{L}.{enorm, hnorm, eh_proj, shared_head.norm, shared_head.head,
                  embed_tokens} + the block under model.layers.{L}.*      (L = num_hidden_layers)
    mimo          model.mtp_layers.{i}.{token_layernorm, hidden_layernorm, input_proj,
                  final_layernorm} + the block under model.mtp_layers.{i}.*
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

# layout -> (fc, embedding norm, hidden norm, output norm), relative to the layer's prefix
NAMES = {
    "deepseek_v3": ("eh_proj", "enorm", "hnorm", "shared_head.norm"),
    "mimo": ("input_proj", "token_layernorm", "hidden_layernorm", "final_layernorm"),
}


def prefix(layout: str, config, index: int = 0) -> str:
    if layout == "mimo":
        return f"model.mtp_layers.{index}."
    return f"model.layers.{config.num_hidden_layers + index}."


def one_layer(config):
    config = copy.deepcopy(config)
    config.num_hidden_layers = 1
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = ["full_attention"]
    return config


def _block(config) -> dict[str, torch.Tensor]:
    """A random decoder layer of the target's family: transformers' own layer, its norms spread
    around 1 (all-one weights would hide a graph ignoring them)."""
    from transformers import AutoModel

    layer = AutoModel.from_config(one_layer(config)).layers[0]
    out = {n: p.detach().clone() for n, p in layer.state_dict().items()}
    for name in out:
        if name.endswith("norm.weight"):
            out[name] = 1.0 + 0.3 * torch.randn_like(out[name])
    return out


def mtp_tensors(
    config, layout: str, seed: int = 7, echo: bool = False, index: int = 0, target=None
) -> dict[str, torch.Tensor]:
    """One random MTP layer of `layout` for `config` by its checkpoint names. echo: the layer's
    output is the hidden row renormalized (fc picks the hidden half, o_proj and down_proj 0, every
    norm 1), so it drafts the target's own prediction of the token it is given: accepted where the
    target repeats a token. target: its embedding and head are copied into the layer as DeepSeek's
    checkpoints store them (deepseek_v3)."""
    torch.manual_seed(seed)
    H = config.hidden_size
    fc, enorm, hnorm, norm = NAMES[layout]
    own = {
        f"{fc}.weight": torch.randn(H, 2 * H) / (2 * H) ** 0.5,
        f"{enorm}.weight": 1.0 + 0.3 * torch.randn(H),
        f"{hnorm}.weight": 1.0 + 0.3 * torch.randn(H),
        f"{norm}.weight": 1.0 + 0.3 * torch.randn(H),
    }
    block = _block(config)
    if echo:
        block = {k: torch.zeros_like(v) if ("o_proj" in k or "down_proj" in k) else v for k, v in block.items()}
        block = {k: torch.ones_like(v) if k.endswith("norm.weight") else v for k, v in block.items()}
        own = {k: torch.ones_like(v) if v.dim() == 1 else v for k, v in own.items()}
        zero, eye = torch.zeros(H, H), torch.eye(H)
        own[f"{fc}.weight"] = torch.cat([eye, zero] if layout == "mimo" else [zero, eye], 1)
    if target is not None and layout == "deepseek_v3":
        own["shared_head.head.weight"] = target.get_output_embeddings().weight.detach().clone()
        own["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().clone()
    p = prefix(layout, config, index)
    return {p + k: v.contiguous() for k, v in {**block, **own}.items()}


def add_mtp(folder: Path, config, layout: str = "deepseek_v3", layers: int = 1, **kwargs) -> dict[str, torch.Tensor]:
    """Write `layers` MTP layers into `folder`'s model.safetensors (its tensors kept) and
    num_nextn_predict_layers into its config.json; returns the first layer's tensors."""
    from safetensors.torch import load_file, save_file

    path = Path(folder) / "model.safetensors"
    tensors = load_file(str(path))
    first = mtp_tensors(config, layout, **kwargs)
    extra = {}
    for i in range(1, layers):
        extra.update(mtp_tensors(config, layout, **{**kwargs, "seed": 7 + i, "index": i}))
    save_file({**tensors, **first, **extra}, str(path), metadata={"format": "pt"})
    data = json.loads((Path(folder) / "config.json").read_text())
    data["num_nextn_predict_layers"] = layers
    (Path(folder) / "config.json").write_text(json.dumps(data, indent=2))
    return first


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama / Qwen RMSNorm: x / rms(x) * w, in float32."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class DeepSeekReference:
    """The MTP equations per row t at position t, with h_t the given hidden row (the target's
    final-normed hidden state of position t) or, where None, the previous row's output:

        x_t      = eh_proj([rms(embed(id_t)) w_e, rms(h_t) w_h])      MiMo: [rms(h_t) w_h, rms(embed(id_t)) w_e]
        y        = decoder layer over x_0 .. x_t (causal)            out_t = rms(y_t) w_n
        logits_t = lm_head(out_t)                                     the target's head
    """

    def __init__(self, config, layout: str, tensors: dict[str, torch.Tensor], embed, head, hidden_first=None):
        from transformers import AutoModel

        p = prefix(layout, config)
        fc, enorm, hnorm, norm = NAMES[layout]
        self.model = AutoModel.from_config(one_layer(config)).eval()  # its layer and final norm are the MTP's
        skip = {f"{p}{n}.weight" for n in (fc, enorm, hnorm, norm, "shared_head.head", "embed_tokens")}
        state = {"layers.0." + k[len(p) :]: v for k, v in tensors.items() if k not in skip}
        state["norm.weight"] = tensors[f"{p}{norm}.weight"]
        state["embed_tokens.weight"] = embed
        self.model.load_state_dict(state, strict=True)
        self.fc, self.w_e, self.w_h = (tensors[f"{p}{n}.weight"] for n in (fc, enorm, hnorm))
        self.hidden_first = layout == "mimo" if hidden_first is None else hidden_first
        self.eps, self.embed, self.head = config.rms_norm_eps, embed.float(), head.float()

    @torch.no_grad()
    def rows(self, ids, hidden: list[torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [n], hidden: n rows [H] or None -> (logits [n, V], out [n, H])."""
        xs, outs = [], []
        for t, token in enumerate(ids):
            h = hidden[t] if hidden[t] is not None else outs[-1]
            e = _rms(self.embed[int(token)], self.w_e, self.eps)
            hn = _rms(h.float(), self.w_h, self.eps)
            xs.append(torch.cat([hn, e] if self.hidden_first else [e, hn]) @ self.fc.t())
            y = self.model(inputs_embeds=torch.stack(xs)[None], position_ids=torch.arange(t + 1)[None])
            outs.append(y.last_hidden_state[0, -1])
        out = torch.stack(outs)
        return out @ self.head.t(), out
