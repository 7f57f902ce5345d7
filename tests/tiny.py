"""Tiny random-init models, a tiny tokenizer and tiny artifacts for tests (seconds each).

Every architecture registered in specexport.models.architectures has a config here; the parity test
fails when one is missing (tests/build/test_parity.py).
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# Larger than default init so logits are spread out and greedy argmax has no near-ties.
_COMMON = dict(
    vocab_size=320,  # > tokenizer vocab (300): padded embedding rows, like real models
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# One config per family (key = model_type) shaped like its real checkpoints, with windows of 16
# tokens (the parity probes and generations are longer) and softcaps small enough to bite.
TINY_CONFIGS: dict[str, dict] = {
    "llama": dict(_COMMON, tie_word_embeddings=True),
    "mistral": dict(_COMMON, sliding_window=16),  # a window shorter than the tests' sequences
    "qwen2": dict(_COMMON),  # q/k/v biases
    "qwen3": dict(_COMMON, head_dim=32),  # q/k norm, head_dim != hidden / heads
    "phi3": dict(_COMMON),  # fused qkv and gate_up
    "gemma": dict(_COMMON, head_dim=32),  # embedding scale, (1 + w) norms, gelu
    # alternating local/global layers, both softcaps, query_pre_attn_scalar != head_dim, sandwich norms
    "gemma2": dict(
        _COMMON,
        head_dim=32,
        sliding_window=16,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=8.0,
        query_pre_attn_scalar=24,
    ),
    # the 5:1 local/global pattern, local theta 1e4 and a linear-scaled global theta 1e6, (1 + w) q/k norms
    "gemma3_text": dict(
        _COMMON,
        head_dim=32,
        num_hidden_layers=6,
        sliding_window=16,
        query_pre_attn_scalar=24,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        },
    ),
    # Gemma 4 (E2B: 35 layers, 4 sliding : 1 full, one K/V head, head_dim 256 and 512 on the full layers
    # with proportional rotary over a quarter, per-layer inputs of 256, the last 20 layers reading the
    # K/V of the last earlier layer of their type with twice the MLP width, final softcap 30): here 7
    # layers, the last 3 sharing (layers 4, 5 read layer 3's K/V, layer 6 layer 2's)
    "gemma4_text": dict(
        _COMMON,
        num_hidden_layers=7,
        num_key_value_heads=1,
        head_dim=16,
        global_head_dim=32,
        sliding_window=16,
        layer_types=["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 3 + ["full_attention"],
        num_kv_shared_layers=3,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=320,
        use_double_wide_mlp=True,
        final_logit_softcapping=8.0,
    ),
    "smollm3": dict(_COMMON, num_hidden_layers=4, no_rope_layer_interval=4),  # layer 3 is NoPE
    "granite": dict(
        _COMMON,
        tie_word_embeddings=True,
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.05,
        logits_scaling=8.0,
    ),
    "olmo2": dict(_COMMON),  # post-norms only, q/k norm over all heads
    # OLMo 3: OLMo 2 with 3 sliding : 1 full layers and a rope table per layer type
    "olmo3": dict(_COMMON, num_hidden_layers=4, sliding_window=16),
    # LFM2 (1.2B: 16 layers, attention at 2, 5, 8, 10, 12, 14): gated short convolutions (kernel 3)
    # between GQA layers with per-head q/k norms; the MLP width adjusted to 2/3, a multiple of 32
    "lfm2": dict(
        _COMMON,
        num_hidden_layers=6,
        layer_types=["conv", "conv", "full_attention", "conv", "conv", "full_attention"],
        conv_L_cache=3,
        intermediate_size=192,
        block_multiple_of=32,
        block_ffn_dim_multiplier=1.0,
        block_auto_adjust_ff_dim=True,
        norm_eps=1e-5,
    ),
    # EXAONE 4: post-norms, per-head q/k norms, 3 sliding (rotary) : 1 full (NoPE) layers
    # Granite 4.0-H dense (Mamba2 layers with a few GQA layers, no rotary, no experts): Mamba2 of 4
    # heads x 32 (expand 2), state 16, conv kernel 4 with bias, Granite's multipliers, a shared MLP
    "granitemoehybrid": dict(
        _COMMON,
        num_hidden_layers=4,
        layer_types=["mamba", "mamba", "attention", "mamba"],
        num_local_experts=0,
        shared_intermediate_size=128,
        mamba_n_heads=4,
        mamba_d_head=32,
        mamba_d_state=16,
        mamba_n_groups=1,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_conv_bias=True,
        mamba_proj_bias=False,
        # each multiplier != 1 (the real 12 / 0.22 / 1/128 / 8 with 0.2-scale random weights repeat one token)
        embedding_multiplier=1.5,
        residual_multiplier=0.5,
        attention_multiplier=0.1,
        logits_scaling=2.0,
        tie_word_embeddings=True,
    ),
    # Qwen3.5 (0.8B: 24 layers, one gated full-attention layer in four, head_dim 256 with rotary over
    # a quarter, Gated DeltaNet of 16 k / 16 v heads x 128, conv kernel 4): here 2 k / 4 v heads x 16
    "qwen3_5_text": dict(
        _COMMON,
        num_hidden_layers=4,
        head_dim=64,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        tie_word_embeddings=True,
    ),
    # Nemotron-H dense (Nano 9B v2: Mamba2 blocks, a few GQA blocks without positions, relu2 MLP
    # blocks): one mixer a block; Mamba2 of 4 heads x 32, 2 groups, state 16, conv kernel 4
    "nemotron_h": dict(
        _COMMON,
        num_hidden_layers=6,
        layers_block_type=["mamba", "mlp", "attention", "mlp", "mamba", "mlp"],
        head_dim=16,
        mamba_num_heads=4,
        mamba_head_dim=32,
        ssm_state_size=16,
        n_groups=2,
        conv_kernel=4,
        expand=2,
        use_conv_bias=True,
        use_bias=False,
        mlp_hidden_act="relu2",
        n_routed_experts=0,
    ),
    # Falcon-H1 (0.5B: 36 layers, attention and Mamba2 side by side in each, muP multipliers): Mamba2 of
    # 4 heads x 32 (mamba_d_ssm 128), 2 groups, state 16; every multiplier != 1, the gated norm first
    "falcon_h1": dict(
        _COMMON,
        num_hidden_layers=3,
        head_dim=16,
        mamba_d_ssm=128,
        mamba_n_heads=4,
        mamba_d_head=32,
        mamba_n_groups=2,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_rms_norm=True,
        mamba_norm_before_gate=True,
        embedding_multiplier=1.3,
        lm_head_multiplier=0.7,
        key_multiplier=0.8,
        attention_in_multiplier=0.9,
        attention_out_multiplier=1.1,
        ssm_in_multiplier=1.2,
        ssm_out_multiplier=0.9,
        ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.05],
        mlp_multipliers=[1.2, 0.8],
    ),
    "exaone4": dict(_COMMON, num_hidden_layers=4, sliding_window=16, sliding_window_pattern=4),
    "gpt2": dict(
        vocab_size=320,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=512,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
    ),
}
# The multimodal Gemma 3 checkpoint (4B and up): the decoder is its language model.
_TINY_VISION = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
)
TINY_CONFIGS["gemma3"] = dict(
    text_config=dict(TINY_CONFIGS["gemma3_text"], model_type="gemma3_text"),
    vision_config=_TINY_VISION,
    mm_tokens_per_image=4,
    initializer_range=0.2,
)
# the Qwen3.5 checkpoint as published (vision tower and language model; transformers builds the
# text model from it for causal LM)
TINY_CONFIGS["qwen3_5"] = dict(
    text_config=dict(TINY_CONFIGS["qwen3_5_text"], model_type="qwen3_5_text"),
    vision_config=dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64),
    initializer_range=0.2,
    tie_word_embeddings=True,
)
# The Gemma 4 checkpoint as published (vision tower and language model; no audio tower, as E2B's
# text-and-image use): the decoder is its language model
TINY_CONFIGS["gemma4"] = dict(
    text_config=dict(TINY_CONFIGS["gemma4_text"], model_type="gemma4_text"),
    vision_config=dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        patch_size=14,
        position_embedding_size=64,
    ),
    audio_config=None,
    initializer_range=0.2,
)
# Feature variants of a family: name -> (model_type, overrides of its TINY_CONFIGS entry).
TINY_VARIANTS: dict[str, tuple[str, dict]] = {
    "llama-llama3-rope": (
        "llama",
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        ),
    ),
    "llama-yarn": (
        "llama",
        dict(
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
            }
        ),
    ),
    "llama-dynamic": ("llama", dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})),
    "llama-bias": ("llama", dict(attention_bias=True, mlp_bias=True)),  # q/k/v/o and MLP biases
    "qwen2-window": ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1)),
    "qwen3-window": ("qwen3", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1)),
    "phi3-4k": ("phi3", dict(sliding_window=16)),  # Phi-3-mini-4k: a window on every layer
    # Phi-4-mini: partial rotary 0.75, longrope below its original context, an inert huge window
    "phi3-mini": (
        "phi3",
        dict(
            hidden_size=128,
            num_attention_heads=2,
            num_key_value_heads=1,  # head_dim 64, rotary 48
            sliding_window=262144,
            max_position_embeddings=2048,
            original_max_position_embeddings=512,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
                "short_factor": [1.0 + 0.1 * i for i in range(24)],
                "long_factor": [2.0 + 0.5 * i for i in range(24)],
                "original_max_position_embeddings": 512,
            },
        ),
    ),
    "smollm3-window": ("smollm3", dict(use_sliding_window=True, sliding_window=16)),  # windows on its NoPE layers
    # OLMo 3 7B/32B: yarn on the full-attention layers' table only
    "olmo3-yarn": (
        "olmo3",
        dict(
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0},
                "full_attention": {
                    "rope_type": "yarn",
                    "rope_theta": 500000.0,
                    "factor": 8.0,
                    "original_max_position_embeddings": 64,
                    "attention_factor": 1.2,
                    "beta_fast": 32,
                    "beta_slow": 1,
                },
            }
        ),
    ),
    "lfm2-bias": ("lfm2", dict(conv_bias=True, conv_L_cache=4)),  # biased projections and conv, kernel 4
    # two B/C groups, rotary on (time_step_limit: tests/build/test_hybrid_build.py, against the
    # uncached forward: transformers' cached decode step does not clamp dt)
    "granitemoehybrid-rope": ("granitemoehybrid", dict(position_embedding_type="rope", mamba_n_groups=2)),
    # Falcon-H1 with the plain gate instead of the gated norm (mamba_rms_norm false)
    "falcon_h1-gate": ("falcon_h1", dict(mamba_rms_norm=False)),
    "exaone4-global": ("exaone4", dict(sliding_window=None, layer_types=["full_attention"] * 4)),  # 1.2B: all rotary
    # Gemma 4 26B/31B: full-attention layers take k_proj's output as their values (no v_proj)
    "gemma4_text-keys-as-values": ("gemma4_text", dict(attention_k_eq_v=True)),
}


# Gated DeltaNet (Qwen3.5): transformers' fp32 forward is itself up to 1.3e-4 from its float64
# forward on the tiny model (validation's reference_error), so parity against it gets that much
# more room than the 1e-4 of the other families
FP32_BOUND = {"qwen3_5_text": 3e-4, "qwen3_5": 3e-4, "falcon_h1": 2e-4}  # Falcon-H1's multipliers: 5e-5 there


def fp32_bound(name: str) -> float:
    """Max |logit diff| of an fp32 graph against transformers' fp32 forward, for a family or variant."""
    return FP32_BOUND.get(TINY_VARIANTS.get(name, (name,))[0], 1e-4)


def tiny_names() -> list[str]:
    """Every family and every variant."""
    return sorted(TINY_CONFIGS) + sorted(TINY_VARIANTS)


def tiny_config(name: str, **overrides):
    """The transformers config of a family (TINY_CONFIGS key) or variant (TINY_VARIANTS key)."""
    from transformers import AutoConfig

    arch, base = (name, {}) if name in TINY_CONFIGS else TINY_VARIANTS[name]
    values = {**TINY_CONFIGS[arch], **base, **overrides}
    if arch == "gemma3":
        from transformers import Gemma3Config

        return Gemma3Config(**values)
    return AutoConfig.for_model(arch, **values)


SPECIALS = ["<|pad|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. Speculative decoding drafts and verifies tokens.",
    "for i in range(10):\n    print(i * i)\n",
    '{"name": "specexport", "version": 1, "items": [1, 2, 3]}',
]


def make_model(arch: str = "llama", seed: int = 0, **overrides):
    """A random-init model of a family or variant (tiny_config), transformers' default attention
    (eager where the family needs it for softcaps: Gemma 2)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(arch, **overrides)
    if arch == "qwen3_5":  # the published layout: the vision-language model (model.language_model.*)
        from transformers import Qwen3_5ForConditionalGeneration

        return Qwen3_5ForConditionalGeneration(config).eval()
    model = AutoModelForCausalLM.from_config(config).eval()
    if TINY_VARIANTS.get(arch, (arch,))[0].startswith("gemma4"):
        _spread_scales(model)
    return model


def _spread_scales(model) -> None:
    """Norm weights 1 + N(0, 0.2) and layer scalars in [0.5, 1.5] (Gemma 4 initializes both to 1,
    which a graph ignoring them would reproduce); q/k norm weights about D^-1/4 as a trained model's,
    since its attention scale is 1 (q.k of unit-RMS heads would be ~D: a one-hot softmax)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(p.shape[0] ** -0.25 * (1.0 + 0.2 * torch.randn_like(p)))
            elif name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand_like(b))


def perturbed_copy(model, scale: float, seed: int = 1):
    """A draft that agrees with `model` often but not always: weights plus gaussian noise."""
    import copy

    torch.manual_seed(seed)
    draft = copy.deepcopy(model)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * scale * p.std().clamp_min(1e-3))
    return draft


def make_tokenizer(corpus: list[str] | None = None):
    """Byte-level BPE, 300 tokens, specials at ids 0-2; another corpus gives other ids."""
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator((corpus or _CORPUS) * 20, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|pad|>", bos_token="<|im_start|>", eos_token="<|im_end|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_hf_folder(model, folder: Path, tokenizer=None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    (tokenizer or make_tokenizer()).save_pretrained(folder)
    return folder


def write_recipe(
    path: Path,
    target: Path,
    draft: dict,
    name: str = "tiny",
    gamma: int = 4,
    max_context: int = 256,
    graph: str = "portable",
    precision: str = "fp32",
    exactness: str = "bitwise",
    max_batch: int = 1,
    tree_verify: bool = False,
) -> Path:
    import yaml

    data = {
        "name": name,
        "max_context": max_context,
        "graph": graph,
        "target": {"model": str(target), "precision": precision, "exactness": exactness},
        "draft": draft,
        "speculation": {"gamma": gamma, "max_gamma": 8},
        "tested_here": True,
    }
    if max_batch > 1:
        data["max_batch"] = max_batch
    if tree_verify:
        data["tree_verify"] = True
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def build_tiny_artifact(
    workdir: Path, draft_kind: str, arch: str = "llama", max_context: int = 256, precision: str = "fp32"
) -> Path:
    """draft_kind: 'self' (draft = target), 'noisy' (perturbed copy), 'ngram', or a self-draft
    precision ('int8', 'int4', 'fp16', ...); with a '-fused' suffix (e.g. 'noisy-fused') both graphs
    are fused (head_major_inplace); 'PRECISION-target' (e.g. 'int4-target') is a quantized fused
    target of that precision with the n-gram proposer; 'eagle3' a fused target with a random
    EAGLE-3 head (tests/eagle_heads.py) over half its vocabulary, 'eagle3-portable' the same in
    the portable form; 'dflash' a 4-layer Qwen3 target with a random DFlash drafter; 'assistant' a
    tiny Gemma 4 target with a random Gemma 4 assistant (assistant_models.py); 'mtp' a tiny
    Qwen3.5 target whose checkpoint carries an echoing MTP layer (mtp_checkpoints.py), its own
    draft ('mtp-fused': both graphs fused). A '-tree' suffix (last) adds the target's tree graph (fused: contract 1.7,
    'noisy-fused-tree'; portable: 1.9, 'noisy-tree'). A
    '-numerical' suffix (before it) builds the
    target unpadded (exactness numerical: contract 1.0 / 1.1); by default it is padded as
    exactness bitwise needs. precision: the target's (and a draft model's) precision."""
    from specexport.build.artifact import build_artifact
    from specexport.recipe.load import load_recipe

    graph, exactness, max_batch = "portable", "bitwise", 1
    tree = draft_kind.endswith("-tree")
    draft_kind = draft_kind.removesuffix("-tree")
    head, sep, slots = draft_kind.rpartition("-batch")
    if sep and slots.isdigit():
        draft_kind, max_batch = head, int(slots)
    if draft_kind.endswith("-numerical"):
        draft_kind, exactness = draft_kind[: -len("-numerical")], "numerical"
    if draft_kind.endswith("-fused"):
        draft_kind, graph = draft_kind[: -len("-fused")], "fused"
    name = (
        f"tiny-{draft_kind}"
        + ("-fused" if graph == "fused" else "")
        + ("-numerical" if exactness == "numerical" else "")
        + (f"-batch{max_batch}" if max_batch > 1 else "")
        + ("-tree" if tree else "")
    )
    if draft_kind.endswith("-target"):
        name, precision, draft_kind, graph = f"tiny-{draft_kind}", draft_kind[: -len("-target")], "ngram", "fused"
    workdir.mkdir(parents=True, exist_ok=True)
    if draft_kind == "assistant":  # a Gemma 4 target with a random Gemma 4 assistant (assistant_models.py)
        arch = "gemma4_text"
    if draft_kind == "mtp":  # a Qwen3.5 target whose checkpoint carries an MTP layer (mtp_checkpoints.py)
        arch = "qwen3_5_text"
    target = make_model(arch)
    if draft_kind == "dflash":  # a 4-layer Qwen3 target with a random DFlash drafter (tests/dflash_support.py)
        from dflash_support import tiny_drafter, tiny_target

        target = tiny_target()
        tiny_drafter(workdir / "drafter")
    target_dir = save_hf_folder(target, workdir / "target-hf")
    if draft_kind == "self":
        draft = {"model": str(target_dir), "precision": precision}
    elif draft_kind == "noisy":
        draft_dir = save_hf_folder(perturbed_copy(target, 0.1), workdir / "draft-hf")
        draft = {"model": str(draft_dir), "precision": precision}
    elif draft_kind == "ngram":
        draft = {"proposer": "ngram", "ngram_sizes": [3, 2, 1]}
    elif draft_kind == "dflash":
        draft = {"model": str(workdir / "drafter"), "precision": precision}
    elif draft_kind == "mtp":
        from mtp_checkpoints import add_mtp

        add_mtp(target_dir, target.config, echo=True)  # drafts accepted where the target repeats
        draft = {"mtp": {}}
    elif draft_kind == "assistant":
        from assistant_models import make_assistant, save_assistant

        draft = {"model": str(save_assistant(make_assistant(), workdir / "assistant-hf"))}
    elif draft_kind in ("eagle3", "eagle3-portable"):  # a random EAGLE-3 head (tests/eagle_heads.py)
        from eagle_heads import make_tiny_head_folder

        make_tiny_head_folder(workdir / "head", target, draft_vocab=160, seed=0)
        draft, graph = {"eagle3": {"model": str(workdir / "head")}}, "fused" if draft_kind == "eagle3" else "portable"
    else:
        draft = {"from_target": {"precision": draft_kind}}
    recipe = load_recipe(
        write_recipe(
            workdir / "recipe.yaml",
            target_dir,
            draft,
            name=name,
            max_context=max_context,
            graph=graph,
            precision=precision,
            exactness=exactness,
            max_batch=max_batch,
            tree_verify=tree,
        )
    )
    out = workdir / "artifact"
    build_artifact(recipe, out)
    return out


def export_portable(model, out_dir: Path, **kwargs):
    """The portable (time_major) decoder graph of `model` (decoder_graph.build_decoder)."""
    from specexport.graphs.decoder import build_decoder
    from specexport_runtime import contract

    return build_decoder(model, out_dir, kv_layout=contract.TIME_MAJOR, **kwargs)
