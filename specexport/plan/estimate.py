"""Will a recipe fit a device? A memory plan for target + draft at max context.

    report = plan("smollm2-135m", "orin-nano-8gb")
    report.fits, report.lines(), report.to_dict()

An estimate from the model shapes, not a measurement: nothing here loads a model or touches a
GPU. Its parts, per model (target, and the draft when it has a graph):

weights   parameters x bytes per parameter of the graph's precision
          parameters of a decoder, from its normalized config (plan_sizes.py; every family of
          architectures.py, the bundled recipes' models in plan_sizes.KNOWN_CONFIGS):
            per layer  attention  hidden*(heads*head_dim) [q] + 2*hidden*(kv_heads*head_dim) [k, v]
                                  + (heads*head_dim)*hidden [o]   (+ biases where the config has them)
                       MLP        3*hidden*intermediate  (gate, up, down; 2*... for a plain MLP)
                       norms      hidden per norm: 2 (pre-norms), 4 (Gemma 2/3 sandwich), 2 (OLMo 2
                                  post-norms); q/k norms 2*head_dim per head (Qwen3, Gemma 3) or
                                  (heads + kv_heads)*head_dim (OLMo 2)
            embedding  vocab*hidden, plus vocab*hidden again for an untied output projection
            final norm hidden
          bytes per parameter: fp32 4, fp16 2. Quantized drafts (specexport.graphs.quantize) quantize the
          MatMul weights only, and drafts are exported with an untied output projection so it is
          quantized too; the embedding stays fp32:
            int8 (MatMulNBits, 8 bit, block 32, one fp32 scale per block)  1 + 4/32 = 1.125 B
            int4 (MatMulNBits, 4 bit, block 32)                            0.5 + 4/32 = 0.625 B
            dynamic-int8 (MatMulInteger, per-tensor scale)                 1 B
          Quantized targets (target.precision int8 / int4 / gguf / gptq / awq) quantize the linear
          weights, the head and the embedding as the recipe's target.quantization says, with
          scales (and GGUF offsets) in the graph's dtype f (4 B, or 2 B with dtype fp16):
            int8 / int4  1 or 0.5 + f / block_size
            gguf         0.5 + 2 f / 32   (4-bit codes, a scale and an offset per 32: Q4_1 / Q4_K,
                                           the costliest 4-bit GGUF form; Q8_0 / Q6_K tensors more)
            gptq / awq   0.5 + (f + 0.5) / 32   (4-bit, group 32 and a 4-bit zero point: the
                                                  finest common group; group 128 is smaller)
            head, embedding: fp32 (f bytes: the graph's float dtype), int8, int4 as above, or
            checkpoint (as the layers for gguf; gptq / awq checkpoints keep them in float)
kv cache  2 x attention layers x max_context x kv_heads x head_dim x bytes (4 for fp32 graphs and
          quantized drafts, 2 for fp16 graphs and quantized targets with dtype fp16): the runtime
          allocates both caches at max context once (engine.py),
          sliding-window layers (Gemma 2/3, Mistral, Phi-3) included; the report notes what a
          ring-buffer cache would save on them. Only cache-owning layers count: a layer reading an
          earlier layer's K/V (Gemma 4 num_kv_shared_layers) owns none, and the report notes the
          saving. Every cache has the widest layer's head_dim (Gemma 4: 512; its 256-wide sliding
          layers pad their heads with zeros), and the report notes what the padding takes.
state     a hybrid's recurrent states (LFM2, Granite 4.0-H, Qwen3.5, Nemotron-H, Falcon-H1), beside
          its KV cache: every state tensor (conv windows, scan states) x 4 bytes (float32 in every
          precision) x state_positions(max_gamma) = 2 max_gamma + 4 kept positions per sequence
          (recurrent.StateHistory with max_rows R = 1 + max_gamma: the last R + 1 positions, R
          slots for one call's outputs, the zeros state); independent of max_context.
          Both the KV cache and the states are counted once per cache slot of a batch graph.
work      the peak working memory of one call, which the runtime's memory arena keeps:
            2 x heads x S x T x b   attention scores and probabilities (portable graphs; a fused graph's
                                    GroupQueryAttention runs flash attention on the CUDA provider for
                                    fp16, which keeps no S x T matrix: 0 there)
            3 x S x intermediate x b, 4 x S x hidden x b, 2 x heads x T x head_dim x b (repeated K/V)
            R x vocab x 4           logits rows
            H_scan x S x S x 4      a recurrent layer's chunk-form matrices (Mamba2 heads, Gated
                                    DeltaNet value heads; 0 without recurrent layers)
          for prefill (S = max_prompt, T = S, R = 1; a recurrent model's prefill runs as calls of
          S <= 256 rows, recurrent.MAX_CALL_ROWS, the last with T = max_prompt) and verify
          (S = max_gamma + 1, T = max_context, R = S), whichever is larger; b is the graph's
          activation bytes (2 fp16, else 4).
          Plus the host logits buffer of the runtime: 64 x vocab x 4 bytes per model.
drafters reading the target (a Gemma 4 assistant: no cache of its own; an MTP layer: one layer's
          cache) are sized in drafters.py, each graph with its copy of the target's embedding.
overhead  RUNTIME_OVERHEAD_GIB per process: CUDA context, cuBLAS/cuDNN, ONNX Runtime or TensorRT
          libraries and Python.

Budget: the device's memory minus a reserve. Jetson modules share one memory between CPU and GPU,
so the OS, carve-outs and system services come off it: reserve = max(1.5 GiB, 10 % of memory),
for a headless JetPack install (a desktop session takes ~0.5-1 GiB more). Workstation GPUs: the
GPU memory minus 0.5 GiB (driver, display); host memory is not modelled there. Module memory is
taken as the marketed size in GiB (an "8GB" Orin Nano has 8 GiB of LPDDR5, ~7.4 GiB visible to
Linux after carve-outs, which the reserve covers).

All of this is an estimate within roughly +-15 %: measure on the device before relying on a
plan with little headroom (the report flags headroom under 10 % of the budget).

The devices and their budgets are in plan_devices.py, the report (ModelEstimate, PlanReport) in
plan_report.py, the model sizes in plan_sizes.py; this module estimates and advises.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from specexport_runtime.constants import MAX_TREE_NODES
from specexport_runtime.recurrent import MAX_CALL_ROWS

from ..models.config import NormalizedConfig
from ..recipe.load import load_recipe, resolve_recipe
from ..recipe.reader import with_overrides
from ..recipe.spec import MIN_CONTEXT, QUANTIZED_TARGETS, QuantizationSpec, Recipe
from .devices import DEVICES, GIB, Device, UnknownDevice, get_device
from .drafters import assistant_config, assistant_estimate, drafter_notes, mtp_estimate
from .report import TIGHT_FRACTION, ModelEstimate, PlanReport, cache_notes, gib
from .sizes import (
    CALL_ROWS,
    KNOWN_CONFIGS,
    PRECISION_BYTES,
    PlanError,
    activation_bytes,
    call_bytes,
    head_layer,
    kv_bytes,
    model_config,
    parameters,
    state_bytes,
    state_position_bytes,
    state_positions,
    weight_bytes,
)

RUNTIME_OVERHEAD_GIB = 1.0
HOST_LOGITS_ROWS = CALL_ROWS  # the host logits buffer of each model: [CALL_ROWS, vocab] float32


def _load(recipe: Recipe | str | Path) -> Recipe:
    if isinstance(recipe, Recipe):
        return recipe
    return load_recipe(resolve_recipe(recipe))


@dataclass(frozen=True)
class _Shapes:
    target: tuple[NormalizedConfig, str]
    draft: tuple[NormalizedConfig, str] | None
    assistant: tuple[object, str] | None = None  # a Gemma 4 assistant's (config, source): drafters.py


def _estimate(
    role: str,
    model: str,
    precision: str,
    shape: tuple[NormalizedConfig, str],
    max_context: int,
    max_prompt: int,
    max_gamma: int,
    quantization: QuantizationSpec | None = None,
    flash: bool = False,
    slots: int = 1,
) -> ModelEstimate:
    """slots: cache slots of a batch graph: its KV cache and logits rows are counted for each
    (the batch graph's weights are the batch-1 graph's file, loaded instead of it)."""
    config, source = shape
    label = precision if quantization is None or quantization.dtype == "fp32" else f"{precision}, {quantization.dtype}"
    return ModelEstimate(
        role=role,
        model=model,
        precision=label,
        config=config,
        config_source=source,
        parameters=parameters(config),
        weight_bytes=weight_bytes(config, precision, quantization),
        kv_bytes=slots * kv_bytes(config, precision, max_context, quantization),
        state_bytes=slots * state_bytes(config, state_positions(max_gamma)),
        activation_bytes=activation_bytes(config, precision, max_context, max_prompt, max_gamma, quantization, flash),
        logits_buffer_bytes=slots * HOST_LOGITS_ROWS * config.vocab * 4,
    )


def _report(recipe: Recipe, device: Device, shapes: _Shapes, max_context: int, max_prompt: int | None) -> PlanReport:
    prompt = min(max_prompt or max_context, max_context)
    gamma = max(recipe.speculation.max_gamma, 8)
    q = recipe.target.quantization
    target_fp16 = recipe.target.precision == "fp16" or (q is not None and q.dtype == "fp16")
    flash = recipe.layout.contrib_attention and target_fp16  # GroupQueryAttention on CUDA (fp16 only)
    models = [
        _estimate(
            "target",
            recipe.target.model,
            recipe.target.precision,
            shapes.target,
            max_context,
            prompt,
            gamma,
            q,
            flash,
            recipe.max_batch,
        )
    ]
    notes = []
    if recipe.tree_verify:
        models.append(_tree_estimate(models[0], max_context))
        notes.append(
            "the tree graph is a second ONNX Runtime session over the target's weights file: its"
            " weights are loaded again (it shares the target's KV cache)"
        )
    if recipe.draft.kind == "eagle3":
        models.append(_head_estimate(recipe, shapes.target[0], max_context))
        if recipe.tree_verify:  # the head's tree graph: its weights again, its cache shared
            models.append(_tree_estimate(models[-1], max_context, "head tree"))
            notes.append("the head's tree graph is one more session over the head's weights file")
    elif recipe.draft.kind == "mtp":
        models.append(mtp_estimate(recipe.target.model, shapes.target[0], max_context, prompt, gamma))
    elif shapes.assistant is not None:
        config, source = shapes.assistant
        models.append(assistant_estimate(recipe.draft.model, config, source, shapes.target[0], max_context, gamma))
    elif recipe.draft.has_graph and shapes.draft is not None:
        name = recipe.draft.model.model if recipe.draft.kind == "model" else f"{recipe.target.model} (self-draft)"
        models.append(
            _estimate(
                "draft",
                name,
                recipe.draft.precision,
                shapes.draft,
                max_context,
                prompt,
                gamma,
                flash=flash and recipe.draft.precision == "fp16",
            )
        )
    return PlanReport(
        recipe=recipe.name,
        device=device,
        max_context=max_context,
        max_prompt=prompt,
        max_gamma=gamma,
        max_batch=recipe.max_batch,
        models=models,
        overhead_bytes=int(RUNTIME_OVERHEAD_GIB * GIB),
        notes=notes,
    )


def _tree_estimate(target: ModelEstimate, max_context: int, role: str = "tree") -> ModelEstimate:
    """The target's tree graph (feature tree_verify): the target's weights once more (its own session),
    no KV cache of its own, and per call its attention bias [R, P + R] in the model dtype for a
    tree of up to MAX_TREE_NODES + 1 rows R (its logits rows land in the target's buffer).
    The same for an EAGLE-3 head's tree graph (feature eagle3_head_tree, role "head tree"), a bound: its
    calls have at most eagle_tree.WIDTH rows."""
    rows = MAX_TREE_NODES + 1
    itemsize = 2 if target.precision.startswith("fp16") or target.precision.endswith("fp16") else 4
    return replace(
        target,
        role=role,
        model=f"{target.model} (tree graph)",
        kv_bytes=0,
        activation_bytes=target.activation_bytes + rows * (max_context + rows) * itemsize,
        logits_buffer_bytes=0,
    )


HEAD_DRAFT_VOCAB = 32000  # a head's draft vocabulary when its config is not at hand (published heads: 32k)


HEAD_BYTES_PER_PARAM = {"fp32": 4.0, "fp16": 2.0, "int8": 1.0 + 4.0 / 32}  # int8: codes + an fp32 scale per 32
HEAD_COMPUTE = {"fp32": "fp32", "fp16": "fp16", "int8": "fp32"}  # activations and KV cache


def _head_estimate(recipe: Recipe, target: NormalizedConfig, max_context: int) -> ModelEstimate:
    """An EAGLE-3 head at draft.eagle3.precision: fc [H, 3H], one layer whose q/k/v read 2H, its own
    lm_head [V_draft, H] and a copy of the target's embedding [V, H]; its KV cache has one layer.
    V_draft from the head's local config.json, else HEAD_DRAFT_VOCAB (capped at the target's)."""
    folder = Path(recipe.draft.model.model).expanduser()
    draft_vocab = min(HEAD_DRAFT_VOCAB, target.vocab)
    if (folder / "config.json").is_file():
        draft_vocab = int(
            json.loads((folder / "config.json").read_text(encoding="utf-8")).get("draft_vocab_size", draft_vocab)
        )
    H, q, kv = target.hidden, target.heads * target.head_dim, target.kv_heads * target.head_dim
    params = 3 * H * H + 2 * H * (q + 2 * kv) + q * H + 3 * H * target.intermediate + draft_vocab * H + target.vocab * H
    layer = head_layer(target, draft_vocab)
    precision = recipe.draft.precision
    compute = HEAD_COMPUTE[precision]
    return ModelEstimate(
        role="draft",
        model=f"{recipe.draft.model.model} (EAGLE-3 head)",
        precision=precision,
        config=layer,
        config_source="target shape",
        parameters=params,
        weight_bytes=int(HEAD_BYTES_PER_PARAM[precision] * params),
        kv_bytes=kv_bytes(layer, compute, max_context),
        activation_bytes=call_bytes(layer, compute, min(max_context, 512), max_context, 1),
        logits_buffer_bytes=HOST_LOGITS_ROWS * draft_vocab * 4,
    )


def _largest_context(recipe: Recipe, device: Device, shapes: _Shapes, max_prompt: int | None, below: int) -> int | None:
    """The largest max_context < `below` that fits (memory grows with the context), or None."""

    def fits(ctx: int) -> bool:
        return _report(recipe, device, shapes, ctx, max_prompt).fits

    lo, hi = MIN_CONTEXT, below - 1
    if hi < lo or not fits(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo - lo % 256 if lo >= 256 else lo


def _variant(recipe: Recipe, **changes) -> Recipe:
    return with_overrides(recipe, changes)


def _advise(recipe: Recipe, device: Device, shapes: _Shapes, report: PlanReport, max_prompt: int | None) -> list[str]:
    advice: list[str] = []
    need = report.total_bytes

    def verdict(other: PlanReport) -> str:
        if other.fits:
            return f"fits ({gib(other.total_bytes)} of {gib(other.budget_bytes)})"
        return f"still {gib(other.total_bytes)}, over the {gib(other.budget_bytes)} budget"

    ctx = _largest_context(recipe, device, shapes, max_prompt, recipe.max_context)
    if ctx is not None:
        advice.append(f"lower max_context to {ctx} (from {recipe.max_context}): fits")
    else:
        floor = _report(recipe, device, shapes, MIN_CONTEXT, max_prompt)
        advice.append(
            f"a shorter context does not help enough: even max_context {MIN_CONTEXT} needs {gib(floor.total_bytes)}"
            f" (weights alone {gib(sum(m.weight_bytes for m in floor.models))})"
        )
    prompt_cap = min(512, recipe.max_context)
    if (max_prompt or recipe.max_context) > prompt_cap:
        capped = _report(recipe, device, shapes, recipe.max_context, prompt_cap)
        if capped.total_bytes < need:
            advice.append(
                f"feed prompts in chunks of {prompt_cap} tokens"
                f" (TensorRT engines do: trt_build --max-prompt {prompt_cap}):"
                f" {verdict(capped)}"
            )
    quantizable = recipe.draft.kind == "from_target" or (recipe.draft.kind == "model" and shapes.assistant is None)
    if quantizable and recipe.draft.precision != "int4":  # an assistant or MTP layer is built fp32 only
        if recipe.draft.kind == "from_target":
            alt = _variant(recipe, **{"draft": {"from_target": {"precision": "int4"}}})
            how = "int4 self-draft (draft: {from_target: {precision: int4}})"
        else:
            alt = _variant(recipe, **{"draft.precision": "int4"})
            how = "int4 draft (draft.precision: int4; MatMulNBits, ONNX Runtime only, not TensorRT)"
        other = _report(alt, device, shapes, recipe.max_context, max_prompt)
        if other.total_bytes < need:  # quantized drafts keep fp32 embeddings, KV and activations
            advice.append(f"{how}: {verdict(other)}")
    if recipe.draft.has_graph:
        alt = _variant(
            recipe, draft={"proposer": "ngram", "ngram_sizes": [3, 2, 1]}, **{"speculation.proposer": "ngram"}
        )
        advice.append(
            f"n-gram proposer instead of a draft model (draft: {{proposer: ngram}}): "
            f"{verdict(_report(alt, device, _Shapes(shapes.target, None), recipe.max_context, max_prompt))}"
        )
    if recipe.target.precision == "fp32":
        alt = _variant(recipe, **{"target.precision": "fp16"})
        advice.append(
            "fp16 target (target.precision: fp16): "
            f"{verdict(_report(alt, device, shapes, recipe.max_context, max_prompt))}"
        )
    if recipe.target.precision not in QUANTIZED_TARGETS:
        dtype = "fp16" if recipe.target.precision == "fp16" else "fp32"
        for precision in ("int8", "int4"):
            alt = _variant(
                recipe, **{"target.precision": precision, "target.quantization": {"dtype": dtype}, "graph": "fused"}
            )
            other = _report(alt, device, shapes, recipe.max_context, max_prompt)
            if other.total_bytes < need:
                advice.append(
                    f"{precision} target weights (target.precision: {precision}, quantization.dtype {dtype};"
                    f" MatMulNBits, fused graph, ONNX Runtime CPU / CUDA): {verdict(other)}"
                )
                if other.fits:
                    break
    bigger = [
        d.name
        for d in DEVICES.values()
        if d.shared == device.shared
        and d.memory_gib > device.memory_gib
        and _report(recipe, d, shapes, recipe.max_context, max_prompt).fits
    ]
    if bigger:
        advice.append(f"as is, it fits: {', '.join(bigger)}")
    return advice


def _stored_prompt_note(spec, kv: int) -> str:
    """The size of a stored system prompt's rows (build/prompt.py): its tokens estimated at 4 UTF-8
    bytes a token (the build renders it exactly), times the models' cache bytes per token."""
    path = Path(spec.system_prompt)
    size = path.stat().st_size if path.is_file() else 0
    tokens = min(spec.max_context, size // 4 + 16)  # + the chat template's role markers
    stored = kv * tokens // spec.max_context
    return (
        f"stored system prompt {str(path)!r}: about {tokens} tokens (at 4 bytes a token), about {gib(stored)}"
        " in the artifact (each model's rows) and as much in the prefix cache once a request uses it"
    )


def plan(
    recipe: Recipe | str | Path,
    device: str,
    *,
    max_prompt: int | None = None,
    max_context: int | None = None,
    known: dict[str, dict] | None = None,
) -> PlanReport:
    """Memory plan of `recipe` (a Recipe, a recipe file or a bundled recipe name) on `device`.

    max_prompt: longest prompt fed in one call (default: max_context, the worst case of the ONNX
    Runtime backend; TensorRT engines chunk prefill at their --max-prompt). max_context
    overrides the recipe's. known: extra {model id: config.json dict} for models without a
    local config. Raises UnknownDevice (listing the devices) or PlanError."""
    dev = get_device(device)
    spec = _load(recipe)
    if max_context is not None:
        spec = with_overrides(spec, {"max_context": max_context})
    if max_prompt is not None and max_prompt < 1:
        raise PlanError(f"max_prompt must be >= 1, got {max_prompt}")
    target = model_config(spec.target, spec.max_context, known)
    draft = None
    assistant = assistant_config(spec.draft.model) if spec.draft.kind == "model" else None
    if spec.draft.kind == "model" and assistant is None:
        draft = model_config(spec.draft.model, spec.max_context, known)
    elif spec.draft.kind == "from_target":
        draft = target
    shapes = _Shapes(target, draft, assistant)
    report = _report(spec, dev, shapes, spec.max_context, max_prompt)
    if not report.fits or report.tight:
        report.advice = _advise(spec, dev, shapes, report, max_prompt)
    if report.tight:
        report.notes.append(
            f"headroom under {TIGHT_FRACTION:.0%} of the budget: measure on the device (tegrastats / nvidia-smi)"
        )
    if spec.draft.kind == "mtp" or assistant is not None:
        report.notes += drafter_notes(report.models[-1], target[0])
    recurrent = [m for m in report.models if m.state_bytes]
    if recurrent:
        per = ", ".join(f"{m.role} {state_position_bytes(m.config) / 2**20:.2f} MiB" for m in recurrent)
        report.notes.append(
            f"recurrent state (float32) beside the KV cache: per kept position {per};"
            f" {state_positions(max(spec.speculation.max_gamma, 8))} positions"
            f" per sequence; prefill runs in calls of up to {MAX_CALL_ROWS} rows; these graphs run on ONNX Runtime's"
            " CPU provider in this version (states in host memory)"
        )
    kv = sum(m.kv_bytes for m in report.models)
    # a hybrid's pool also holds recurrent-state checkpoints: one per MAX_CALL_ROWS positions of a full context
    checkpoints = sum(state_position_bytes(m.config) * (spec.max_context // MAX_CALL_ROWS) for m in recurrent)
    report.notes.append(
        f"prefix cache (CPU provider: serve, gen.generate): by default up to {gib(kv + checkpoints)} more host"
        " memory, the KV caches' size again"
        + (
            f" and {gib(checkpoints)} of recurrent-state checkpoints (one per {MAX_CALL_ROWS} positions)"
            if checkpoints
            else ""
        )
        + ", for prompt prefixes reused across requests (an EAGLE-3 head adds the target's"
        " features); --prefix-cache-mib / prefix_cache_bytes bound it, 0 turns it off (docs/prefix-cache.md)"
    )
    if spec.system_prompt is not None:
        report.notes.append(_stored_prompt_note(spec, kv))
    report.notes += cache_notes(target[0], spec.target.precision, spec.max_context, spec.target.quantization)
    if spec.layout.contrib_attention:  # every device in DEVICES is a GPU
        fp16 = spec.target.precision == "fp16" or (
            spec.target.quantization is not None and spec.target.quantization.dtype == "fp16"
        )
        gpu = "the ONNX Runtime CUDA provider" + (
            "" if fp16 else " only with an fp16 target (or quantization.dtype fp16)"
        )
        report.notes.append(
            f"graph: fused runs on {gpu} (GroupQueryAttention) and never on TensorRT; for TensorRT engines build"
            " with graph: portable (docs/graph-contract.md)"
        )
    return report


__all__ = [
    "DEVICES",
    "Device",
    "KNOWN_CONFIGS",
    "ModelEstimate",
    "PlanError",
    "PlanReport",
    "PRECISION_BYTES",
    "UnknownDevice",
    "activation_bytes",
    "get_device",
    "kv_bytes",
    "model_config",
    "plan",
    "weight_bytes",
]
