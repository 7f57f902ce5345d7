"""The DFlash proposer: a block drafter that drafts block_size - 1 tokens in one call from the
target's hidden states (feature dflash_block; docs/graph-contract.md, DFlash block drafters).

The drafter's cache holds one row per committed position that the target has computed hidden
states for (its `context` rows). With `committed` the accepted tokens (the target's cache holds
committed[:-1], so its features exist for positions 0 .. n - 2, n = len(committed)):

    call   context rows  features[drafter.length : n - 1]      the positions committed since the last call
           block rows    [committed[-1], mask x (B - 1)]      at positions n - 1 .. n + B - 2
    ->     logits of block rows 1 .. B - 1: the drafts for positions n .. n + B - 2

and the cursor stands after the context rows (n - 1): the block's K/V rows, written past it, are
never read again (rollback is a cursor move, like any cache). The drafts of a block do not see
each other's tokens, so each draft's q is its own row's distribution; speculative sampling with
those rows keeps the target's distribution exactly.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from . import contract
from .contract import GraphSpec
from .engine import SessionConfig, check_contract, make_session
from .errors import InvalidArgument
from .model import CacheCursor, CallStats, Model
from .proposers import Proposal, Proposer, ProposerContext
from .sampling import probabilities
from .seeded import draw


class DFlashModel(CacheCursor):
    """A dflash_block graph on ONNX Runtime with its time-major cache, allocated once.

    forward(block, last_rows, features=context) feeds C context rows [C, F] and the B block tokens
    at the cursor P, returns the logits [last_rows, V] of the block's last rows (a view the next
    call overwrites) and leaves the cursor at P + C."""

    def __init__(self, path: Path, spec: GraphSpec, max_context: int, config: SessionConfig, block_size: int):
        if spec.kind != contract.DFLASH_BLOCK:
            raise InvalidArgument(f"a DFlash drafter graph has kind {contract.DFLASH_BLOCK!r}, got {spec.kind!r}")
        if block_size < 2:
            raise InvalidArgument(f"block_size must be >= 2, got {block_size}")
        if config.provider != "cpu":
            raise InvalidArgument(f"the DFlash drafter runs on the CPU provider; got {config.provider!r}")
        self.spec, self.config, self.block_size = spec, config, block_size
        self.max_context, self.max_rows, self.min_rows = max_context, block_size, 1
        self.session = make_session(path, config)
        check_contract(self.session, spec, str(path))
        # [1, T, H_kv, D] per layer and K/V: context rows, then room for one block past max_context
        self.cache_rows = max_context + block_size
        shape = spec.cache_shape(self.cache_rows)
        self._buffers = [np.full(shape, 0, np.float32) for _ in range(2 * spec.num_layers)]
        self._logits = np.full((1, block_size, spec.embedding_rows), 0, np.float32)
        self._rows = np.arange(block_size, dtype=np.int64)
        self._no_context = np.zeros((1, 0, spec.feature_width), np.float32)
        self._io = self.session.io_binding()
        self.length = self.last_start = 0
        self.features = self.hidden_out = None
        self.stats = CallStats()

    def forward(self, ids, last_rows: int = 1, features: np.ndarray | None = None, hidden=None) -> np.ndarray:
        block = np.asarray(ids, np.int64).reshape(1, -1)  # [1, B]
        B, P = block.shape[1], self.length
        if B != self.block_size or not 1 <= last_rows < B:
            raise InvalidArgument(f"a DFlash call feeds {self.block_size} block tokens and asks for 1..{B - 1} rows")
        F = self.spec.feature_width
        context = self._no_context if features is None else np.ascontiguousarray(features, np.float32).reshape(1, -1, F)
        C = context.shape[1]
        if P + C + B > self.cache_rows or P + C > self.max_context:
            raise InvalidArgument(f"{P} cached + {C} context rows exceed max_context {self.max_context}")
        io, H, D = self._io, self.spec.num_kv_heads, self.spec.head_dim
        io.bind_cpu_input(contract.INPUT_IDS, block)
        io.bind_cpu_input(contract.DFLASH_CONTEXT, context)
        io.bind_cpu_input(contract.LOGITS_INDEX, self._rows[B - last_rows :])
        row_bytes = H * D * 4
        for i in range(self.spec.num_layers):
            for name_in, name_out, buf in (
                (contract.past_key(i), contract.new_key(i), self._buffers[2 * i]),
                (contract.past_value(i), contract.new_value(i), self._buffers[2 * i + 1]),
            ):
                ptr = buf.ctypes.data
                io.bind_input(name_in, "cpu", 0, np.float32, [1, P, H, D], ptr)
                io.bind_output(name_out, "cpu", 0, np.float32, [1, C + B, H, D], ptr + P * row_bytes)
        io.bind_output(
            contract.LOGITS, "cpu", 0, np.float32, [1, last_rows, self.spec.embedding_rows], self._logits.ctypes.data
        )
        start = time.perf_counter()
        self.session.run_with_iobinding(io)
        self.stats.add(C + B, time.perf_counter() - start)
        self.length, self.last_start = P + C, P  # the block's rows lie past the cursor: dropped
        return self._logits[0, :last_rows]

    def kv_nbytes(self) -> int:
        return self.spec.kv_bytes(self.cache_rows)


class DFlashProposer(Proposer):
    name = "dflash"

    def __init__(self, drafter: Model, target: Model, mask_token_id: int):
        if not target.spec.feature_width or target.spec.feature_width != drafter.spec.feature_width:
            raise InvalidArgument(
                f"the target's features ({target.spec.feature_width} wide) do not match the"
                f" DFlash drafter's context ({drafter.spec.feature_width})"
            )
        self.drafter, self.target, self.mask = drafter, target, int(mask_token_id)
        self.block = drafter.max_rows  # B: the anchor and B - 1 drafts
        # features of every committed position the target has computed: [max_context, F]
        self.features = np.zeros((target.max_context, target.spec.feature_width), np.float32)
        self.known = 0  # positions 0 .. known - 1 have features

    def start(self, prompt: Sequence[int]) -> None:
        self.drafter.reset()
        self.known = 0

    def propose(self, committed, gamma, params, rng) -> Proposal:
        start = time.perf_counter()
        n, P = len(committed), self.drafter.length
        if self.known < n - 1:  # commit() keeps the features of every accepted position
            raise InvalidArgument(f"the dflash proposer has features for {self.known} positions, needs {n - 1}")
        k = min(gamma, self.block - 1)
        if k < 1 or n - 1 > self.drafter.max_context:
            return Proposal([], None)
        block = [int(committed[-1])] + [self.mask] * (self.block - 1)
        logits = self.drafter.forward(block, last_rows=self.block - 1, features=self.features[P : n - 1])[:k]
        if params.greedy:
            tokens, q = [int(t) for t in logits.argmax(-1)], None
        else:
            q = probabilities(logits, params)  # [k, V]: each draft's own row
            tokens = [draw(q[i], rng, n + i) for i in range(k)]
        catchup = time.perf_counter() - start if n - 1 - P > 2 else 0.0  # a backlog (the prompt) is timed apart
        return Proposal(tokens, q, catchup_seconds=catchup, source="dflash")

    def commit(self, committed, n_new) -> None:
        """Keep the features the target's last call computed for positions now committed; the
        drafter's cursor never passes them."""
        first, stop = self.target.last_start, len(committed) - 1  # the target caches positions < stop
        if self.target.features is not None and first <= self.known and stop > first:
            self.features[first:stop] = self.target.features[: stop - first]
            self.known = stop
        self.known = min(self.known, stop)
        self.drafter.truncate(min(self.drafter.length, self.known))


def build_dflash(ctx: ProposerContext) -> DFlashProposer:
    if ctx.batched:
        raise InvalidArgument("the dflash proposer drafts for one sequence (no batch graph)")
    return DFlashProposer(ctx.draft, ctx.target, ctx.manifest.draft.mask_token_id)
