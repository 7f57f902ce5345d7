"""The graph contract shared by the build side and the runtime (docs/graph-contract.md).

This module is the single machine-readable definition: the exporter names its inputs and
outputs with it, the runtime binds buffers with it, and the tests of both halves check graphs
against it. Bump CONTRACT_VERSION on any change a runtime would notice.

One graph serves prefill (S = prompt length), single-token decode (S = 1) and the
multi-token verify (S = gamma + 1). Batch is fixed at 1.

Inputs
    input_ids        int64     [1, S]              tokens at positions P .. P+S-1
    logits_index     int64     [R]                 rows of S whose logits are returned (0 <= r < S)
    past_key_{i}     kv_dtype  [1, P, H_kv, D]     valid prefix of layer i's key buffer
    past_value_{i}   kv_dtype  [1, P, H_kv, D]
Outputs
    logits           float32   [1, R, V]           V = embedding rows of the model
    new_key_{i}      kv_dtype  [1, S, H_kv, D]     keys of the S input tokens (rotary applied)
    new_value_{i}    kv_dtype  [1, S, H_kv, D]

Invariants
    * positions are derived from the past length: token s sits at position P + s;
    * the cache is time-major, so for a buffer K of shape [1, T_max, H_kv, D] the past is the
      contiguous view K[:, :P] and the new keys are written straight into K[:, P:P+S];
      rollback after a rejection is a cursor move (P := P - n), nothing is copied;
    * KV heads are stored unrepeated (H_kv, grouped-query attention is preserved);
    * the graph attends causally over [past, new] and never reads cache rows >= P.
"""

from __future__ import annotations

from dataclasses import dataclass

CONTRACT_VERSION = "1.0"
"""major.minor: a runtime reads graphs of its own major version and refuses any other."""

INPUT_IDS = "input_ids"
LOGITS_INDEX = "logits_index"
LOGITS = "logits"

KV_DTYPES = ("float32", "float16")


def past_key(layer: int) -> str:
    return f"past_key_{layer}"


def past_value(layer: int) -> str:
    return f"past_value_{layer}"


def new_key(layer: int) -> str:
    return f"new_key_{layer}"


def new_value(layer: int) -> str:
    return f"new_value_{layer}"


@dataclass(frozen=True)
class GraphSpec:
    """Shape facts a runtime needs to allocate and bind the caches of one graph."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    embedding_rows: int
    kv_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype {self.kv_dtype!r} is not one of {KV_DTYPES}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "embedding_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def input_names(self) -> list[str]:
        names = [INPUT_IDS, LOGITS_INDEX]
        for i in range(self.num_layers):
            names += [past_key(i), past_value(i)]
        return names

    def output_names(self) -> list[str]:
        names = [LOGITS]
        for i in range(self.num_layers):
            names += [new_key(i), new_value(i)]
        return names

    def cache_shape(self, max_context: int) -> tuple[int, int, int, int]:
        """Shape of one preallocated K or V buffer: [1, T_max, H_kv, D]."""
        return (1, max_context, self.num_kv_heads, self.head_dim)

    def kv_bytes(self, max_context: int) -> int:
        """Bytes of all K and V buffers of this graph at max context."""
        itemsize = 4 if self.kv_dtype == "float32" else 2
        return 2 * self.num_layers * max_context * self.num_kv_heads * self.head_dim * itemsize


def parse_version(version: str) -> tuple[int, int]:
    try:
        major, minor = version.split(".")
        return int(major), int(minor)
    except ValueError as exc:
        raise ValueError(f"contract version {version!r} is not of the form MAJOR.MINOR") from exc


def is_supported(version: str) -> bool:
    """A runtime reads graphs of its own major version (any minor)."""
    return parse_version(version)[0] == parse_version(CONTRACT_VERSION)[0]
