"""The models and graphs of hybrid_mechanics.py: the shapes (--shape), the hybrid's transformers
config and its attention-only twin's, and one graph built (or reused from --work) per kind,
precision and form. Not a script; nothing here measures.
"""

from __future__ import annotations

import gc
import pickle
import time
from dataclasses import dataclass
from pathlib import Path

from specexport.errors import HarnessError
from specexport_runtime import contract

_TINY_LAYERS = ["conv", "conv", "full_attention", "conv", "conv", "full_attention"]
SHAPES = {
    "lfm2-1.2b": None,  # specexport.plan.sizes.KNOWN_CONFIGS["LiquidAI/LFM2-1.2B"]
    # tests/tiny.py's lfm2 (spread-out init: no near-ties in greedy argmax)
    "tiny": dict(
        model_type="lfm2",
        vocab_size=320,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=_TINY_LAYERS,
        conv_L_cache=3,
        block_multiple_of=32,
        block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=True,
        norm_eps=1e-5,
        initializer_range=0.2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    ),
    # an assumed Qwen3.5-0.8B shape (not read from the real config.json, which cannot be fetched here):
    # Gated DeltaNet layers with one gated full-attention layer in four
    "qwen3.5-0.8b": dict(
        model_type="qwen3_5_text",
        vocab_size=248320,
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=24,
        layer_types=["linear_attention"] * 3 + ["full_attention"],  # repeated to num_hidden_layers
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
    ),
}
# shapes that are not a real checkpoint's config: said in --help and in the output
ASSUMED = {"qwen3.5-0.8b": "an assumed Qwen3.5-0.8B shape, not read from the real config.json"}
PRECISIONS = ("fp32", "int4")
FORMS = {"fused": contract.HEAD_MAJOR_INPLACE, "portable": contract.TIME_MAJOR}
KINDS = ("hybrid", "attention")


# --------------------------------------------------------------------------- models and graphs


def shape_config(name: str, overrides: list[str]) -> dict:
    if name not in SHAPES:
        raise HarnessError(f"--shape must be one of {sorted(SHAPES)}, got {name!r}")
    if SHAPES[name] is None:
        from specexport.plan.sizes import KNOWN_CONFIGS

        values = dict(KNOWN_CONFIGS["LiquidAI/LFM2-1.2B"])
    else:
        values = dict(SHAPES[name])
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or key not in values:
            raise HarnessError(f"--override takes KEY=INT for a key of the shape's config, got {item!r}")
        values[key] = int(text)
    layers = values["num_hidden_layers"]
    if len(values["layer_types"]) != layers:  # the pattern repeated, its first ones
        pattern = values["layer_types"]
        values["layer_types"] = [pattern[i % len(pattern)] for i in range(layers)]
    return values


def attention_layer(kind: str) -> bool:
    return kind in ("full_attention", "attention", "sliding_attention")


def describe(name: str, cfg: dict) -> str:
    """One line: the shape's size, its layers by type, and whether it is assumed."""
    recurrent = [t for t in cfg["layer_types"] if not attention_layer(t)]
    kinds = ", ".join(f"{recurrent.count(t)} {t}" for t in dict.fromkeys(recurrent))
    head = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    text = (
        f"shape {name} ({cfg['model_type']}): hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers"
        f" ({kinds}), heads {cfg['num_attention_heads']}/{cfg['num_key_value_heads']} x {head}, MLP {mlp_width(cfg)},"
        f" vocab {cfg['vocab_size']}"
    )
    return text + (f" [{ASSUMED[name]}]" if name in ASSUMED else "")


def mlp_width(cfg: dict) -> int:
    """LFM2's MLP width as transformers' Lfm2MLP computes it (2/3, multiplier, rounded up)."""
    ff = cfg["intermediate_size"]
    if cfg.get("block_auto_adjust_ff_dim"):
        ff = int(2 * ff / 3)
        if cfg.get("block_ffn_dim_multiplier") is not None:
            ff = int(cfg["block_ffn_dim_multiplier"] * ff)
        m = cfg["block_multiple_of"]
        ff = m * ((ff + m - 1) // m)
    return ff


def hf_config(kind: str, cfg: dict):
    """transformers config: the hybrid itself, or its attention-only twin (LFM2: a Llama; Qwen3.5: a
    Qwen3, whose attention has the same query/key norms, heads and head size, full rotary)."""
    from transformers import AutoConfig

    values = {k: v for k, v in cfg.items() if k != "model_type"}
    if kind == "hybrid":
        return AutoConfig.for_model(cfg["model_type"], **values)
    twin = dict(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=mlp_width(cfg),
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"],
        rms_norm_eps=cfg.get("norm_eps", cfg.get("rms_norm_eps", 1e-5)),
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        initializer_range=cfg.get("initializer_range", 0.02),
        tie_word_embeddings=cfg.get("tie_word_embeddings", True),
    )
    if cfg["model_type"] == "qwen3_5_text":
        theta = cfg["rope_parameters"]["rope_theta"]
        rope = {"rope_type": "default", "rope_theta": theta}
        return AutoConfig.for_model("qwen3", head_dim=cfg["head_dim"], rope_parameters=rope, **twin)
    return AutoConfig.for_model("llama", **twin)


@dataclass
class Graph:
    kind: str
    precision: str
    form: str
    path: Path
    spec: object  # GraphSpec
    params: int
    bytes: int
    build_seconds: float
    min_rows: int = 1  # padded calls (feature row_padding)
    cache_pad: int = 0  # padded attention (fused)

    @property
    def label(self) -> str:
        return f"{self.kind} {self.precision} {self.form}"


def padding(precision: str, form: str) -> tuple[int, int]:
    """(min_rows, cache_pad) of a graph: what a bitwise target of this precision and form is built
    with (build/graphs.py BITWISE_FUSED; the module docstring)."""
    if precision == "int4":
        return 2, 0
    return (1, 1) if FORMS[form] == contract.HEAD_MAJOR_INPLACE else (1, 0)


def build_graph(kind: str, precision: str, form: str, cfg: dict, max_context: int, args, root: Path) -> Graph:
    """The graph of one model (reused from --work when its settings match)."""
    out = root / f"{kind}-{precision}-{form}"
    min_rows, cache_pad = padding(precision, form)
    stamp = repr((cfg, max_context, args.block_size, args.accuracy_level, args.seed, min_rows, cache_pad))
    saved = out / "graph.pkl"
    if saved.exists():
        graph = pickle.loads(saved.read_bytes())
        if graph.get("stamp") == stamp:
            return Graph(**graph["graph"])
    import torch
    from transformers import AutoModelForCausalLM

    from specexport.graphs.decoder import build_decoder
    from specexport.graphs.quantized_target import QuantizedWeights

    start = time.perf_counter()
    torch.manual_seed(args.seed)
    # fp16 in memory (half of fp32's); the writer converts one weight at a time to fp32
    model = AutoModelForCausalLM.from_config(hf_config(kind, cfg), dtype=torch.float16).eval()
    params = sum(p.numel() for p in model.parameters())
    weights = None
    if precision == "int4":
        weights = QuantizedWeights("int4", args.block_size, args.accuracy_level, "fp32", "fp32", {})
    result = build_decoder(
        model,
        out,
        max_context,
        kv_layout=FORMS[form],
        weights=weights,
        min_rows=min_rows,
        pad_attention=cache_pad > 0,
        dtype=torch.float32,
    )
    del model
    gc.collect()
    seconds = time.perf_counter() - start
    graph = Graph(kind, precision, form, result.path, result.spec, params, result.bytes, seconds, min_rows, cache_pad)
    saved.write_bytes(pickle.dumps({"stamp": stamp, "graph": graph.__dict__}))
    return graph
