"""Writing an EAGLE-3 head in its published format (eagle3.py describes the format and reads it back).

A written folder holds config.json (a one-layer Llama config plus the EAGLE-3 keys, layer ids as
"output of layer" ids) and model.safetensors (float32 weights, d2t int64 [draft_vocab], t2d bool
[V_t]); load_eagle3_head reads it back to an equal head.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from .eagle3 import Eagle3Config, Eagle3Head

SAFETENSORS_NAME = "model.safetensors"
ARCHITECTURE = "LlamaForCausalLMEagle3"  # what write_eagle3_head puts in config.json


def head_config_json(config: Eagle3Config) -> dict:
    """The published config.json of a head (one-layer Llama config plus the EAGLE-3 keys);
    layer ids are written as "output of layer" ids (entering - 1)."""
    data = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": config.hidden_size,
        "target_hidden_size": config.target_hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        "eagle_config": {
            "use_aux_hidden_state": True,
            "eagle_aux_hidden_state_layer_ids": [i - 1 for i in config.layer_ids],
        },
    }
    return data


def write_eagle3_head(head: Eagle3Head, folder: str | Path) -> Path:
    """Write `head` in the published format (config.json + model.safetensors: float32 weights,
    d2t int64, t2d bool) into `folder`, atomically: a temporary sibling folder renamed into
    place (an existing folder is replaced). Returns the folder."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tensors = {name: value.detach().to(torch.float32).contiguous() for name, value in head.weights.items()}
    tensors["d2t"] = torch.from_numpy(np.ascontiguousarray(head.d2t, dtype=np.int64))
    tensors["t2d"] = torch.from_numpy(np.ascontiguousarray(head.t2d, dtype=np.bool_))
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=folder.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(head_config_json(head.config), indent=2) + "\n", encoding="utf-8")
        save_file(tensors, str(tmp / SAFETENSORS_NAME), metadata={"format": "pt"})
        replace_folder(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def replace_folder(new: Path, folder: Path) -> None:
    """Put the complete folder `new` where `folder` is (the old one is moved aside first, then
    removed; a leftover aside copy of an earlier crash is cleared)."""
    if not folder.exists():
        new.rename(folder)
        return
    old = folder.with_name(f".{folder.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    folder.rename(old)
    new.rename(folder)
    shutil.rmtree(old, ignore_errors=True)  # the new folder is in place: a stale aside copy is no failure


__all__ = ["ARCHITECTURE", "head_config_json", "replace_folder", "write_eagle3_head"]
