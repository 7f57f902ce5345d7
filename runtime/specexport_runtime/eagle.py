"""The EAGLE-3 proposer: a one-layer head that drafts from the target's own hidden states.

Alignment (EAGLE): the head's cache row t pairs the target's features of position t (its
hidden_states row, feature eagle3_head) with the token at position t + 1, and that row's logits
predict the token at t + 2. With `committed` the accepted tokens (the target's cache holds
committed[:-1], so features exist for positions 0 .. len - 2):

    catch-up   rows t = head.length .. len - 2: (features[t], committed[t + 1])  -> d1
    chain      row len - 1 + i: (the previous row's hidden_out, d_i)           -> d_(i+1)

After the round the chain rows are dropped: the verify call gave the accepted positions their
real features, so the head is truncated to the rows it computed from features and catches up.
With tree_nodes > 0 and the head's tree graph (feature eagle3_head_tree) the round drafts a tree instead
(eagle_tree.py); after a tree-verify call the target's features are those of the accepted
path (OrtModel.keep_path), so commit is the same.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from .eagle_tree import HeadTree, TreeRounds
from .errors import InvalidArgument
from .model import Model
from .proposers import Proposal, Proposer, ProposerContext
from .sampling import probabilities, softmax
from .seeded import SeededNoise, draw


class EagleProposer(Proposer):
    name = "eagle"

    def __init__(
        self,
        head: Model,
        target: Model,
        draft_to_target: np.ndarray,
        target_rows: int,
        tree: HeadTree | None = None,
        tree_nodes: int = 0,
        cost=None,
    ):
        """draft_to_target: int64 [V_draft], the target id of each draft-vocabulary row. tree:
        the head's tree graph on its cache; with tree_nodes > 0 rounds draft trees of up to that
        many tokens, priced by `cost` (the target's costs.VerifyCost)."""
        if not target.spec.feature_width or target.spec.feature_width != head.spec.feature_width:
            raise InvalidArgument(
                f"the target's features ({target.spec.feature_width} wide) do not match the"
                f" head's input ({head.spec.feature_width})"
            )
        self.head, self.target, self.target_rows = head, target, target_rows
        self.d2t = np.asarray(draft_to_target, np.int64)
        # features of every committed position the target has computed: [max_context, F]
        self.features = np.zeros((target.max_context, target.spec.feature_width), np.float32)
        self.known = 0  # positions 0 .. known - 1 have features
        self.real = 0  # head rows 0 .. real - 1 were computed from features
        self.trees = TreeRounds(tree, tree_nodes, cost) if tree is not None and tree_nodes > 0 else None

    def start(self, prompt: Sequence[int]) -> None:
        self.head.reset()
        self.known = self.real = 0

    def _to_target(self, q_draft: np.ndarray) -> np.ndarray:
        """[V_draft] probabilities -> [V_target]: target ids outside the draft vocabulary get 0."""
        q = np.zeros(self.target_rows, np.float32)
        q[self.d2t] = q_draft
        return q

    def _pick(self, logits: np.ndarray, params, rng, position: int) -> tuple[int, np.ndarray | None]:
        """(target id, its q row over target ids or None for greedy) from draft logits [V_draft]
        for sequence `position`; seeded noise is keyed by target ids, so it picks on the q row."""
        if params.greedy:
            return int(self.d2t[int(logits.argmax())]), None
        q = probabilities(logits[None], params)[0]  # [V_draft]
        q_target = self._to_target(q)  # [V_target]
        if isinstance(rng, SeededNoise):
            return draw(q_target, rng, position), q_target
        return int(self.d2t[draw(q, rng, position)]), q_target

    def propose(self, committed, gamma, params, rng) -> Proposal:
        start = time.perf_counter()
        n, t0 = len(committed), self.head.length
        if self.known < n - 1:  # commit() keeps the features of every accepted position
            raise InvalidArgument(f"the eagle proposer has features for {self.known} positions, needs {n - 1}")
        rows = n - 1 - t0  # catch-up rows: positions t0 .. n - 2, paired with committed[t0 + 1 .. n - 1]
        if rows < 1 or gamma < 1:
            return Proposal([], None)
        logits = self.head.forward(committed[t0 + 1 : n], last_rows=1, features=self.features[t0 : n - 1])
        self.real = n - 1  # head rows computed from features; the chain's rows come after
        if self.trees is not None:
            proposal = self._tree(logits[0], params, gamma)
            return replace(proposal, catchup_seconds=time.perf_counter() - start if rows > 2 else 0.0)
        tokens, qs = [], []
        for i in range(gamma):
            token, q = self._pick(logits[0], params, rng, n + i)
            tokens.append(token)
            if q is not None:
                qs.append(q)
            if i == gamma - 1 or self.head.free < 1:
                break
            logits = self.head.forward([token], hidden=self.head.hidden_out.copy())  # [1, V_draft]
        catchup = time.perf_counter() - start if rows > 2 else 0.0  # a backlog (the prompt) is timed apart
        return Proposal(tokens, np.stack(qs) if qs else None, catchup_seconds=catchup, source=self.name)

    def _tree(self, logits: np.ndarray, params, depth: int) -> Proposal:
        """A draft tree (eagle_tree.grow) after the catch-up row's logits [V_draft]: deterministic
        top-k siblings (q None), as a chain when it has no branch."""
        if params.greedy:
            probs = lambda x: softmax(x)  # noqa: E731 (looked up per call: tests wrap eagle.softmax)
        else:
            probs = lambda x: probabilities(x, params)  # noqa: E731
        hidden = self.head.hidden_out[0].copy()  # [H] the catch-up row's
        return self.trees.draft(logits, hidden, self.head.length, probs, self.d2t, depth, self.name)

    def commit(self, committed, n_new) -> None:
        """Keep the features the target's last call computed for positions now committed, and
        drop the head's chain rows (computed from its own hidden, not from features)."""
        first, stop = self.target.last_start, len(committed) - 1  # the target caches positions < stop
        if self.target.features is not None and first <= self.known and stop > first:
            self.features[first:stop] = self.target.features[: stop - first]
            self.known = stop
        self.head.truncate(min(self.head.length, self.real, self.known))
        if self.trees is not None:
            self.trees.committed(n_new)


def build_eagle(ctx: ProposerContext) -> EagleProposer:
    tree = ctx.head_tree
    nodes = 0 if ctx.batched or tree is None else ctx.config.tree_nodes or 0  # a batch verifies chains only
    d2t = ctx.vocab_map()
    return EagleProposer(ctx.draft, ctx.target, d2t, ctx.manifest.target.embedding_rows, tree, nodes, ctx.verify_cost())
