"""The target's tree-verify graph (feature tree_verify) on the cache of its batch-1 graph.

A TreeVerifier holds a second ONNX Runtime session, for the target entry's `tree_graph`, on the
same cache buffers as the target's OrtModel (one slot): head_major_inplace buffers bound once in
place, or time_major ones bound per call as the model binds a chain call (past = rows [:P],
new_* = rows [P:P+R]). A tree call feeds the R rows of a DraftTree at the model's cursor P: row
r's K/V land at cache row P + r, each row attends to the past and to its own ancestors, and the
logits of every row come back (and for a target with features, feature eagle3_head, their hidden_states rows in
model.features). The caller then keeps the accepted path with OrtModel.keep_path(P, rows), which
moves those rows to P + 1, P + 2, ... (and the features to the path's) and sets the cursor after
them; the rejected rows are left past the cursor and overwritten by the next call.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from . import contract
from .engine import OrtModel, SessionConfig, check_contract, make_session
from .errors import InvalidArgument
from .model import CallStats
from .tree import DraftTree


class TreeVerifier:
    """The tree graph of `model`'s artifact entry, sharing model's cache buffers and cursor."""

    def __init__(self, path: Path, model: OrtModel, config: SessionConfig):
        if model.spec.slots != 1 or model.device != "cpu":
            raise InvalidArgument(
                f"a tree graph shares the cache of a one-slot model on the CPU;"
                f" got layout {model.spec.kv_layout}, slots {model.spec.slots}, device {model.device}"
            )
        self.model, self.spec = model, replace(model.spec, tree=True)
        self.session = make_session(path, config)
        check_contract(self.session, self.spec, str(path))
        self._io = self.session.io_binding()
        if model.layout.in_place:
            model.bind_cache(self._io)  # the batch-1 graph's buffers, bound once
        self._seqlens = np.zeros(1, np.int32)  # [1] = P + R - 1
        self._total = np.zeros((), np.int32)  # [] = P + R
        self.stats = CallStats()  # tree calls by rows

    def forward(self, tree: DraftTree) -> np.ndarray:
        """Feed the tree's R >= 2 rows at the cursor P (row 0 the last committed token); return
        the logits of every row, a view [R, V] into the model's logits buffer (the next call
        overwrites it). The cursor then stands at P + R: keep_path(P, rows) keeps a path."""
        m, R = self.model, len(tree)
        P = m.length
        if not 2 <= R <= m.max_rows:
            raise InvalidArgument(f"a tree call has 2..{m.max_rows} rows (the model's max_rows), got {R}")
        if P + R > m.max_context:
            raise InvalidArgument(f"a tree of {R} rows at position {P} passes max_context {m.max_context}")
        io = self._io
        io.bind_cpu_input(contract.INPUT_IDS, tree.tokens.reshape(1, R))
        if m.layout.in_place:  # the cursor; the cache stays bound
            self._seqlens[0], self._total[()] = P + R - 1, P + R
            io.bind_cpu_input(contract.SEQLENS_K, self._seqlens)
            io.bind_cpu_input(contract.TOTAL_SEQUENCE_LENGTH, self._total)
        else:  # time_major: past [1, P, H_kv, D], the R rows' new_* [1, R, H_kv, D] at cache rows P..P+R-1
            m.bind_rows(io, P, R)
        io.bind_cpu_input(contract.POSITION_IDS, (P + tree.depths()).reshape(1, R))
        io.bind_cpu_input(contract.TREE_BIAS, tree.attention_bias(np.float32))
        m.bind_row_outputs(io, R)  # logits (and features, feature eagle3_head) of every row into the model's buffers
        start = time.perf_counter()
        self.session.run_with_iobinding(io)
        self.stats.add(R, time.perf_counter() - start)
        return m.called_rows(P, R)  # keep_path keeps the accepted path's features
