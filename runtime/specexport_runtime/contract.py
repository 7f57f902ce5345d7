"""The graph contract shared by the build side and the runtime (docs/graph-contract.md).

This module is the single machine-readable definition: the exporter names its inputs and
outputs with it, the runtime binds buffers with it, and the tests of both halves check graphs
against it. Bump CONTRACT_VERSION on any change a runtime would notice.

One graph serves prefill (S = prompt length), single-token decode (S = 1) and the
multi-token verify (S = gamma + 1). A graph carries one sequence, except a target's batch
graph (feature cache_slots, below). Two KV layouts exist; the manifest
records each graph's (`kv_layout`), and the input/output names below say which a graph uses.
`KvLayout` (LAYOUTS; a graph's GraphSpec.layout) holds each layout's facts: its buffer shape,
the inputs that carry the cursor, whether the graph writes its cache in place, which recipe
`graph:` form builds it, and whether it needs ONNX Runtime's GroupQueryAttention.

Layout "time_major" (feature time_major; portable: ONNX standard ops only, what TensorRT builds)
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

Layout "head_major_inplace" (feature head_major_in_place; ONNX Runtime contrib ops, CPU and CUDA EPs)
Inputs
    input_ids              int64     [1, S]
    logits_index           int64     [R]
    seqlens_k              int32     [1]                  P + S - 1
    total_sequence_length  int32     []                   P + S
    past_key_{i}           kv_dtype  [1, H_kv, T_max, D]  layer i's whole key buffer
    past_value_{i}         kv_dtype  [1, H_kv, T_max, D]
Outputs
    logits                 float32   [1, R, V]
    present_key_{i}        kv_dtype  [1, H_kv, T_max, D]  bound to the same memory as past_key_{i}
    present_value_{i}      kv_dtype  [1, H_kv, T_max, D]

Invariants
    * positions P .. P+S-1 are derived from seqlens_k / total_sequence_length;
    * the graph writes the S new keys/values in place into rows P .. P+S-1 of the buffer and
      attends causally over rows 0 .. P+S-1 only; rows >= P+S are never read, so rollback
      is again a cursor move (the next call passes the smaller P) and nothing is copied;
    * the cache dimension T is symbolic in the graph; the runtime binds T_max = the artifact's
      max_context rows, and the rotary tables inside the graph have max_context rows, so
      P + S <= max_context.

Row-invariant calls (feature row_padding; a manifest entry's `min_rows`)
    ONNX Runtime's CPU kernels take another path for a 1-row call than for calls of 2 or more
    rows (MatMul, and MatMulNBits with int8 activations quantize and sum differently), so the
    logits of a token fed alone differ from the same token's row inside a verify call, while
    rows of calls with 2 to 17 rows are bitwise equal (docs/performance.md, Exactness). A graph
    whose entry says min_rows = m is only ever called with M >= m input rows and asked for
    R >= min(m, M) logits rows: the runtime pads the S real tokens with M - S copies of the
    last one after them and moves the cursor back to P + S afterwards, so the padding rows'
    K/V are never read (the next call overwrites them). A fused graph may pad its attention
    instead (entry `cache_pad` c = 1): its GroupQueryAttention gets a copy of the call's last
    row after the real ones, writes its K/V at cache row P + S and drops its output; ONNX
    Runtime's MatMuls are row-invariant already, and only GroupQueryAttention's 1-row path
    differs, so this costs one attention row instead of a padded call. Positions reach
    max_context + m - 2 + c (the fused graph's rotary tables have max_context + m - 1 + c rows)
    and the runtime allocates max_context + m - 1 + c cache rows. Greedy speculative output
    then equals target-only output bit for bit; the manifest's `exactness` records what the
    build measured ("bitwise" or "numerical").

Target features for a learned draft head (feature eagle3_head; a manifest entry's `feature_layers`)
    hidden_states    float32   [1, S, F]           one more output, right after `logits`: for
                                                   every input row, the residual stream entering
                                                   the entry's feature_layers (transformers'
                                                   output_hidden_states[i]) concatenated in that
                                                   order, F = len(feature_layers) * hidden
    An EAGLE-3 head reads three of them (low | mid | high) per token. Both layouts have it.

Windowed attention in the fused layout (feature attention_windows; a manifest entry's `attention_windows`)
    A head_major_inplace graph of a sliding-window family (Mistral, Phi-3, Gemma 2/3, Qwen with
    use_sliding_window) passes each layer's window W to GroupQueryAttention's local_window_size:
    a query sees the W most recent keys, its own included, as transformers does. ONNX Runtime
    counts it so since 1.24.1 (before, W + 1 keys: one key more on every row past the window), so
    a runtime refuses such a graph on an older ONNX Runtime (window_runtime_error). The entry
    lists the distinct windows. Portable graphs apply windows in their mask (no contract change).

Cache slots (feature cache_slots; a target entry's `batch_graph` and `max_batch` K; GraphSpec.slots)
    A head_major_inplace decoder serving K sequences per call: input_ids [1, N] packs every
    slot's rows (slot 0 first), slot_rows int64 [K] says how many each has (>= 1 in 1.5; since
    1.6 an idle slot has 0), seqlens_k and total_sequence_length are int32 [K] (P + n - 1 and
    P + n for n rows), and each layer has per-slot caches past_key_{i}_slot{b} /
    present_key_{i}_slot{b} [1, H_kv, T_max, D] (bound to one memory, written in place). The
    MatMuls run once over N rows; attention is one GroupQueryAttention per slot and layer (an
    idle slot's on one throwaway row written past its cursor).

Portable cache slots (feature cache_slots; a time_major entry's `batch_graph` and `max_batch` K)
    The portable decoder serving K sequences per call in the time_major layout: input_ids [1, N]
    packs every slot's rows (slot 0 first) and slot_rows int64 [K] says how many each has (0 for
    an idle slot), as in 1.6; each layer has per-slot inputs past_key_{i}_slot{b} [1, P_b, H_kv, D]
    (the prefix view of slot b's buffer, P_b its own cursor) and outputs new_key_{i}_slot{b}
    [1, n_b, H_kv, D] (bound to its rows P_b .. P_b + n_b - 1). The MatMuls run once over N rows;
    each slot's rows attend over their own past and themselves (its positions P_b, P_b + 1, ...),
    with the batch-1 graph's operators, so a slot's rows are those of a batch-1 call of its rows.

Tree verify (feature tree_verify; a target entry's `tree_graph`; GraphSpec.tree)
    A head_major_inplace decoder of one slot that scores a draft tree in one call: its S rows
    are the tree's rows in topological order (row 0 the root, the last committed token), with
    two more inputs after the cursor inputs:
    position_ids   int64    [1, S]   P + depth of each row (the root at P)
    tree_bias      float32  [S, S]   additive: 0 where row j is row i or an ancestor of it,
                                     the dtype's lowest finite value elsewhere
    Row r's K/V land at cache row P + r (rotary at its own position); the graph attends over
    the past rows and, among the new ones, the row's ancestors only. The runtime then moves the
    accepted path's rows to P + 1, P + 2, ... (engine.OrtModel.keep_path) and sets the cursor
    after them. It shares the batch-1 graph's weights file and cache; the tree graph's rows are
    numerically, not bitwise, those of the chain graph (docs/graph-contract.md).
    A target with features (1.2) returns hidden_states [1, S, F] for every tree row too.
    Windows (1.4's families) apply by position, as in 1.9: the graph's bias hides keys W or more
    positions before a row's P + depth (GroupQueryAttention's local window would count rows).

Portable tree verify (feature tree_verify; a time_major target entry's `tree_graph`)
    The same tree call in the time_major layout: the portable decoder with position_ids [1, S] and
    tree_bias [S, S] after logits_index (ONNX standard ops: the bias joins the explicit mask),
    past_* the prefix views [1, P, H_kv, D] and new_* [1, S, H_kv, D] the tree rows' K/V, which
    the runtime binds to cache rows P .. P+S-1 as for a chain call. Windows (1.4's families)
    apply by position: a row sees the keys within its window of its own position P + depth.

Head tree graph (feature eagle3_head_tree; an eagle3_head or mtp entry's `tree_graph`, head_major_inplace)
    The EAGLE-3 head with the same two inputs after its cursor inputs, one call per tree depth:
    tree_bias      float32  [S, M]   M >= S: over the last M cache rows (the call's S rows last),
                                     0 where the row may attend; rows before them always attend
    so a call's rows see the head's past and their own ancestors among the M rows of the round.

Recurrent state (feature recurrent_state; a decoder entry's `states`; GraphSpec.states)
    A hybrid decoder (LFM2's short convolutions; linear-attention and SSM layers) carries, beside
    the K/V caches of its attention layers, one state tensor per recurrent site j, of a fixed shape
    s_j (a convolution window: [L - 1, C], the last L - 1 conv inputs, oldest first). Its K/V
    names count attention layers only (past_key_0 is the first attention layer's), and
    state_index  int64     [Rs]                rows of S whose state is returned (0 <= r < S)
    past_state_{j} float32  [1, *s_j]          the state before the call's first row (zeros at P = 0)
    new_state_{j}  float32  [1, Rs, *s_j]      the state after each row of state_index
    States are float32 whatever the graph's dtype (a model-dtype value such as a conv input
    converts to float32 and back exactly; a scan state keeps its float32 accumulation).
    A row's state depends only on the rows before it (causal), never on the rows after it, so
    the state after any accepted row of a verify call is returned by that call; the runtime keeps
    the states of the last positions (engine.StateHistory) and a rollback to any of them is a
    cursor move plus choosing which kept state the next call binds: O(1), nothing recomputed.
    A slots graph (feature recurrent_slots, 1.12) has these per slot b, suffixed like its caches:
    state_index_slotb, past_state_{j}_slotb, new_state_{j}_slotb; each slot's recurrence runs on
    its own packed rows (an idle slot's one throwaway row; its state_index is empty). Tree
    graphs carry no state (a build refuses them).

DFlash block drafters (feature dflash_block; kind dflash_block, time_major only)
    One call drafts a block: C context rows (the target's hidden_states of the C positions
    committed since the last call) and then B block rows (the last committed token, B - 1 mask
    tokens), at positions P .. P+C+B-1:
    input_ids      int64     [1, B]              the block's tokens
    context        float32   [1, C, F]           C >= 0 target hidden_states rows, F = layers x hidden
    logits_index   int64     [R]                 block rows whose logits are returned
    past_key_{i}   kv_dtype  [1, P, H_kv, D]     the drafter's own cache (context rows only)
 -> logits         float32   [1, R, V]           through the target's output head
    new_key_{i}    kv_dtype  [1, C+B, H_kv, D]   K (rotary applied) and V of the context, then block rows
    Block rows attend to every key (past, context, the whole block); context rows have no query.
    The runtime keeps the C context rows (cursor P + C) and drops the block's rows by a cursor move.

EAGLE-3 head graphs (feature eagle3_head; kind eagle3_head): one layer whose cache follows either layout
(specexport/graphs/eagle.py writes both), with
the inputs features [1, S, F] and draft_hidden [1, S, H] after input_ids and the output
hidden_out [1, R, H] after logits (GraphSpec.input_names / output_names).

Gemma 4 assistant graphs (feature assistant; kind assistant; specexport/graphs/assistant.py)
    A draft without a cache of its own: each of its S rows is one draft step at position P (the
    target's cursor), reading the target's caches read-only. Its target entry returns the last
    hidden rows (feature_layers [L]: transformers' output_hidden_states[L], after the final norm).
    input_ids              int64     [1, S]          the token each row embeds (the target's table)
    last_hidden            float32   [1, S, Hb]      the target's last hidden row, or the
                                                     assistant's own earlier hidden_out row
    total_sequence_length  int32     []              head_major_inplace only: P
    shared_key_{n}         kv_dtype  [1, P, H_kv, D] time_major: target cache n's valid prefix
                                     [1, H_kv, T, D] head_major_inplace: target cache n's buffer
    shared_value_{n}       kv_dtype  as shared_key_{n}
    -> logits              float32   [1, S, V]
    -> hidden_out          float32   [1, S, Hb]
    The entry's `shared_kv` lists the target caches n it reads (GraphSpec.shared_kv).

MTP head graphs (feature mtp_head; kind mtp; specexport/graphs/mtp.py)
    A checkpoint's own multi-token-prediction layer (Qwen3.5's mtp.*) with the EAGLE-3 head's
    names (is_head): input_ids, features [1, S, H] (the target's hidden_states rows: feature_layers
    [L], after the final norm), draft_hidden [1, S, H] (its own earlier hidden_out rows; the caller
    zeroes the side it does not use), logits_index, one layer's cache in either layout; -> logits
    [1, R, V] over the target's vocabulary and hidden_out [1, R, H], the rows after its final norm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .features import HEAD_MAJOR_INPLACE, TIME_MAJOR, features_for, needs_version, parse_version

CONTRACT_VERSION = "1.12"
"""major.minor: a runtime reads graphs of its own major version up to its own minor."""

# TIME_MAJOR, HEAD_MAJOR_INPLACE: the kv_layout strings of manifests and graph metadata (features.py)
ROW_PADDING_VERSION = "1.2"  # manifest entries with min_rows / exactness
PORTABLE_HEAD_VERSION = "1.3"  # an eagle3_head graph in the time_major layout (the portable form)
WINDOW_VERSION = "1.4"  # a head_major_inplace graph with GroupQueryAttention local windows
SLOTS_VERSION = "1.5"  # a head_major_inplace graph with several cache slots (batched sequences)
IDLE_SLOTS_VERSION = "1.6"  # a slots graph whose idle slots take no rows in input_ids
TREE_VERSION = "1.7"  # a target's tree-verify graph (position_ids, tree_bias)
HEAD_TREE_VERSION = "1.8"  # an EAGLE-3 head's tree graph (tree_bias [S, M] over the round's rows)
PORTABLE_TREE_VERSION = "1.9"  # a target's tree-verify graph in the time_major layout
PORTABLE_SLOTS_VERSION = "1.10"  # a time_major decoder with several cache slots
RECURRENT_VERSION = "1.11"  # a decoder with recurrent state tensors beside its K/V caches
RECURRENT_SLOTS_VERSION = "1.12"  # a slots graph whose slots carry recurrent state, one set of names per slot
DFLASH_VERSION = "1.12"  # a DFlash block drafter (kind dflash_block, time_major)
ASSISTANT_VERSION = "1.12"  # a Gemma 4 assistant graph reading the target's caches and last hidden rows
MTP_VERSION = "1.12"  # a checkpoint's own MTP layer (kind mtp) reading the target's last hidden rows
WINDOW_MIN_ORT = (1, 24, 1)  # the first ONNX Runtime whose local_window_size counts the query itself

INPUT_IDS = "input_ids"
LOGITS_INDEX = "logits_index"
LOGITS = "logits"
SEQLENS_K = "seqlens_k"
TOTAL_SEQUENCE_LENGTH = "total_sequence_length"
SLOT_ROWS = "slot_rows"  # feature cache_slots: int64 [K] rows of each slot in a batched call
POSITION_IDS = "position_ids"  # feature tree_verify: int64 [1, S] P + depth of each tree row
TREE_BIAS = "tree_bias"  # feature tree_verify: float32 [S, S] 0 on a row's ancestors and itself, lowest elsewhere
HIDDEN_STATES = "hidden_states"  # feature eagle3_head: target features for a draft head
STATE_INDEX = "state_index"  # feature recurrent_state: int64 [Rs] rows whose state new_state_{j} returns
DECODER, EAGLE3_HEAD, DFLASH_BLOCK, ASSISTANT = "decoder", "eagle3_head", "dflash_block", "assistant"  # graph kinds
MTP = "mtp"  # graph kind: a checkpoint's own MTP layer (feature mtp_head), named as an EAGLE-3 head
GRAPH_KINDS = (DECODER, EAGLE3_HEAD, DFLASH_BLOCK, ASSISTANT, MTP)
# the EAGLE-3 head graph (feature eagle3_head; specexport/graphs/eagle.py): extra inputs and output
HEAD_FEATURES = "features"  # [1, S, F] the target's hidden_states rows
HEAD_HIDDEN = "draft_hidden"  # [1, S, H] the head's own earlier hidden_out rows
HEAD_HIDDEN_OUT = "hidden_out"  # [1, R, H]
DFLASH_CONTEXT = "context"  # feature dflash_block: [1, C, F] the target's hidden_states rows of C new positions
ASSISTANT_HIDDEN = "last_hidden"  # feature assistant: [1, S, Hb] the target's last hidden row or hidden_out

KV_DTYPES = ("float32", "float16")


def _slot(name: str, slot: int | None) -> str:
    """A cache name of a slots graph (feature cache_slots) carries its slot: past_key_3_slot1."""
    return name if slot is None else f"{name}_slot{slot}"


def past_key(layer: int, slot: int | None = None) -> str:
    return _slot(f"past_key_{layer}", slot)


def past_value(layer: int, slot: int | None = None) -> str:
    return _slot(f"past_value_{layer}", slot)


def new_key(layer: int, slot: int | None = None) -> str:
    return _slot(f"new_key_{layer}", slot)


def new_value(layer: int, slot: int | None = None) -> str:
    return _slot(f"new_value_{layer}", slot)


def past_state(site: int, slot: int | None = None) -> str:
    """Recurrent state site j's input (feature recurrent_state): [1, *s_j], the state before the call."""
    return _slot(f"past_state_{site}", slot)


def new_state(site: int, slot: int | None = None) -> str:
    """Recurrent state site j's output: [1, Rs, *s_j], the state after each state_index row."""
    return _slot(f"new_state_{site}", slot)


def state_index(slot: int | None = None) -> str:
    """The rows whose state new_state_{j} returns: [Rs] (a slots graph: one per slot, feature recurrent_slots)."""
    return _slot(STATE_INDEX, slot)


def shared_key(cache: int) -> str:
    """feature assistant: the target's cache `cache` as an assistant graph reads it."""
    return f"shared_key_{cache}"


def shared_value(cache: int) -> str:
    return f"shared_value_{cache}"


def present_key(layer: int, slot: int | None = None) -> str:
    return _slot(f"present_key_{layer}", slot)


def present_value(layer: int, slot: int | None = None) -> str:
    return _slot(f"present_value_{layer}", slot)


@dataclass(frozen=True)
class KvLayout:
    """One KV cache layout of the contract: how a graph's K/V buffers are shaped, bound and
    advanced. A graph's layout is chosen once (GraphSpec.layout, from the manifest's `kv_layout`
    string; on the build side from the recipe's `graph:` form) and asked for these facts."""

    name: str  # the kv_layout string of manifests and graph metadata
    form: str  # the recipe's `graph:` value whose graphs use it
    version: str  # the contract version that defined it
    time_axis: int  # axis of the cache rows T in a K/V buffer: 1 for [1, T, H_kv, D], 2 for [1, H_kv, T, D]
    # True: past_* and present_* are one buffer [1, H_kv, T, D], bound once, and the graph writes
    # rows P .. P+S-1 itself. False: past_* is the prefix view [:, :P] and new_* the slot
    # [:, P:P+S] of the buffer, bound per call.
    in_place: bool
    cursor_inputs: tuple[str, ...]  # inputs that carry the cursor P; () when positions come from the past length
    # the cache is read and written by ONNX Runtime's GroupQueryAttention (a com.microsoft contrib
    # op): CPU, or CUDA with fp16 caches; TensorRT never builds it
    contrib_attention: bool
    head_version: str  # the contract version that defined an eagle3_head graph in this layout
    window_version: str | None  # the version attention windows need in this layout (None: windows live in the mask)
    tree_version: str  # the contract version that defined a target's tree-verify graph in this layout
    slots_version: str  # the contract version that defined a decoder of several cache slots (idle slots: 0 rows)

    @property
    def heads_axis(self) -> int:
        """Axis of the H_kv heads in a K/V buffer (the one time_axis is not; D is always axis 3)."""
        return 3 - self.time_axis

    def cache_shape(self, rows: int, num_kv_heads: int, head_dim: int) -> tuple[int, int, int, int]:
        """A K or V buffer of `rows` cache rows: [1, rows, H_kv, D] or [1, H_kv, rows, D]."""
        shape = [1, 0, 0, head_dim]
        shape[self.time_axis], shape[self.heads_axis] = rows, num_kv_heads
        return tuple(shape)  # type: ignore[return-value]

    def kv_outputs(self, layer: int, slot: int | None = None) -> tuple[str, str]:
        """Names of layer i's K and V outputs: present_* (the bound buffer) or new_* (the S new rows)."""
        if self.in_place:
            return present_key(layer, slot), present_value(layer, slot)
        return new_key(layer, slot), new_value(layer, slot)


LAYOUTS: dict[str, KvLayout] = {
    TIME_MAJOR: KvLayout(
        TIME_MAJOR,
        form="portable",
        version="1.0",
        time_axis=1,
        in_place=False,
        cursor_inputs=(),
        contrib_attention=False,
        head_version=PORTABLE_HEAD_VERSION,
        window_version=None,
        tree_version=PORTABLE_TREE_VERSION,
        slots_version=PORTABLE_SLOTS_VERSION,
    ),
    HEAD_MAJOR_INPLACE: KvLayout(
        HEAD_MAJOR_INPLACE,
        form="fused",
        version="1.1",
        time_axis=2,
        in_place=True,
        cursor_inputs=(SEQLENS_K, TOTAL_SEQUENCE_LENGTH),
        contrib_attention=True,
        head_version=ROW_PADDING_VERSION,
        window_version=WINDOW_VERSION,
        tree_version=TREE_VERSION,
        slots_version=IDLE_SLOTS_VERSION,
    ),
}
KV_LAYOUTS = tuple(LAYOUTS)
GRAPH_FORMS = tuple(layout.form for layout in LAYOUTS.values())  # a recipe's `graph:` values


def layout_of(kv_layout: str) -> KvLayout:
    """The layout a manifest entry's or graph's `kv_layout` string names (ValueError if none)."""
    try:
        return LAYOUTS[kv_layout]
    except (KeyError, TypeError):
        raise ValueError(f"kv_layout {kv_layout!r} is not one of {KV_LAYOUTS}") from None


def layout_for_form(form: str) -> KvLayout:
    """The layout of a recipe's graph form (`graph: portable | fused`)."""
    for layout in LAYOUTS.values():
        if layout.form == form:
            return layout
    raise ValueError(f"graph form {form!r} is not one of {GRAPH_FORMS}")


def version_for(
    kv_layout: str,
    min_rows: int = 1,
    head: bool = False,
    windowed: bool = False,
    slots: int = 1,
    idle_rows: int = 0,
    tree: bool = False,
    states: bool = False,
    dflash: bool = False,
    assistant: bool = False,
    mtp: bool = False,
) -> str:
    """The lowest contract version that defines `kv_layout` and, with min_rows > 1, row-padded
    calls (what an artifact declares); head: an eagle3_head graph (1.2, or 1.3 time_major);
    windowed: GroupQueryAttention windows in a head_major_inplace graph (1.4); slots > 1: a
    batched graph (1.5; 1.6 when its idle slots take idle_rows 0 rows, as graphs built now do;
    time_major 1.10);
    tree: a tree-verify graph (1.7; an eagle3_head's tree graph 1.8; time_major 1.9); states:
    recurrent state tensors (1.11); dflash: a DFlash block drafter (1.12, time_major); assistant: a Gemma 4
    assistant graph (1.12); mtp: an MTP head graph (1.12)."""
    layout_of(kv_layout)  # ValueError for an unknown layout
    facts = features_for(kv_layout, min_rows, head, windowed, slots, idle_rows, tree, states, dflash, assistant, mtp)
    return needs_version(facts, kv_layout)


def window_runtime_error(spec: GraphSpec, ort_version: str) -> str | None:
    """Why this ONNX Runtime must not run `spec` (its GroupQueryAttention windows would see one
    key more than transformers), or None."""
    if not (spec.layout.contrib_attention and spec.windows):
        return None
    have = tuple(int(p) for p in ort_version.split("+")[0].split(".")[:3] if p.isdigit())
    if have >= WINDOW_MIN_ORT:
        return None
    need = ".".join(map(str, WINDOW_MIN_ORT))
    return (
        f"this graph uses GroupQueryAttention windows {list(spec.windows)}, which onnxruntime {ort_version} counts"
        f" one key wider than transformers; install onnxruntime >= {need} (or rebuild with `graph: portable`)"
    )


META_CONTRACT_VERSION = "specexport.contract_version"  # ONNX metadata_props keys of every graph
META_KV_LAYOUT = "specexport.kv_layout"


def graph_metadata(kv_layout: str, version: str | None = None) -> dict[str, str]:
    """The metadata_props an exported graph carries (both exporters write these); version: the
    contract the graph needs (default: its layout's)."""
    return {META_CONTRACT_VERSION: version or version_for(kv_layout), META_KV_LAYOUT: kv_layout}


@dataclass(frozen=True)
class GraphSpec:
    """Shape facts a runtime needs to allocate and bind the caches of one graph."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    embedding_rows: int
    kv_dtype: str = "float32"
    kv_layout: str = TIME_MAJOR
    # feature eagle3_head: a decoder's hidden_states output width F (0: no such output); for an EAGLE-3
    # head graph (kind eagle3_head) the width of its `features` input, and hidden_width its H
    feature_width: int = 0
    kind: str = DECODER
    hidden_width: int = 0
    # feature attention_windows: distinct GroupQueryAttention local windows (contrib_attention only)
    windows: tuple[int, ...] = ()
    slots: int = 1  # feature cache_slots: cache slots, one sequence each, batched in one call (decoders)
    tree: bool = False  # feature tree_verify: a tree-verify graph (position_ids, tree_bias inputs)
    # feature recurrent_state: the shape s_j of each recurrent state tensor (past_state_{j}: [1, *s_j])
    states: tuple[tuple[int, ...], ...] = ()
    # feature assistant (kind assistant): the target caches n it reads (shared_key_{n}); hidden_width its Hb
    shared_kv: tuple[int, ...] = ()
    layout: KvLayout = field(init=False, repr=False, compare=False)  # layout_of(kv_layout), chosen here once

    def __post_init__(self) -> None:
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype {self.kv_dtype!r} is not one of {KV_DTYPES}")
        object.__setattr__(self, "layout", layout_of(self.kv_layout))
        for name in ("num_layers", "num_kv_heads", "head_dim", "embedding_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.feature_width < 0 or self.hidden_width < 0:
            raise ValueError(
                f"feature_width / hidden_width must be >= 0, got {self.feature_width} / {self.hidden_width}"
            )
        if self.kind not in GRAPH_KINDS:
            raise ValueError(f"kind {self.kind!r} is not one of {GRAPH_KINDS}")
        if self.kind == EAGLE3_HEAD and not (self.feature_width and self.hidden_width):
            raise ValueError("an eagle3_head graph has feature_width and hidden_width > 0")
        if self.kind == MTP and not (self.feature_width and self.feature_width == self.hidden_width):
            raise ValueError("an mtp graph has feature_width == hidden_width > 0 (the target's hidden rows)")
        if self.kind == DFLASH_BLOCK and not (self.feature_width and self.kv_layout == TIME_MAJOR and self.slots == 1):
            raise ValueError("a dflash_block graph is time_major, of one slot, with feature_width > 0")
        if (self.kind == ASSISTANT) != bool(self.shared_kv) or (self.kind == ASSISTANT and not self.hidden_width):
            raise ValueError(
                f"an assistant graph (and only one) reads target caches with hidden_width > 0; got kind {self.kind},"
                f" shared_kv {list(self.shared_kv)}, hidden_width {self.hidden_width}"
            )
        if any(w < 1 for w in self.windows):
            raise ValueError(f"windows must be >= 1, got {list(self.windows)}")
        if self.slots < 1:
            raise ValueError(f"slots must be >= 1, got {self.slots}")
        if self.slots > 1 and (self.is_head or self.feature_width):
            raise ValueError(
                f"a graph of {self.slots} slots is a decoder without features;"
                f" got kind {self.kind}, feature_width {self.feature_width}"
            )

        if any(not shape or any(int(d) < 1 for d in shape) for shape in self.states):
            raise ValueError(f"state shapes must be non-empty with dims >= 1, got {list(self.states)}")
        if self.states and (self.is_head or self.tree):
            raise ValueError(
                f"recurrent state is a chain decoder's (contract {RECURRENT_SLOTS_VERSION}); got kind {self.kind},"
                f" tree {self.tree}"
            )
        if self.tree and (self.slots > 1 or (self.is_head and not self.layout.in_place)):
            raise ValueError(
                f"a tree graph is a graph of one slot (an EAGLE-3 head's: head_major_inplace); got kind"
                f" {self.kind}, layout {self.kv_layout}, slots {self.slots}"
            )

    @property
    def slot_ids(self) -> tuple[int | None, ...]:
        """The slot suffix of each cache name: (None,) for a 1-slot graph, else 0 .. slots - 1."""
        return (None,) if self.slots == 1 else tuple(range(self.slots))

    @property
    def is_head(self) -> bool:
        """A one-layer draft with its own cache and the EAGLE-3 head's names (eagle3_head, mtp)."""
        return self.kind in (EAGLE3_HEAD, MTP)

    @property
    def has_features(self) -> bool:
        """A decoder with the hidden_states output [1, S, F] (a head's feature_width is its input's)."""
        return bool(self.feature_width) and self.kind == DECODER

    def input_names(self) -> list[str]:
        if self.kind == ASSISTANT:
            names = [INPUT_IDS, ASSISTANT_HIDDEN] + ([TOTAL_SEQUENCE_LENGTH] if self.layout.in_place else [])
            return names + [name for n in self.shared_kv for name in (shared_key(n), shared_value(n))]
        names = [INPUT_IDS] + ([HEAD_FEATURES, HEAD_HIDDEN] if self.is_head else []) + [LOGITS_INDEX]
        names[1:1] = [DFLASH_CONTEXT] if self.kind == DFLASH_BLOCK else []
        names += ([SLOT_ROWS] if self.slots > 1 else []) + list(self.layout.cursor_inputs)
        names += [POSITION_IDS, TREE_BIAS] if self.tree else []
        names += [state_index(b) for b in self.slot_ids] if self.states else []
        for i in range(self.num_layers):
            for b in self.slot_ids:
                names += [past_key(i, b), past_value(i, b)]
        return names + [past_state(j, b) for j in range(len(self.states)) for b in self.slot_ids]

    def output_names(self) -> list[str]:
        if self.kind == ASSISTANT:
            return [LOGITS, HEAD_HIDDEN_OUT]
        names = [LOGITS] + ([HEAD_HIDDEN_OUT] if self.is_head else [HIDDEN_STATES] if self.has_features else [])
        for i in range(self.num_layers):
            for b in self.slot_ids:
                names += self.layout.kv_outputs(i, b)
        return names + [new_state(j, b) for j in range(len(self.states)) for b in self.slot_ids]

    def cache_shape(self, max_context: int) -> tuple[int, int, int, int]:
        """Shape of one preallocated K or V buffer: [1, T_max, H_kv, D] (time_major) or
        [1, H_kv, T_max, D] (head_major_inplace)."""
        return self.layout.cache_shape(max_context, self.num_kv_heads, self.head_dim)

    def kv_bytes(self, max_context: int) -> int:
        """Bytes of all K and V buffers of this graph at max context (every slot)."""
        if self.kind == ASSISTANT:  # it reads the target's caches
            return 0
        itemsize = 4 if self.kv_dtype == "float32" else 2
        return 2 * self.num_layers * self.slots * max_context * self.num_kv_heads * self.head_dim * itemsize

    def state_bytes(self, positions: int = 1) -> int:
        """Bytes of the recurrent state (float32) of `positions` kept positions (feature recurrent_state)."""
        return positions * sum(math.prod(shape) for shape in self.states) * 4


def is_supported(version: str) -> bool:
    """A runtime reads graphs of its own major version up to its own minor (a newer minor may
    use a layout this runtime does not know)."""
    major, minor = parse_version(version)
    own_major, own_minor = parse_version(CONTRACT_VERSION)
    return major == own_major and minor <= own_minor
