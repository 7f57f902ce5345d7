"""Graph features by name: what an artifact's graphs need of a runtime (docs/graph-contract.md).

    features_for(HEAD_MAJOR_INPLACE, slots=4)   # ('head_major_in_place', 'cache_slots', 'idle_slots')
    needs_version(features, layout)             # '1.6': the contract version that brought the last of them

A manifest lists the features its graphs need (`graph_features`); a runtime refuses, in one line,
an artifact that needs a feature it does not know, whatever the version says. The contract
version (contract.CONTRACT_VERSION) is the newest feature's; contract.version_for reads this
table. The bottom of the contract: it imports nothing of the runtime.
"""

from __future__ import annotations

TIME_MAJOR = "time_major"  # the portable layout's kv_layout string (manifests, graph metadata)
HEAD_MAJOR_INPLACE = "head_major_inplace"  # the fused layout's


def parse_version(version: str) -> tuple[int, int]:
    try:
        major, minor = version.split(".")
        return int(major), int(minor)
    except ValueError as exc:
        raise ValueError(f"contract version {version!r} is not of the form MAJOR.MINOR") from exc


# (feature, kv_layout) -> the contract version that defines it in that layout
VERSIONS: dict[tuple[str, str], str] = {
    ("time_major", TIME_MAJOR): "1.0",  # standard ops, a prefix view of the cache plus the new rows
    ("head_major_in_place", HEAD_MAJOR_INPLACE): "1.1",  # GroupQueryAttention writing K/V in place
    ("row_padding", TIME_MAJOR): "1.2",  # min_rows / cache_pad / exactness in the manifest
    ("row_padding", HEAD_MAJOR_INPLACE): "1.2",
    ("eagle3_head", HEAD_MAJOR_INPLACE): "1.2",  # a draft head reading the target's hidden states
    ("eagle3_head", TIME_MAJOR): "1.3",
    ("attention_windows", HEAD_MAJOR_INPLACE): "1.4",  # GroupQueryAttention local windows
    ("cache_slots", HEAD_MAJOR_INPLACE): "1.5",  # several sequences per call, a cache per slot
    ("idle_slots", HEAD_MAJOR_INPLACE): "1.6",  # an idle slot takes no rows
    ("tree_verify", HEAD_MAJOR_INPLACE): "1.7",  # position_ids and a tree mask over the call's rows
    ("eagle3_head_tree", HEAD_MAJOR_INPLACE): "1.8",  # a head's tree graph over the round's rows
    ("tree_verify", TIME_MAJOR): "1.9",
    ("cache_slots", TIME_MAJOR): "1.10",  # idle slots take no rows there from the start
    ("idle_slots", TIME_MAJOR): "1.10",
    ("recurrent_state", TIME_MAJOR): "1.11",  # per-layer recurrent state in, the state after chosen rows out
    ("recurrent_state", HEAD_MAJOR_INPLACE): "1.11",
    ("recurrent_slots", TIME_MAJOR): "1.12",  # cache slots whose sequences carry recurrent state
    ("recurrent_slots", HEAD_MAJOR_INPLACE): "1.12",
    ("dflash_block", TIME_MAJOR): "1.12",  # a DFlash drafter: a block of drafts from the target's hidden states
    ("assistant", TIME_MAJOR): "1.12",  # a draft reading the target's last hidden row and its K/V caches
    ("assistant", HEAD_MAJOR_INPLACE): "1.12",
    ("mtp_head", TIME_MAJOR): "1.12",  # a checkpoint's own MTP layer reading the target's last hidden rows
    ("mtp_head", HEAD_MAJOR_INPLACE): "1.12",
}
FEATURES: frozenset[str] = frozenset(name for name, _ in VERSIONS)
LAYOUT_FEATURE = {TIME_MAJOR: "time_major", HEAD_MAJOR_INPLACE: "head_major_in_place"}


def features_for(
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
) -> tuple[str, ...]:
    """The features a graph of `kv_layout` needs (arguments as contract.version_for): with
    min_rows > 1 or a head, row padding; an EAGLE-3 head; GroupQueryAttention windows (the
    portable form masks windows with standard ops: no feature); slots > 1, cache slots, and idle
    slots without rows unless idle_rows (a 1.5 graph's throwaway row); a tree-verify graph (a
    head's own tree graph); states: recurrent layers (conv windows, linear-attention or SSM
    states) beside the K/V caches, per slot in a slots graph; dflash: a DFlash drafter graph;
    assistant: a Gemma 4 assistant graph (it reads the target's caches, and the target returns its
    last hidden rows); mtp: a checkpoint's own MTP layer (the EAGLE-3 head's inputs and outputs,
    the target's final-normed hidden rows as its features)."""
    out = [LAYOUT_FEATURE[kv_layout]]
    if min_rows > 1 or head:
        out.append("row_padding")
    if head:
        out.append("eagle3_head")
    if windowed and kv_layout == HEAD_MAJOR_INPLACE:
        out.append("attention_windows")
    if slots > 1:
        out.append("cache_slots")
        if not (idle_rows and kv_layout == HEAD_MAJOR_INPLACE):
            out.append("idle_slots")
    if tree:
        out.append("eagle3_head_tree" if head or mtp else "tree_verify")  # an MTP head's is an EAGLE-3 head's
    if states:
        out.append("recurrent_state")
        if slots > 1:
            out.append("recurrent_slots")
    if dflash:  # a DFlash drafter graph (time_major only)
        out.append("dflash_block")
    if assistant:
        out.append("assistant")
    if mtp:
        out.append("mtp_head")
    return tuple(out)


def needs_version(features: tuple[str, ...], kv_layout: str) -> str:
    """The contract version that defines every one of `features` in `kv_layout`."""
    versions = [VERSIONS[(f, kv_layout)] for f in features]
    return max(versions, key=parse_version)


def unknown(features: object) -> list[str]:
    """Names in a manifest's graph_features this runtime does not implement (a non-list: all of it)."""
    if not isinstance(features, list) or not all(isinstance(f, str) for f in features):
        return [repr(features)]
    return [f for f in features if f not in FEATURES]
