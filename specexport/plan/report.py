"""A memory plan's report: one ModelEstimate per model (weights, KV cache, working memory) and the
PlanReport over them, with its verdict against the device's budget, its lines and its JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..models.config import NormalizedConfig
from ..recipe.spec import QuantizationSpec
from .devices import GIB, Device
from .sizes import head_padding_bytes, kv_sharing_saving_bytes, summary, window_saving_bytes

TIGHT_FRACTION = 0.10


@dataclass
class ModelEstimate:
    role: str  # target | draft
    model: str
    precision: str
    config: NormalizedConfig
    config_source: str
    parameters: int
    weight_bytes: int
    kv_bytes: int
    activation_bytes: int
    logits_buffer_bytes: int
    state_bytes: int = 0  # a hybrid's recurrent states at every kept position (sizes.state_bytes)

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.state_bytes + self.activation_bytes + self.logits_buffer_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "model": self.model,
            "precision": self.precision,
            "config_source": self.config_source,
            "config": summary(self.config),
            "parameters": self.parameters,
            "weight_bytes": self.weight_bytes,
            "kv_bytes": self.kv_bytes,
            "state_bytes": self.state_bytes,
            "activation_bytes": self.activation_bytes,
            "logits_buffer_bytes": self.logits_buffer_bytes,
            "total_bytes": self.total_bytes,
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
    max_batch: int = 1  # the target's cache slots (its KV cache and logits rows are counted for all)
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
            f"{self.recipe} on {d.label}: {verdict} - needs {gib(self.total_bytes)} of a {gib(self.budget_bytes)}"
            f" budget ({d.memory_gib:g} GiB {'shared CPU/GPU memory' if d.shared else 'GPU memory'} minus"
            f" {d.reserve_gib:.1f} GiB reserve); headroom {gib(self.headroom_bytes)}",
            f"  max_context {self.max_context}, prompts up to {self.max_prompt} tokens in one call,"
            f" verify up to {self.max_gamma + 1} tokens"
            + (f", {self.max_batch} sequences per target call (batch graph)" if self.max_batch > 1 else ""),
        ]
        for m in self.models:
            out.append(
                f"  {m.role:<6} {m.model} ({m.precision}, {m.parameters / 1e9:.3g}B params):"
                f" weights {gib(m.weight_bytes)},"
                f" KV cache {gib(m.kv_bytes)},"
                + (f" recurrent state {gib(m.state_bytes)}," if m.state_bytes else "")
                + f" working memory {gib(m.activation_bytes + m.logits_buffer_bytes)}"
            )
        out.append(f"  runtime overhead {gib(self.overhead_bytes)} (CUDA context, libraries, Python)")
        out += [f"  note: {n}" for n in self.notes]
        out += [f"  advice: {a}" for a in self.advice]
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "recipe": self.recipe,
            "device": self.device.to_dict(),
            "fits": self.fits,
            "tight": self.tight,
            "total_bytes": self.total_bytes,
            "budget_bytes": self.budget_bytes,
            "headroom_bytes": self.headroom_bytes,
            "max_context": self.max_context,
            "max_prompt": self.max_prompt,
            "max_gamma": self.max_gamma,
            "max_batch": self.max_batch,
            "overhead_bytes": self.overhead_bytes,
            "models": [m.to_dict() for m in self.models],
            "advice": list(self.advice),
            "notes": list(self.notes),
        }


def gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def cache_notes(c: NormalizedConfig, precision: str, max_context: int, q: QuantizationSpec | None) -> list[str]:
    """The target's K/V cache notes: sliding windows (what a ring buffer would save), layers reading
    an earlier layer's K/V (what they save), heads padded to the caches' width (what it takes)."""
    notes = []
    owning = c.attention_layers
    windowed = sum(c.layers[i].window is not None for i in owning)
    if windowed:
        saving = window_saving_bytes(c, precision, max_context, q)
        notes.append(
            f"{windowed} of {len(owning)} target caches serve a {'/'.join(map(str, c.windows))}-token window;"
            f" the graphs keep max_context cache rows on every layer (a ring-buffer cache would save {gib(saving)})"
        )
    shared = sum(layer.kv_source is not None for layer in c.layers)
    if shared:
        saving = kv_sharing_saving_bytes(c, precision, max_context, q)
        notes.append(
            f"K/V sharing: {shared} of {c.num_layers} target layers read an earlier layer's K/V and own no cache"
            f" ({len(owning)} caches; {gib(saving)} saved at max_context)"
        )
    padding = head_padding_bytes(c, precision, max_context, q)
    if padding:
        narrow = sum(c.layer_head_dim(i) < c.head_dim for i in owning)
        notes.append(
            f"{narrow} target caches belong to layers narrower than head_dim {c.head_dim} and hold zeros in the"
            f" padding ({gib(padding)} of the KV cache)"
        )
    return notes
