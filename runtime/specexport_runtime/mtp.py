"""The MTP proposer (registry name `mtp`; docs/proposers.md): a target checkpoint's own
multi-token-prediction layer (Qwen3.5's mtp.*; contract kind mtp, docs/graph-contract.md "MTP
heads") drafting chains, or trees with the head's tree graph.

The graph has the EAGLE-3 head's names and alignment, so the round is the EAGLE proposer's with
the target's own vocabulary (no vocab map): its cache row t pairs the target's final-normed hidden
row of position t with the token at t + 1 and predicts t + 2; catch-up rows read the target's
rows, each chained step the previous step's hidden_out (as vLLM runs one MTP layer for several
speculative tokens); after the verify call the chained rows are dropped by a cursor move and the
accepted positions are caught up from the target's real rows. With tree_nodes > 0 and the head's
tree graph (an artifact built with tree_verify, graph: fused) a round drafts a tree as the EAGLE
proposer does (eagle_tree.py): per depth one tree-graph call over the frontier, each row reading
its parent's hidden_out and attending to its own ancestors among the round's rows.
"""

from __future__ import annotations

import numpy as np

from .eagle import EagleProposer
from .errors import InvalidArgument
from .proposers import ProposerContext


class MtpProposer(EagleProposer):
    name = "mtp"


def build_mtp(ctx: ProposerContext) -> MtpProposer:
    rows = ctx.manifest.target.embedding_rows
    if ctx.draft.spec.embedding_rows != rows:
        raise InvalidArgument(f"the MTP head scores {ctx.draft.spec.embedding_rows} tokens; the target {rows}")
    tree = ctx.head_tree
    nodes = 0 if ctx.batched or tree is None else ctx.config.tree_nodes or 0  # a batch verifies chains only
    d2t = np.arange(rows, dtype=np.int64)  # the target's own vocabulary
    return MtpProposer(ctx.draft, ctx.target, d2t, rows, tree, nodes, ctx.verify_cost())
