"""The pure parts of the native TensorRT backend (trt_backend.py), unit tested without a GPU: KV
cache slot addresses and the per-call bindings of a time-major cache (with aligned staging where
a slot is not 256-byte aligned), the EAGLE-3 row tensors of a graph, prefill chunking and the
limits of a set of optimization profiles.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from . import contract
from .contract import GraphSpec
from .errors import ContractError, InvalidArgument
from .trt_engines import Profile

ALIGNMENT = 256  # TensorRT: "The pointer must have at least 256-byte alignment" (IExecutionContext::setTensorAddress)
ITEMSIZE = {"float32": 4, "float16": 2}


def slot_address(base: int, past: int, row_bytes: int) -> int:
    """Device address of cache row `past` in a time-major [1, T_max, H_kv, D] buffer."""
    if past < 0 or row_bytes <= 0:
        raise InvalidArgument(f"past must be >= 0 and row_bytes > 0, got past={past}, row_bytes={row_bytes}")
    return base + past * row_bytes


@dataclass(frozen=True)
class KvBinding:
    name: str
    address: int
    shape: tuple[int, int, int, int]
    is_input: bool


def plan_kv_bindings(
    spec: GraphSpec,
    buffers: Sequence[int],
    past: int,
    seq: int,
    staging: Sequence[int] | None = None,
    alignment: int = ALIGNMENT,
) -> tuple[list[KvBinding], list[tuple[int, int, int]]]:
    """Bindings of the 4 * layers cache tensors for S=`seq` tokens at cursor P=`past`, in a layout
    that binds per call (not in place): past_* the prefix, the K/V outputs the slot at the cursor.

    buffers: device base addresses, [k_0, v_0, k_1, v_1, ...] (layout of engine.OrtModel).
    staging: aligned scratch buffers in the same order, used when a slot address is not
    `alignment`-aligned. Returns (bindings, copies); copies are (dst, src, nbytes) device-to-
    device moves from staging into the cache slot, to run after the engine."""
    if len(buffers) != 2 * spec.num_layers:
        raise InvalidArgument(f"need {2 * spec.num_layers} cache buffers, got {len(buffers)}")
    layout = spec.layout
    if layout.in_place or layout.time_axis != 1:  # slots at base + P * row need whole rows contiguous
        raise ContractError(f"the native TensorRT backend binds time-major slots; this graph is {spec.kv_layout}")
    row = spec.num_kv_heads * spec.head_dim * ITEMSIZE[spec.kv_dtype]
    past_shape = layout.cache_shape(past, spec.num_kv_heads, spec.head_dim)
    new_shape = layout.cache_shape(seq, spec.num_kv_heads, spec.head_dim)
    names = []
    for i in range(spec.num_layers):
        new_k, new_v = layout.kv_outputs(i)
        names += [(contract.past_key(i), new_k), (contract.past_value(i), new_v)]
    bindings: list[KvBinding] = []
    copies: list[tuple[int, int, int]] = []
    for k, ((past_name, new_name), base) in enumerate(zip(names, buffers, strict=True)):
        bindings.append(KvBinding(past_name, base, past_shape, True))
        slot = slot_address(base, past, row)
        if slot % alignment == 0:
            bindings.append(KvBinding(new_name, slot, new_shape, False))
            continue
        if staging is None:
            raise InvalidArgument(
                f"cache slot {slot:#x} of {new_name} is not {alignment}-byte aligned and no staging buffer was given"
            )
        bindings.append(KvBinding(new_name, staging[k], new_shape, False))
        copies.append((slot, staging[k], seq * row))
    return bindings, copies


def needs_staging(spec: GraphSpec, alignment: int = ALIGNMENT) -> bool:
    """Whether some cursor position gives an unaligned slot (row bytes not a multiple of it)."""
    return (spec.num_kv_heads * spec.head_dim * ITEMSIZE[spec.kv_dtype]) % alignment != 0


@dataclass(frozen=True)
class RowTensor:
    """A float32 tensor [1, n, width] with one row per fed token (inputs, hidden_states) or per
    returned logits row (hidden_out), n <= capacity: a device buffer and a pinned host twin."""

    name: str
    capacity: int  # rows: the engine's max S (per token) or max R (per logits row)
    width: int
    is_input: bool
    per_logits_row: bool = False  # one row per returned logits row (hidden_out), else per fed token


def plan_row_tensors(spec: GraphSpec, max_seq: int, max_rows: int) -> list[RowTensor]:
    """The EAGLE-3 tensors (feature eagle3_head) of a graph besides ids, logits and caches: a target's
    hidden_states output, or a head's features and draft_hidden inputs and hidden_out output."""
    if spec.is_head:
        return [
            RowTensor(contract.HEAD_FEATURES, max_seq, spec.feature_width, True),
            RowTensor(contract.HEAD_HIDDEN, max_seq, spec.hidden_width, True),
            RowTensor(contract.HEAD_HIDDEN_OUT, max_rows, spec.hidden_width, False, per_logits_row=True),
        ]
    if spec.has_features:
        return [RowTensor(contract.HIDDEN_STATES, max_seq, spec.feature_width, False)]
    return []


def prefill_chunks(seq: int, max_chunk: int) -> list[int]:
    """Sizes of the calls that feed `seq` tokens at most `max_chunk` at a time."""
    if seq < 1 or max_chunk < 1:
        raise InvalidArgument(f"seq and max_chunk must be >= 1, got {seq}, {max_chunk}")
    full, rest = divmod(seq, max_chunk)
    return [max_chunk] * full + ([rest] if rest else [])


def max_seq(profiles: Sequence[Profile]) -> int:
    return max(p.seq[2] for p in profiles)


def max_rows(profiles: Sequence[Profile]) -> int:
    return max(p.rows[2] for p in profiles)


def prefill_limit(profiles: Sequence[Profile], rows: int = 1) -> int:
    """Largest S a prefill-like call can take: one asking for `rows` logits rows (a padded
    graph's min_rows, feature row_padding; else 1)."""
    return max(p.seq[2] for p in profiles if p.rows[0] <= rows <= p.rows[2])
