"""Will a recipe fit a device? A memory plan for target + draft at max context.

    report = plan("smollm2-135m", "orin-nano-8gb")
    report.fits, report.lines(), report.to_dict()

An estimate from the model shapes, not a measurement: nothing here loads a model or touches a
GPU. Its parts, per model (target, and the draft when it has a graph):

weights   parameters x bytes per parameter of the graph's precision
          parameters of a decoder (llama / mistral / qwen2 / phi3 / gemma layout; gpt2 has a plain MLP):
            per layer  attention  hidden*(heads*head_dim) [q] + 2*hidden*(kv_heads*head_dim) [k, v]
                                  + (heads*head_dim)*hidden [o]   (+ q/k/v biases for qwen2)
                       MLP        3*hidden*intermediate  (gate, up, down; 2*... for a plain MLP)
                       norms      2*hidden
            embedding  vocab*hidden, plus vocab*hidden again for an untied output projection
            final norm hidden
          bytes per parameter: fp32 4, fp16 2. Quantized drafts (specexport.quantize) quantize the
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
kv cache  2 x layers x max_context x kv_heads x head_dim x bytes (4 for fp32 graphs and quantized
          drafts, 2 for fp16 graphs and quantized targets with dtype fp16): the runtime allocates both caches at max context once (engine.py).
work      the peak working memory of one call, which the runtime's memory arena keeps:
            2 x heads x S x T x b   attention scores and probabilities (portable graphs; a fused graph's
                                    GroupQueryAttention runs flash attention on the CUDA provider for
                                    fp16, which keeps no S x T matrix: 0 there)
            3 x S x intermediate x b, 4 x S x hidden x b, 2 x heads x T x head_dim x b (repeated K/V)
            R x vocab x 4           logits rows
          for prefill (S = max_prompt, T = S, R = 1) and verify (S = max_gamma + 1, T = max_context,
          R = S), whichever is larger; b is the graph's activation bytes (2 fp16, else 4).
          Plus the host logits buffer of the runtime: 64 x vocab x 4 bytes per model.
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
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import SpecExportError
from .recipe import MIN_CONTEXT, QUANTIZED_TARGETS, ModelSpec, QuantizationSpec, Recipe, load_recipe, resolve_recipe

GIB = 1 << 30
RUNTIME_OVERHEAD_GIB = 1.0
HOST_LOGITS_ROWS = 64  # engine.OrtModel max_rows: the host logits buffer of each model
TIGHT_FRACTION = 0.10
JETSON_RESERVE_MIN_GIB = 1.5
JETSON_RESERVE_FRACTION = 0.10
WORKSTATION_RESERVE_GIB = 0.5
MATMULNBITS_BLOCK = 32


class PlanError(SpecExportError, ValueError):
    """A model's shape is unknown, or plan arguments are out of range."""


class UnknownDevice(PlanError, KeyError):
    """The device name is not in the device table."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return self.args[0] if self.args else ""


# --------------------------------------------------------------------------- devices


@dataclass(frozen=True)
class Device:
    name: str
    label: str
    memory_gib: float
    shared: bool  # True: Jetson, one memory for CPU and GPU
    note: str = ""

    @property
    def reserve_gib(self) -> float:
        if self.shared:
            return max(JETSON_RESERVE_MIN_GIB, JETSON_RESERVE_FRACTION * self.memory_gib)
        return WORKSTATION_RESERVE_GIB

    @property
    def budget_bytes(self) -> int:
        return int((self.memory_gib - self.reserve_gib) * GIB)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "label": self.label, "memory_gib": self.memory_gib, "shared": self.shared,
                "reserve_gib": round(self.reserve_gib, 2), "budget_gib": round(self.budget_bytes / GIB, 2),
                "note": self.note}


DEVICES: dict[str, Device] = {d.name: d for d in (
    Device("orin-nano-4gb", "Jetson Orin Nano 4GB", 4, True, "JetPack 6.1+, TensorRT 10.3"),
    Device("orin-nano-8gb", "Jetson Orin Nano 8GB", 8, True, "JetPack 6.1+, TensorRT 10.3"),
    Device("orin-nx-8gb", "Jetson Orin NX 8GB", 8, True, "JetPack 6.1+, TensorRT 10.3"),
    Device("orin-nx-16gb", "Jetson Orin NX 16GB", 16, True, "JetPack 6.1+, TensorRT 10.3"),
    Device("agx-orin-32gb", "Jetson AGX Orin 32GB", 32, True, "JetPack 6.1+, TensorRT 10.3"),
    Device("agx-orin-64gb", "Jetson AGX Orin 64GB", 64, True, "JetPack 6.1+, TensorRT 10.3"),
    Device("thor", "Jetson AGX Thor (128 GB)", 128, True, "JetPack 7, a newer TensorRT 10.x"),
    Device("rtx-4090", "GeForce RTX 4090 (workstation)", 24, False, "24 GB GDDR6X"),
    Device("h200", "H200 (workstation / server)", 141, False, "141 GB HBM3e"),
)}


def get_device(name: str) -> Device:
    key = name.strip().lower()
    if key not in DEVICES:
        raise UnknownDevice(f"device {name!r} is unknown; known devices: {', '.join(DEVICES)}")
    return DEVICES[key]


# --------------------------------------------------------------------------- model shapes


@dataclass(frozen=True)
class ModelConfig:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool = False
    gated_mlp: bool = True

    def linear_parameters(self) -> int:
        """Parameters of the decoder layers' MatMul weights (what the quantizers rewrite)."""
        q = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        attention = self.hidden * q + 2 * self.hidden * kv + q * self.hidden
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.intermediate
        return self.layers * (attention + mlp)

    def small_parameters(self) -> int:
        """Norm weights and q/k/v biases."""
        bias = (self.heads + 2 * self.kv_heads) * self.head_dim if self.qkv_bias else 0
        return self.layers * (2 * self.hidden + bias) + self.hidden

    def embedding_parameters(self) -> int:
        return self.vocab * self.hidden

    def parameters(self) -> int:
        """Parameters of the model as published (tied embeddings counted once)."""
        head = 0 if self.tied else self.embedding_parameters()
        return self.linear_parameters() + self.small_parameters() + self.embedding_parameters() + head


# The models of the bundled recipes (their config.json values), so that a plan needs no download.
_LLAMA31_8B = ModelConfig(32, 4096, 14336, 32, 8, 128, 128256, tied=False)
_LLAMA32_1B = ModelConfig(16, 2048, 8192, 32, 8, 64, 128256, tied=True)
_QWEN25_05B = ModelConfig(24, 896, 4864, 14, 2, 64, 151936, tied=True, qkv_bias=True)
_QWEN25_15B = ModelConfig(28, 1536, 8960, 12, 2, 128, 151936, tied=True, qkv_bias=True)
_QWEN25_3B = ModelConfig(36, 2048, 11008, 16, 2, 128, 151936, tied=True, qkv_bias=True)
_QWEN25_7B = ModelConfig(28, 3584, 18944, 28, 4, 128, 152064, tied=False, qkv_bias=True)
_TINYLLAMA = ModelConfig(22, 2048, 5632, 32, 4, 64, 32000, tied=False)
_SMOLLM2_135M = ModelConfig(30, 576, 1536, 9, 3, 64, 49152, tied=True)

KNOWN_CONFIGS: dict[str, ModelConfig] = {
    "builtin:smollm2-135m-instruct": _SMOLLM2_135M,
    "HuggingFaceTB/SmolLM2-135M-Instruct": _SMOLLM2_135M,
    "meta-llama/Llama-3.1-8B-Instruct": _LLAMA31_8B,
    "meta-llama/Meta-Llama-3.1-8B-Instruct": _LLAMA31_8B,
    "hugging-quants/Meta-Llama-3.1-8B-Instruct-AWQ-INT4": _LLAMA31_8B,
    "meta-llama/Llama-3.2-1B-Instruct": _LLAMA32_1B,
    "Qwen/Qwen2.5-0.5B-Instruct": _QWEN25_05B,
    "Qwen/Qwen2.5-1.5B-Instruct": _QWEN25_15B,
    "Qwen/Qwen2.5-3B-Instruct": _QWEN25_3B,
    "Qwen/Qwen2.5-7B-Instruct": _QWEN25_7B,
    "TinyLlama/TinyLlama-1.1B-Chat-v1.0": _TINYLLAMA,
}
_QKV_BIAS_TYPES = ("qwen2",)
_PLAIN_MLP_TYPES = ("gpt2",)


def config_from_dict(data: dict[str, Any]) -> ModelConfig:
    """A ModelConfig from a Hugging Face config.json (llama-style or gpt2 key names)."""
    def get(*keys, default=None):
        for key in keys:
            if data.get(key) is not None:
                return data[key]
        if default is None:
            raise PlanError(f"config.json has none of {keys}; cannot size the model")
        return default

    layers = int(get("num_hidden_layers", "n_layer"))
    hidden = int(get("hidden_size", "n_embd"))
    heads = int(get("num_attention_heads", "n_head"))
    model_type = str(data.get("model_type", ""))
    return ModelConfig(
        layers=layers,
        hidden=hidden,
        intermediate=int(get("intermediate_size", "n_inner", default=4 * hidden)),
        heads=heads,
        kv_heads=int(get("num_key_value_heads", default=heads)),
        head_dim=int(get("head_dim", default=hidden // heads)),
        vocab=int(get("vocab_size")),
        tied=bool(data.get("tie_word_embeddings", True)),  # transformers' default
        qkv_bias=bool(data.get("attention_bias", model_type in _QKV_BIAS_TYPES)),
        gated_mlp=model_type not in _PLAIN_MLP_TYPES,
    )


def _config_from_gguf(path: Path) -> ModelConfig:
    from gguf import GGUFReader  # noqa: PLC0415 - build-side dependency, only for GGUF sources

    reader = GGUFReader(str(path))

    def field_value(key: str):
        item = reader.fields.get(key)
        if item is None:
            return None
        return item.parts[item.data[0]].tolist()[0] if item.data else None

    arch_field = reader.fields.get("general.architecture")
    arch = bytes(arch_field.parts[arch_field.data[0]]).decode() if arch_field else "llama"
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    names = {t.name for t in reader.tensors}
    hidden = field_value(f"{arch}.embedding_length")
    heads = field_value(f"{arch}.attention.head_count")
    if hidden is None or heads is None:
        raise PlanError(f"GGUF file {str(path)!r} lacks {arch}.embedding_length / attention.head_count")
    return ModelConfig(
        layers=int(field_value(f"{arch}.block_count")),
        hidden=int(hidden),
        intermediate=int(field_value(f"{arch}.feed_forward_length") or 4 * hidden),
        heads=int(heads),
        kv_heads=int(field_value(f"{arch}.attention.head_count_kv") or heads),
        head_dim=int(field_value(f"{arch}.attention.key_length") or hidden // heads),
        vocab=len(tokens.data) if tokens is not None else int(field_value(f"{arch}.vocab_size")),
        tied="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
    )


def model_config(spec: ModelSpec, known: dict[str, ModelConfig] | None = None) -> tuple[ModelConfig, str]:
    """(config, where it came from) for a recipe's model: the known table (hub ids of the bundled
    recipes, builtin models), a local folder's config.json, or a local GGUF file."""
    table = {**KNOWN_CONFIGS, **(known or {})}
    if spec.model in table:
        return table[spec.model], "known config"
    path = Path(spec.model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return config_from_dict(json.loads((path / "config.json").read_text(encoding="utf-8"))), f"{path}/config.json"
    gguf = path if path.suffix.lower() == ".gguf" else (path / spec.gguf_file if spec.gguf_file else None)
    if gguf is not None and gguf.is_file():
        return _config_from_gguf(gguf), str(gguf)
    raise PlanError(
        f"cannot size model {spec.model!r}: it is not in the known table ({len(KNOWN_CONFIGS)} models of the bundled"
        " recipes) and is not a local folder with config.json or a local .gguf file; download it (or its config.json)"
        " and give the folder"
    )


# --------------------------------------------------------------------------- estimates


_QUANT_BYTES = {"int8": 1 + 4 / MATMULNBITS_BLOCK, "int4": 0.5 + 4 / MATMULNBITS_BLOCK, "dynamic-int8": 1.0}
_FLOAT_BYTES = {"fp32": 4, "fp16": 2}
PRECISION_BYTES = {**_FLOAT_BYTES, **_QUANT_BYTES}


def _per_param(mode: str, precision: str, q: QuantizationSpec) -> float:
    """Bytes per parameter of a quantized target's tensor stored as `mode` (module docstring)."""
    f = 2 if q.dtype == "fp16" else 4
    block = q.block_size or MATMULNBITS_BLOCK
    if mode == "checkpoint":
        mode = {"gguf": "gguf", "int8": "int8", "int4": "int4"}.get(precision, "fp32")  # gptq / awq: float
    return {"fp32": float(f), "int8": 1 + f / block, "int4": 0.5 + f / block, "gguf": 0.5 + 2 * f / 32,
            "gptq": 0.5 + (f + 0.5) / 32, "awq": 0.5 + (f + 0.5) / 32}[mode]


def quantized_target_bytes(config: ModelConfig, precision: str, q: QuantizationSpec) -> int:
    """Weight bytes of a quantized target: layers, head and embedding as `q` stores them."""
    layers = config.linear_parameters() * _per_param(precision, precision, q)
    embedding = config.embedding_parameters() * _per_param(q.embedding, precision, q)
    head = config.embedding_parameters() * _per_param(q.head, precision, q)
    if config.tied and q.head in ("fp32", "checkpoint") and q.embedding == q.head:
        head = 0  # one float table serves both (the graph's Gemm on the embedding)
    norms = config.small_parameters() * (2 if q.dtype == "fp16" else 4)
    return int(layers + embedding + head + norms)


def weight_bytes(config: ModelConfig, precision: str, quantization: QuantizationSpec | None = None) -> int:
    if precision in QUANTIZED_TARGETS and quantization is not None:
        return quantized_target_bytes(config, precision, quantization)
    if precision in _FLOAT_BYTES:
        return config.parameters() * _FLOAT_BYTES[precision]
    if precision in _QUANT_BYTES:
        quantized = config.linear_parameters() + config.embedding_parameters()  # untied output projection
        floats = config.embedding_parameters() + config.small_parameters()  # embedding and norms stay fp32
        return int(quantized * _QUANT_BYTES[precision]) + 4 * floats
    raise PlanError(f"precision {precision!r} is not one of {', '.join(PRECISION_BYTES)}")


def kv_dtype_bytes(precision: str, quantization: QuantizationSpec | None = None) -> int:
    return 2 if precision == "fp16" or (quantization is not None and quantization.dtype == "fp16") else 4


def kv_bytes(config: ModelConfig, precision: str, max_context: int, quantization: QuantizationSpec | None = None) -> int:
    return 2 * config.layers * max_context * config.kv_heads * config.head_dim * kv_dtype_bytes(precision, quantization)


def call_bytes(config: ModelConfig, precision: str, seq: int, total: int, rows: int,
               quantization: QuantizationSpec | None = None, flash: bool = False) -> int:
    """Working memory of one call with `seq` new tokens attending over `total` positions
    (flash: fused attention that never materializes the scores)."""
    b = kv_dtype_bytes(precision, quantization)
    scores = 0 if flash else 2 * config.heads * seq * total * b
    mlp = 3 * seq * config.intermediate * b
    hidden = 4 * seq * config.hidden * b
    kv_repeat = 2 * config.heads * total * config.head_dim * b
    logits = rows * config.vocab * 4
    return scores + mlp + hidden + kv_repeat + logits


def activation_bytes(config: ModelConfig, precision: str, max_context: int, max_prompt: int, max_gamma: int,
                     quantization: QuantizationSpec | None = None, flash: bool = False) -> int:
    prefill = call_bytes(config, precision, max_prompt, max_prompt, 1, quantization, flash)
    verify_s = min(max_gamma + 1, max_context)
    verify = call_bytes(config, precision, verify_s, max_context, verify_s, quantization, flash)
    return max(prefill, verify)


@dataclass
class ModelEstimate:
    role: str  # target | draft
    model: str
    precision: str
    config: ModelConfig
    config_source: str
    parameters: int
    weight_bytes: int
    kv_bytes: int
    activation_bytes: int
    logits_buffer_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.activation_bytes + self.logits_buffer_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "role": self.role, "model": self.model, "precision": self.precision, "config_source": self.config_source,
            "config": vars(self.config).copy(), "parameters": self.parameters, "weight_bytes": self.weight_bytes,
            "kv_bytes": self.kv_bytes, "activation_bytes": self.activation_bytes,
            "logits_buffer_bytes": self.logits_buffer_bytes, "total_bytes": self.total_bytes,
        }


@dataclass
class PlanReport:
    recipe: str
    device: Device
    max_context: int
    max_prompt: int
    max_gamma: int
    models: list[ModelEstimate]
    overhead_bytes: int
    advice: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(m.total_bytes for m in self.models) + self.overhead_bytes

    @property
    def budget_bytes(self) -> int:
        return self.device.budget_bytes

    @property
    def headroom_bytes(self) -> int:
        return self.budget_bytes - self.total_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.budget_bytes

    @property
    def tight(self) -> bool:
        return self.fits and self.headroom_bytes < TIGHT_FRACTION * self.budget_bytes

    def lines(self) -> list[str]:
        d = self.device
        verdict = "FITS" if self.fits else "DOES NOT FIT"
        if self.tight:
            verdict += " (tight)"
        out = [
            f"{self.recipe} on {d.label}: {verdict} - needs {_gib(self.total_bytes)} of a {_gib(self.budget_bytes)}"
            f" budget ({d.memory_gib:g} GiB {'shared CPU/GPU memory' if d.shared else 'GPU memory'} minus"
            f" {d.reserve_gib:.1f} GiB reserve); headroom {_gib(self.headroom_bytes)}",
            f"  max_context {self.max_context}, prompts up to {self.max_prompt} tokens in one call,"
            f" verify up to {self.max_gamma + 1} tokens",
        ]
        for m in self.models:
            out.append(
                f"  {m.role:<6} {m.model} ({m.precision}, {m.parameters / 1e9:.3g}B params): weights {_gib(m.weight_bytes)},"
                f" KV cache {_gib(m.kv_bytes)}, working memory {_gib(m.activation_bytes + m.logits_buffer_bytes)}"
            )
        out.append(f"  runtime overhead {_gib(self.overhead_bytes)} (CUDA context, libraries, Python)")
        out += [f"  note: {n}" for n in self.notes]
        out += [f"  advice: {a}" for a in self.advice]
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "recipe": self.recipe, "device": self.device.to_dict(), "fits": self.fits, "tight": self.tight,
            "total_bytes": self.total_bytes, "budget_bytes": self.budget_bytes, "headroom_bytes": self.headroom_bytes,
            "max_context": self.max_context, "max_prompt": self.max_prompt, "max_gamma": self.max_gamma,
            "overhead_bytes": self.overhead_bytes, "models": [m.to_dict() for m in self.models],
            "advice": list(self.advice), "notes": list(self.notes),
        }


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def _load(recipe: Recipe | str | Path) -> Recipe:
    if isinstance(recipe, Recipe):
        return recipe
    return load_recipe(resolve_recipe(recipe))


@dataclass(frozen=True)
class _Shapes:
    target: tuple[ModelConfig, str]
    draft: tuple[ModelConfig, str] | None


def _estimate(role: str, model: str, precision: str, shape: tuple[ModelConfig, str], max_context: int,
              max_prompt: int, max_gamma: int, quantization: QuantizationSpec | None = None,
              flash: bool = False) -> ModelEstimate:
    config, source = shape
    label = precision if quantization is None or quantization.dtype == "fp32" else f"{precision}, {quantization.dtype}"
    return ModelEstimate(
        role=role, model=model, precision=label, config=config, config_source=source,
        parameters=config.parameters(), weight_bytes=weight_bytes(config, precision, quantization),
        kv_bytes=kv_bytes(config, precision, max_context, quantization),
        activation_bytes=activation_bytes(config, precision, max_context, max_prompt, max_gamma, quantization, flash),
        logits_buffer_bytes=HOST_LOGITS_ROWS * config.vocab * 4,
    )


def _report(recipe: Recipe, device: Device, shapes: _Shapes, max_context: int, max_prompt: int | None) -> PlanReport:
    prompt = min(max_prompt or max_context, max_context)
    gamma = max(recipe.speculation.max_gamma, 8)
    q = recipe.target.quantization
    target_fp16 = recipe.target.precision == "fp16" or (q is not None and q.dtype == "fp16")
    flash = recipe.graph == "fused" and target_fp16  # GroupQueryAttention on CUDA (fp16 only)
    models = [_estimate("target", recipe.target.model, recipe.target.precision, shapes.target, max_context, prompt, gamma,
                        q, flash)]
    if recipe.draft.kind == "eagle3":
        models.append(_head_estimate(recipe, shapes.target[0], max_context))
    elif recipe.draft.has_graph and shapes.draft is not None:
        name = recipe.draft.model.model if recipe.draft.kind == "model" else f"{recipe.target.model} (self-draft)"
        models.append(_estimate("draft", name, recipe.draft.precision, shapes.draft, max_context, prompt, gamma,
                                flash=flash and recipe.draft.precision == "fp16"))
    return PlanReport(recipe=recipe.name, device=device, max_context=max_context, max_prompt=prompt, max_gamma=gamma,
                      models=models, overhead_bytes=int(RUNTIME_OVERHEAD_GIB * GIB))


HEAD_DRAFT_VOCAB = 32000  # a head's draft vocabulary when its config is not at hand (published heads: 32k)


HEAD_BYTES_PER_PARAM = {"fp32": 4.0, "fp16": 2.0, "int8": 1.0 + 4.0 / 32}  # int8: codes + an fp32 scale per 32
HEAD_COMPUTE = {"fp32": "fp32", "fp16": "fp16", "int8": "fp32"}  # activations and KV cache


def _head_estimate(recipe: Recipe, target: ModelConfig, max_context: int) -> ModelEstimate:
    """An EAGLE-3 head at draft.eagle3.precision: fc [H, 3H], one layer whose q/k/v read 2H, its own
    lm_head [V_draft, H] and a copy of the target's embedding [V, H]; its KV cache has one layer.
    V_draft from the head's local config.json, else HEAD_DRAFT_VOCAB (capped at the target's)."""
    folder = Path(recipe.draft.model.model).expanduser()
    draft_vocab = min(HEAD_DRAFT_VOCAB, target.vocab)
    if (folder / "config.json").is_file():
        draft_vocab = int(json.loads((folder / "config.json").read_text(encoding="utf-8")).get("draft_vocab_size", draft_vocab))
    H, q, kv = target.hidden, target.heads * target.head_dim, target.kv_heads * target.head_dim
    params = 3 * H * H + 2 * H * (q + 2 * kv) + q * H + 3 * H * target.intermediate + draft_vocab * H + target.vocab * H
    layer = ModelConfig(1, H, target.intermediate, target.heads, target.kv_heads, target.head_dim, draft_vocab, True)
    precision = recipe.draft.precision
    compute = HEAD_COMPUTE[precision]
    return ModelEstimate(role="draft", model=f"{recipe.draft.model.model} (EAGLE-3 head)", precision=precision,
                         config=layer, config_source="target shape", parameters=params,
                         weight_bytes=int(HEAD_BYTES_PER_PARAM[precision] * params),
                         kv_bytes=kv_bytes(layer, compute, max_context),
                         activation_bytes=call_bytes(layer, compute, min(max_context, 512), max_context, 1),
                         logits_buffer_bytes=HOST_LOGITS_ROWS * draft_vocab * 4)


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
    return recipe.with_overrides(changes)


def _advise(recipe: Recipe, device: Device, shapes: _Shapes, report: PlanReport, max_prompt: int | None) -> list[str]:
    advice: list[str] = []
    need = report.total_bytes

    def verdict(other: PlanReport) -> str:
        if other.fits:
            return f"fits ({_gib(other.total_bytes)} of {_gib(other.budget_bytes)})"
        return f"still {_gib(other.total_bytes)}, over the {_gib(other.budget_bytes)} budget"

    ctx = _largest_context(recipe, device, shapes, max_prompt, recipe.max_context)
    if ctx is not None:
        advice.append(f"lower max_context to {ctx} (from {recipe.max_context}): fits")
    else:
        floor = _report(recipe, device, shapes, MIN_CONTEXT, max_prompt)
        advice.append(
            f"a shorter context does not help enough: even max_context {MIN_CONTEXT} needs {_gib(floor.total_bytes)}"
            f" (weights alone {_gib(sum(m.weight_bytes for m in floor.models))})"
        )
    prompt_cap = min(512, recipe.max_context)
    if (max_prompt or recipe.max_context) > prompt_cap:
        capped = _report(recipe, device, shapes, recipe.max_context, prompt_cap)
        if capped.total_bytes < need:
            advice.append(
                f"feed prompts in chunks of {prompt_cap} tokens (TensorRT engines do: trt_build --max-prompt {prompt_cap}):"
                f" {verdict(capped)}"
            )
    if recipe.draft.has_graph and recipe.draft.kind != "eagle3" and recipe.draft.precision != "int4":
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
        alt = _variant(recipe, draft={"proposer": "ngram", "ngram_sizes": [3, 2, 1]}, **{"speculation.proposer": "ngram"})
        advice.append(f"n-gram proposer instead of a draft model (draft: {{proposer: ngram}}): "
                      f"{verdict(_report(alt, device, _Shapes(shapes.target, None), recipe.max_context, max_prompt))}")
    if recipe.target.precision == "fp32":
        alt = _variant(recipe, **{"target.precision": "fp16"})
        advice.append(f"fp16 target (target.precision: fp16): {verdict(_report(alt, device, shapes, recipe.max_context, max_prompt))}")
    if recipe.target.precision not in QUANTIZED_TARGETS:
        dtype = "fp16" if recipe.target.precision == "fp16" else "fp32"
        for precision in ("int8", "int4"):
            alt = _variant(recipe, **{"target.precision": precision, "target.quantization": {"dtype": dtype},
                                      "graph": "fused"})
            other = _report(alt, device, shapes, recipe.max_context, max_prompt)
            if other.total_bytes < need:
                advice.append(f"{precision} target weights (target.precision: {precision}, quantization.dtype {dtype};"
                              f" MatMulNBits, fused graph, ONNX Runtime CPU / CUDA): {verdict(other)}")
                if other.fits:
                    break
    bigger = [d.name for d in DEVICES.values() if d.shared == device.shared and d.memory_gib > device.memory_gib
              and _report(recipe, d, shapes, recipe.max_context, max_prompt).fits]
    if bigger:
        advice.append(f"as is, it fits: {', '.join(bigger)}")
    return advice


def plan(recipe: Recipe | str | Path, device: str, *, max_prompt: int | None = None, max_context: int | None = None,
         known: dict[str, ModelConfig] | None = None) -> PlanReport:
    """Memory plan of `recipe` (a Recipe, a recipe file or a bundled recipe name) on `device`.

    max_prompt: longest prompt fed in one call (default: max_context, the worst case of the ONNX
    Runtime backend; TensorRT engines chunk prefill at their --max-prompt). max_context
    overrides the recipe's. known: extra {model id: ModelConfig} for models without a local
    config. Raises UnknownDevice (listing the devices) or PlanError."""
    dev = get_device(device)
    spec = _load(recipe)
    if max_context is not None:
        spec = spec.with_overrides({"max_context": max_context})
    if max_prompt is not None and max_prompt < 1:
        raise PlanError(f"max_prompt must be >= 1, got {max_prompt}")
    target = model_config(spec.target, known)
    draft = None
    if spec.draft.kind == "model":
        draft = model_config(spec.draft.model, known)
    elif spec.draft.kind == "from_target":
        draft = target
    shapes = _Shapes(target, draft)
    report = _report(spec, dev, shapes, spec.max_context, max_prompt)
    if not report.fits or report.tight:
        report.advice = _advise(spec, dev, shapes, report, max_prompt)
    if report.tight:
        report.notes.append(
            f"headroom under {TIGHT_FRACTION:.0%} of the budget: measure on the device (tegrastats / nvidia-smi)"
        )
    if spec.graph == "fused":  # every device in DEVICES is a GPU
        fp16 = spec.target.precision == "fp16" or (spec.target.quantization is not None and spec.target.quantization.dtype == "fp16")
        gpu = "the ONNX Runtime CUDA provider" + ("" if fp16 else " only with an fp16 target (or quantization.dtype fp16)")
        report.notes.append(
            f"graph: fused runs on {gpu} (GroupQueryAttention) and never on TensorRT; for TensorRT engines build"
            " with graph: portable (docs/graph-contract.md)"
        )
    return report


__all__ = [
    "DEVICES", "Device", "KNOWN_CONFIGS", "ModelConfig", "ModelEstimate", "PlanError", "PlanReport", "UnknownDevice",
    "activation_bytes", "config_from_dict", "get_device", "kv_bytes", "model_config", "plan",
    "weight_bytes",
]
