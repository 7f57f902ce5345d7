"""The Gemma 4 assistant proposer (registry name `assistant`; docs/proposers.md): a draft graph of
kind assistant that reads the target's own K/V caches and its last hidden row (contract 1.12,
docs/graph-contract.md "Gemma 4 assistant").

With `committed` the accepted tokens, the target's cache holds positions 0 .. p - 1, p =
len(committed) - 1, and its last call returned the final-normed hidden row of position p - 1
(feature_layers [L]). A round drafts a chain, every step at position p:

    step 1:  (committed[-1], target hidden of p - 1)  -> logits, hidden_out  -> d1
    step i:  (d_(i-1), the previous step's hidden_out)                      -> d_i

The assistant keeps no cache, so nothing is rolled back after a round: the next round reads the
target's cache as the verify call left it (truncated to the accepted tokens by the loop).

Trees (tree_nodes > 0, a target built with tree_verify): since a call's rows never see each other,
the assistant's own graph is already a tree graph whose nodes attend to no round row at all (a
node's ancestry reaches it only through draft_hidden, its parent's hidden_out). A round grows an
EAGLE-2 tree with eagle_tree.grow: step 1 as above, then per depth one call of the frontier's S
rows, each (node token, its parent's hidden_out), every row at position p.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from . import contract
from .contract import GraphSpec
from .eagle_tree import TreeRounds
from .engine import NP_DTYPES, SessionConfig, make_session
from .errors import InvalidArgument
from .model import CacheCursor, CallStats
from .proposers import Proposal, Proposer, ProposerContext
from .sampling import probabilities, softmax
from .seeded import draw


class AssistantModel(CacheCursor):
    """An assistant graph on ONNX Runtime bound read-only to its target's cache buffers (a
    model.Model without a cache of its own: length stays 0). forward(ids, hidden=[S, Hb]) runs S
    independent draft steps at the target's cursor and leaves hidden_out [S, Hb]."""

    def __init__(self, path: Path, spec: GraphSpec, target, config: SessionConfig, max_rows: int = 16):
        if spec.kind != contract.ASSISTANT:
            raise InvalidArgument(f"an assistant graph has kind {contract.ASSISTANT!r}, not {spec.kind!r}")
        t = target.spec
        if (t.kv_layout, t.num_kv_heads, t.head_dim, t.kv_dtype) != (
            spec.kv_layout,
            spec.num_kv_heads,
            spec.head_dim,
            spec.kv_dtype,
        ):
            raise InvalidArgument(
                f"the assistant reads {spec.kv_layout} caches of {spec.num_kv_heads} x {spec.head_dim} {spec.kv_dtype};"
                f" the target's are {t.kv_layout} {t.num_kv_heads} x {t.head_dim} {t.kv_dtype}"
            )
        if t.feature_width != spec.hidden_width or max(spec.shared_kv) >= t.num_layers:
            raise InvalidArgument(
                f"the assistant reads last hidden rows of {spec.hidden_width} and caches {list(spec.shared_kv)};"
                f" the target returns {t.feature_width} wide rows and has {t.num_layers} caches"
            )
        if getattr(target, "device", "cpu") != "cpu":
            raise InvalidArgument("the assistant binds the target's caches in host memory (provider cpu)")
        self.spec, self.target, self.config = spec, target, config
        self.max_context, self.max_rows, self.min_rows = target.max_context, max_rows, 1
        self.length = self.last_start = 0  # no cache of its own
        self.session = make_session(path, config)
        self._io = self.session.io_binding()
        self._logits = np.full((1, max_rows, spec.embedding_rows), 0, np.float32)
        self._hidden = np.full((1, max_rows, spec.hidden_width), 0, np.float32)
        self._total = np.zeros((), np.int32)  # head_major_inplace: P
        self.features = None
        self.hidden_out: np.ndarray | None = None
        self.stats = CallStats()

    def forward(self, ids, last_rows: int = 1, features=None, hidden: np.ndarray | None = None) -> np.ndarray:
        """S draft steps at the target's cursor P: ids [S] tokens, hidden [S, Hb] float32 -> logits
        [S, V] (a view the next call overwrites); hidden_out [S, Hb]."""
        ids = np.asarray(ids, dtype=np.int64).reshape(1, -1)  # [1, S]
        S, Hb = ids.shape[1], self.spec.hidden_width
        if not 1 <= S <= self.max_rows or hidden is None or np.size(hidden) != S * Hb:
            raise InvalidArgument(
                f"an assistant call takes 1..{self.max_rows} tokens with one hidden row of {Hb} each;"
                f" got {S} tokens and hidden of shape {list(np.shape(hidden))}"
            )
        P = self.target.length
        if P < 1:
            raise InvalidArgument("the assistant drafts after the target's prompt (its cache is empty)")
        start = time.perf_counter()
        io, t = self._io, self.target
        io.bind_cpu_input(contract.INPUT_IDS, ids)
        io.bind_cpu_input(contract.ASSISTANT_HIDDEN, np.ascontiguousarray(hidden, np.float32).reshape(1, S, Hb))
        dt, buffers = NP_DTYPES[self.spec.kv_dtype], t.cache_buffers
        if self.spec.layout.in_place:  # the whole [1, H_kv, T, D] buffer and the cursor
            self._total[...] = P
            io.bind_cpu_input(contract.TOTAL_SEQUENCE_LENGTH, self._total)
            shape = list(buffers[0].shape)
        else:  # the valid prefix [1, P, H_kv, D] of the time-major buffer, no copy
            shape = [1, P, self.spec.num_kv_heads, self.spec.head_dim]
        for n in self.spec.shared_kv:
            for name, buf in ((contract.shared_key(n), buffers[2 * n]), (contract.shared_value(n), buffers[2 * n + 1])):
                io.bind_input(name, "cpu", 0, dt, shape, buf.ctypes.data)
        V = self.spec.embedding_rows
        io.bind_output(contract.LOGITS, "cpu", 0, np.float32, [1, S, V], self._logits.ctypes.data)
        io.bind_output(contract.HEAD_HIDDEN_OUT, "cpu", 0, np.float32, [1, S, Hb], self._hidden.ctypes.data)
        self.session.run_with_iobinding(io)
        self.stats.add(S, time.perf_counter() - start)
        self.hidden_out = self._hidden[0, :S]
        return self._logits[0, :S]

    def kv_nbytes(self) -> int:
        return 0  # it reads the target's caches


class AssistantTree:
    """The assistant's graph in the role of a head tree graph for eagle_tree.grow: one call per
    depth on the frontier's rows. Its rows attend to the target's caches only, never to each
    other, so grow's positions and bias (a node's ancestors among the round's rows) have nothing
    to act on: every row sits at the target's cursor P, and a node's path enters through its
    draft_hidden (the parent's hidden_out) alone."""

    lowest = float(np.finfo(np.float32).min)  # grow writes its bias with it; the graph takes none

    def __init__(self, model: AssistantModel):
        self.head = model

    def forward(self, tokens, hidden, positions, bias) -> tuple[np.ndarray, np.ndarray]:
        """tokens [S], hidden [S, Hb] -> views (logits [S, V], hidden_out [S, Hb]) that the next
        call overwrites."""
        logits = self.head.forward(tokens, hidden=hidden)
        return logits, self.head.hidden_out


class AssistantProposer(Proposer):
    """Drafts chains, or with tree_nodes > 0 trees, with a Gemma 4 assistant (module docstring)."""

    name = "assistant"

    def __init__(self, model: AssistantModel, target, target_rows: int, tree_nodes: int = 0, cost=None):
        """tree_nodes > 0: rounds draft trees of up to that many tokens, priced by `cost` (the
        target's costs.VerifyCost) as EAGLE-3 trees are."""
        if model.spec.embedding_rows != target_rows:
            raise InvalidArgument(f"the assistant scores {model.spec.embedding_rows} tokens; the target {target_rows}")
        self.model, self.target = model, target
        self.hidden = np.zeros(model.spec.hidden_width, np.float32)  # the target's row of position `pos`
        self.pos = -1
        self.trees = TreeRounds(AssistantTree(model), tree_nodes, cost) if tree_nodes > 0 else None
        self.ids = np.arange(target_rows, dtype=np.int64)  # grow's draft -> target map: the same vocabulary

    def start(self, prompt: Sequence[int]) -> None:
        self.pos = -1

    def commit(self, committed, n_new) -> None:
        """Keep the target's last hidden row of position len(committed) - 2 from its last call."""
        pos = len(committed) - 2
        row = pos - self.target.last_start
        features = self.target.features
        if features is not None and 0 <= row < len(features):
            self.hidden[:] = features[row]
            self.pos = pos
        if self.trees is not None:
            self.trees.committed(n_new)

    def propose(self, committed, gamma, params, rng) -> Proposal:
        n = len(committed)
        if gamma < 1:
            return Proposal([], None)
        if self.pos != n - 2 or self.target.length != n - 1:
            raise InvalidArgument(
                f"the assistant drafts after position {n - 1} with the target's cache at {self.target.length}"
                f" and its hidden row of position {self.pos}; expected {n - 1} and {n - 2}"
            )
        token, hidden = committed[-1], self.hidden[None]
        if self.trees is not None:
            return self._tree(self.model.forward([token], hidden=hidden)[0], params, gamma)
        tokens, qs = [], []
        for i in range(gamma):
            logits = self.model.forward([token], hidden=hidden)  # [1, V]
            if params.greedy:
                token = int(logits[0].argmax())
            else:
                q = probabilities(logits, params)[0]  # [V]
                token = draw(q, rng, n + i)  # d_(i+1) sits at position n + i
                qs.append(q)
            tokens.append(token)
            hidden = self.model.hidden_out.copy()  # [1, Hb]
        return Proposal(tokens, np.stack(qs) if qs else None, source="assistant")

    def _tree(self, logits: np.ndarray, params, depth: int) -> Proposal:
        """A draft tree (eagle_tree.grow) after step 1's logits [V]: deterministic top-k siblings
        (q None), as a chain when it has no branch."""
        if params.greedy:
            probs = lambda x: softmax(x)  # noqa: E731 (looked up per call: tests wrap assistant.softmax)
        else:
            probs = lambda x: probabilities(x, params)  # noqa: E731
        hidden = self.model.hidden_out[0].copy()  # [Hb] step 1's
        return self.trees.draft(logits, hidden, 0, probs, self.ids, depth, self.name)


def build_assistant(ctx: ProposerContext) -> AssistantProposer:
    if ctx.batched:
        raise InvalidArgument("the assistant proposer drafts for batch-1 generation only")
    # checked against the target's tree graph when the call was configured; None (not decided by a
    # generation: a proposer built on its own) drafts chains
    nodes = ctx.config.tree_nodes or 0
    return AssistantProposer(ctx.draft, ctx.target, ctx.manifest.target.embedding_rows, nodes, ctx.verify_cost())
