"""A checkpoint's own multi-token-prediction (MTP) layers as a draft (recipe `draft: {mtp: {}}`;
docs/proposers.md, "mtp").

Qwen3.5 checkpoints store one MTP layer beside the model, under `mtp.*`, which transformers drops
at load (`_keys_to_ignore_on_load_unexpected`): they are read here from the safetensors files
themselves. With e the target's embedding of a row's token and h a hidden row (the target's
final-normed hidden state of the previous position, or the MTP's own previous output):

    x      = fc([pre_fc_norm_embedding(e), pre_fc_norm_hidden(h)])      fc: [H, 2H], no bias
    y      = layers.0(x)          a full-attention Qwen3.5 decoder layer with its own K/V cache
    out    = norm(y)                                                   the next step's h
    logits = lm_head(out)         the target's (shared) output head

The graph writer (graphs/mtp.py) reads these through a 1-layer Qwen3.5 skeleton whose weights
come from the target (embedding, output head) and the `mtp.*` tensors (`MtpSource`).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from .errors import UnsupportedConfig
from .streaming import INDEX, SINGLE, SafetensorsSource, attach, skeleton, source_of

PREFIX = "mtp."
FAMILIES = ("qwen3_5_text", "qwen3_5")  # families whose MTP layer is implemented (Qwen3.5, dense)
# the tensors of one Qwen3.5 MTP module besides its decoder layer (mtp.layers.0.*)
OWN = ("mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight")


class MtpUnavailable(UnsupportedConfig):
    """A recipe asks for the MTP draft of a checkpoint that has no MTP layers (or unsupported ones)."""


def mtp_names(folder: Path | str | None) -> list[str]:
    """The `mtp.*` tensor names of a Hugging Face folder's safetensors (index or single file);
    [] for a folder without safetensors (a GGUF file, a .bin checkpoint) or no folder."""
    if folder is None:
        return []
    folder = Path(folder)
    index = folder / INDEX
    if index.is_file():
        names = list(json.loads(index.read_text())["weight_map"])
    elif (folder / SINGLE).is_file():
        from safetensors import safe_open

        with safe_open(str(folder / SINGLE), framework="pt") as f:
            names = list(f.keys())
    else:
        return []
    return sorted(n for n in names if n.startswith(PREFIX))


def offer(folder: Path | str | None) -> str | None:
    """The build's note when a target checkpoint carries MTP layers (None when it has none)."""
    names = mtp_names(folder)
    if not names:
        return None
    layers = len({n.split(".")[2] for n in names if n.startswith("mtp.layers.")})
    return (
        f"the target checkpoint carries {layers} MTP layer(s) ({len(names)} mtp.* tensors):"
        " `draft: {mtp: {}}` drafts with them (proposer mtp)"
    )


def check_mtp(model: str, folder: Path | str | None, family: str, config) -> list[str]:
    """The checkpoint's `mtp.*` names, after checking (config and tensor names only, no weight read)
    that they are one Qwen3.5 MTP layer; MtpUnavailable in one line otherwise."""
    if family not in FAMILIES:
        raise MtpUnavailable(
            f"{model}: draft mtp reads Qwen3.5 MTP layers ({', '.join(FAMILIES)}); this is a {family} model"
        )
    names = mtp_names(folder)
    if not names:
        raise MtpUnavailable(
            f"{model}: draft mtp reads the checkpoint's own MTP layers (mtp.* tensors) and this checkpoint has none;"
            " use another draft form"
        )
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    count = int(getattr(text, "mtp_num_hidden_layers", 1) or 1)
    layers = sorted({n.split(".")[2] for n in names if n.startswith("mtp.layers.")})
    missing = [n for n in OWN if n not in names]
    if count != 1 or layers != ["0"] or missing:
        raise MtpUnavailable(
            f"{model}: one MTP layer (mtp.layers.0 with {', '.join(OWN)}) is implemented; the checkpoint has"
            f" mtp_num_hidden_layers {count}, layers {layers}{', lacking ' + missing[0] if missing else ''}"
        )
    return names


class MtpSource:
    """The MTP skeleton's weights by its own names (a TensorSource): the embedding and output head
    from the target's source, `model.layers.0.*` / `model.norm` from `mtp.layers.0.*` / `mtp.norm`,
    and `mtp.fc` / `mtp.pre_fc_norm_*` as stored."""

    EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"

    def __init__(self, target, folder: Path):
        paths = {id(m): n for n, m in target.named_modules()}
        self.target = source_of(target)
        self.embed = f"{paths[id(target.get_input_embeddings())]}.weight"
        self.head = f"{paths[id(target.get_output_embeddings())]}.weight"
        self.own = SafetensorsSource(folder)

    def _where(self, name: str):
        if name == self.EMBED:
            return self.target, self.embed
        if name == self.HEAD:
            return self.target, self.head
        if name.startswith("model.layers."):
            return self.own, "mtp.layers." + name[len("model.layers.") :]
        if name == "model.norm.weight":
            return self.own, "mtp.norm.weight"
        return self.own, name

    def canonical(self, name: str) -> str:
        """A head tied to the embedding in the target is tied here too (the writer stores it once)."""
        if name == self.HEAD and self.target.canonical(self.head) == self.target.canonical(self.embed):
            return self.EMBED
        return name

    def has(self, name: str) -> bool:
        source, stored = self._where(name)
        return source.has(stored)

    def get(self, name: str) -> torch.Tensor:
        source, stored = self._where(name)
        return source.get(stored)


def with_mtp_modules(model: torch.nn.Module, config) -> torch.nn.Module:
    """A 1-layer skeleton with the MTP's own modules attached (meta parameters), under the names
    the MTP graph writer reads: `mtp.fc` [H, 2H], `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`."""
    hidden, norm_cls = config.hidden_size, type(model.model.layers[0].input_layernorm)
    with torch.device("meta"):
        own = torch.nn.Module()
        own.fc = torch.nn.Linear(2 * hidden, hidden, bias=False)
        own.pre_fc_norm_embedding = norm_cls(hidden, eps=config.rms_norm_eps)
        own.pre_fc_norm_hidden = norm_cls(hidden, eps=config.rms_norm_eps)
    model.mtp = own
    return model


def mtp_model(target, folder: Path) -> torch.nn.Module:
    """A 1-layer Qwen3.5 text skeleton (its one layer full attention) whose weights are the
    target's embedding and head and the checkpoint's MTP layer, with the MTP's own modules
    `mtp.fc`, `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden` attached (no memory: meta)."""
    config = copy.deepcopy(target.config.get_text_config())
    config.num_hidden_layers, config.layer_types = 1, ["full_attention"]
    config.model_type = "qwen3_5_text"
    model = with_mtp_modules(skeleton(config), config)
    source = MtpSource(target, Path(folder))
    missing = [n for n, _ in model.named_parameters(remove_duplicate=False) if not source.has(n)]
    if missing:
        raise MtpUnavailable(f"the MTP layer lacks {missing[0]!r} (read as {source._where(missing[0])[1]!r})")
    return attach(model, source)
