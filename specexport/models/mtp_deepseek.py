"""DeepSeek-V3-style MTP layers as the `mtp` draft (recipe `draft: {mtp: {}}`; docs/proposers.md
"mtp"): the second row beside Qwen3.5's `mtp.*` layout (models/mtp.py), on dense Llama / Qwen
shaped targets.

Two tensor layouts of the same module, read by name from the checkpoint's own safetensors:

    deepseek_v3   model.layers.{L}.{enorm, hnorm, eh_proj, shared_head.norm} and the block's own
                  tensors under model.layers.{L}.*   (L = num_hidden_layers: DeepSeek-V3, GLM-4.5)
    mimo          model.mtp_layers.0.{token_layernorm, hidden_layernorm, input_proj, final_layernorm}
                  and the block's tensors under model.mtp_layers.0.*   (MiMo-7B, a Qwen2 target)

With e the target's embedding of a row's token and h a hidden row (the target's final-normed
hidden state of the previous position, or the layer's own previous output), as the DeepSeek-V3
report, transformers' MtpLayer and SGLang's DeepseekModelNextN compute it:

    x      = eh_proj([enorm(e), hnorm(h)])        eh_proj [H, 2H], no bias (MiMo: [hnorm(h), enorm(e)])
    y      = block(x)          one decoder layer of the target's family, full attention, own K/V cache
    out    = shared_head.norm(y)                   the next chained step's h
    logits = lm_head(out)      the target's output head (the report's shared head)

The module is the Qwen3.5 row's skeleton and graph (graphs/mtp.py) with other names: `mtp.fc`,
`mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `model.layers.0.*` and `model.norm` read
the tensors above (MiMo's input_proj with its two column halves swapped, so the graph's
embedding-first concatenation computes the same x).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .mtp import MtpSource, MtpUnavailable, with_mtp_modules
from .streaming import INDEX, SINGLE, attach, skeleton

FAMILIES = ("llama", "qwen2", "qwen3")  # dense targets whose DeepSeek-style MTP layer is implemented
# the checkpoint's MoE pieces: an MTP block with experts is not a decoder layer of these families
MOE_PARTS = (".mlp.experts.", ".mlp.gate.", ".mlp.shared_experts.", ".mlp.router.")
_OWN_KEYS = ("fc", "embed_norm", "hidden_norm", "norm")


@dataclass(frozen=True)
class Layout:
    """Where one MTP layer's tensors live; skeleton names map onto `prefix` + these."""

    name: str  # the manifest's architecture: f"{name}_mtp"
    prefix: str  # the layer's tensors, e.g. "model.layers.2."
    fc: str  # [H, 2H]
    embed_norm: str
    hidden_norm: str
    norm: str  # the output norm before the shared head
    hidden_first: bool  # fc's input is [hnorm(h), enorm(e)] (MiMo)

    def own(self) -> dict[str, str]:
        """The skeleton's own names -> the stored names."""
        return {
            "mtp.fc.weight": self.prefix + self.fc,
            "mtp.pre_fc_norm_embedding.weight": self.prefix + self.embed_norm,
            "mtp.pre_fc_norm_hidden.weight": self.prefix + self.hidden_norm,
            "model.norm.weight": self.prefix + self.norm,
        }


def deepseek_layout(layer: int) -> Layout:
    return Layout(
        "deepseek_v3",
        f"model.layers.{layer}.",
        "eh_proj.weight",
        "enorm.weight",
        "hnorm.weight",
        "shared_head.norm.weight",
        hidden_first=False,
    )  # the layer's copies of the embedding and head (embed_tokens, shared_head.head) are not read


def mimo_layout(layer: int = 0) -> Layout:
    return Layout(
        "mimo",
        f"model.mtp_layers.{layer}.",
        "input_proj.weight",
        "token_layernorm.weight",
        "hidden_layernorm.weight",
        "final_layernorm.weight",
        hidden_first=True,
    )


def tensor_names(folder: Path | str | None) -> list[str]:
    """Every tensor name of a Hugging Face folder's safetensors; [] without safetensors or folder."""
    if folder is None:
        return []
    folder = Path(folder)
    if (folder / INDEX).is_file():
        return list(json.loads((folder / INDEX).read_text())["weight_map"])
    if (folder / SINGLE).is_file():
        from safetensors import safe_open

        with safe_open(str(folder / SINGLE), framework="pt") as f:
            return list(f.keys())
    return []


def _layers(names: list[str], num_layers: int) -> tuple[str, list[int]]:
    """("deepseek_v3" | "mimo" | "", the MTP layer indices found): DeepSeek's are the layers at
    or past num_layers carrying an eh_proj; MiMo's the model.mtp_layers.* indices."""
    mimo = sorted({int(n.split(".")[2]) for n in names if n.startswith("model.mtp_layers.")})
    if mimo:
        return "mimo", mimo
    extra = sorted(
        {int(n.split(".")[2]) for n in names if n.startswith("model.layers.") and n.endswith(".eh_proj.weight")}
    )
    extra = [i for i in extra if i >= num_layers]
    return ("deepseek_v3", extra) if extra else ("", [])


def offer(folder: Path | str | None) -> str | None:
    """The build's note when a target checkpoint carries DeepSeek-style MTP layers (None otherwise)."""
    config = Path(folder) / "config.json" if folder is not None else None
    if config is None or not config.is_file():
        return None
    text = json.loads(config.read_text())
    text = text.get("text_config", text)
    kind, layers = _layers(tensor_names(folder), int(text.get("num_hidden_layers", 0)))
    if not layers:
        return None
    return (
        f"the target checkpoint carries {len(layers)} {kind} MTP layer(s): `draft: {{mtp: {{}}}}` drafts with them"
        " (proposer mtp)"
    )


def mtp_config(config):
    """The 1-layer config of the MTP block: the target's, one full-attention layer."""
    config = copy.deepcopy(config.get_text_config() if hasattr(config, "get_text_config") else config)
    config.num_hidden_layers = 1
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = ["full_attention"]
    if getattr(config, "max_window_layers", None) is not None:
        config.max_window_layers = 1
    return config


def mtp_skeleton(config) -> torch.nn.Module:
    """A 1-layer skeleton of the target's family (meta parameters) with the MTP's own modules
    attached as `mtp.fc`, `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden` (the names the
    MTP graph writer reads)."""
    config = mtp_config(config)
    return with_mtp_modules(skeleton(config), config)


def stored_name(layout: Layout, name: str) -> str | None:
    """The checkpoint name behind a skeleton parameter; None for the target's embedding and head."""
    if name in (MtpSource.EMBED, MtpSource.HEAD):
        return None
    own = layout.own()
    if name in own:
        return own[name]
    if name.startswith("model.layers.0."):
        return layout.prefix + name[len("model.layers.0.") :]
    raise MtpUnavailable(f"the MTP skeleton has a parameter {name!r} no {layout.name} tensor stands for")


def check(model: str, folder: Path | str | None, family: str, config, windows: tuple[int, ...] = ()) -> Layout:
    """The checkpoint's one DeepSeek-style MTP layer, checked by tensor names only (no weight
    read); MtpUnavailable in one line: no such layer, several, an MoE block, a target with
    attention windows (NormalizedConfig.windows) or a block tensor the target family's layer
    needs and the checkpoint lacks."""
    if family not in FAMILIES:
        raise MtpUnavailable(
            f"{model}: draft mtp reads DeepSeek-style MTP layers on {', '.join(FAMILIES)} targets;"
            f" this is a {family} model"
        )
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    names = tensor_names(folder)
    kind, layers = _layers(names, text.num_hidden_layers)
    if not layers:
        raise MtpUnavailable(
            f"{model}: draft mtp reads the checkpoint's own MTP layers (model.layers.{text.num_hidden_layers}.eh_proj"
            " or model.mtp_layers.*) and this checkpoint has none; use another draft form"
        )
    count = getattr(text, "num_nextn_predict_layers", None) or len(layers)
    first = text.num_hidden_layers if kind == "deepseek_v3" else 0
    if count != 1 or layers != [first]:
        raise MtpUnavailable(
            f"{model}: one MTP layer is implemented; the checkpoint has num_nextn_predict_layers {count},"
            f" {kind} layers {layers}"
        )
    layout = deepseek_layout(first) if kind == "deepseek_v3" else mimo_layout(first)
    mine = [n for n in names if n.startswith(layout.prefix)]
    moe = next((n for n in mine if any(part in n for part in MOE_PARTS)), None)
    if moe is not None:
        raise MtpUnavailable(
            f"{model}: the MTP layer's block is a mixture of experts ({moe}); dense blocks are implemented"
        )
    if windows:
        raise MtpUnavailable(
            f"{model}: attention windows {list(windows)} on the target; the MTP layer's window is not implemented"
        )
    stored = set(names)
    skeleton_names = [n for n, _ in mtp_skeleton(text).named_parameters(remove_duplicate=False)]
    missing = [s for s in (stored_name(layout, n) for n in skeleton_names) if s is not None and s not in stored]
    if missing:
        raise MtpUnavailable(f"{model}: the {layout.name} MTP layer lacks {missing[0]!r}")
    return layout


class LayoutSource(MtpSource):
    """The skeleton's weights by its own names: the embedding and head from the target, the rest
    from `layout`'s tensors; MiMo's input_proj [W_h | W_e] is returned as [W_e | W_h]."""

    def __init__(self, target, folder: Path, layout: Layout):
        super().__init__(target, folder)
        self.layout = layout

    def _where(self, name: str):
        if name in (self.EMBED, self.HEAD):
            return super()._where(name)
        return self.own, stored_name(self.layout, name)

    def get(self, name: str) -> torch.Tensor:
        tensor = super().get(name)
        if name == "mtp.fc.weight" and self.layout.hidden_first:
            hidden = tensor.shape[1] // 2
            tensor = torch.cat([tensor[:, hidden:], tensor[:, :hidden]], dim=1)  # [H, 2H]: embedding half first
        return tensor


def mtp_model(target, folder: Path, layout: Layout) -> torch.nn.Module:
    """The MTP skeleton (mtp_skeleton) reading the target's embedding and head and `layout`'s
    tensors from `folder`; `mtp_layout` names the layout for the manifest."""
    model = mtp_skeleton(target.config)
    model.mtp_layout = layout.name
    return attach(model, LayoutSource(target, Path(folder), layout))
