"""What proposers use beyond their models (ProposerServices), one per generator: the target's
verify cost, the artifact's corpus datastore and EAGLE-3 vocabulary map (read on first use),
the head's tree graph, and what proposers learn across requests. A proposer reaches them only
through its proposers.ProposerContext, never through the generator.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from . import registry
from .costs import VerifyCost
from .datastore import Datastore
from .errors import ArtifactError, InvalidArgument

if TYPE_CHECKING:
    from .config import GeneratorConfig
    from .eagle_tree import HeadTree
    from .manifest import Manifest


class ProposerServices:
    def __init__(
        self,
        root: Path,
        manifest: Manifest,
        config: GeneratorConfig,
        verify_cost: VerifyCost,
        draft_rows: int | None = None,
        head_tree: HeadTree | None = None,
    ):
        """config: the generator's default (sizes what proposers learn, e.g. the suffix store);
        draft_rows: the draft graph's embedding rows (an EAGLE-3 head's vocabulary map has one
        entry per row); head_tree: an EAGLE-3 head's tree graph (feature eagle3_head_tree), or None."""
        self.root, self.manifest, self.config = root, manifest, config
        self.verify_cost, self.draft_rows, self.head_tree = verify_cost, draft_rows, head_tree
        self._learned: dict[str, Any] = {}  # proposer name -> its state across requests (registry `learns`)
        self._d2t: np.ndarray | None = None
        self._datastore: Datastore | None = None

    def learned(self, name: str) -> Any:
        """What proposer `name` learns across the generator's calls, created on first use."""
        if name not in self._learned:
            spec = registry.get(name)
            if spec.learns is None:
                raise InvalidArgument(f"proposer {name!r} keeps nothing across requests")
            self._learned[name] = registry.resolve(spec.learns)(self.config)
        return self._learned[name]

    def forget(self) -> None:
        """Forget what proposers learned from earlier answers (what they measured is kept)."""
        for state in self._learned.values():
            state.forget()

    def datastore(self) -> Datastore | None:
        """The artifact's corpus datastore (manifest retrieval), memory-mapped on first use; None
        without one."""
        entry = self.manifest.retrieval
        if entry is not None and self._datastore is None:
            self._datastore = Datastore.open(self.root / entry.tokens, self.root / entry.suffix_array)
        return self._datastore

    def vocab_map(self) -> np.ndarray:
        """The head's draft row -> target id map (manifest draft.vocab_map), int64 [V_draft], read once."""
        if self._d2t is None:
            path = self.root / self.manifest.draft.vocab_map
            try:
                d2t = np.load(path, allow_pickle=False)
            except (OSError, ValueError) as exc:
                raise ArtifactError(
                    f"{self.manifest.draft.vocab_map!r} is not a readable .npy vocabulary map: {exc}"
                ) from exc
            rows = self.manifest.target.embedding_rows
            if d2t.dtype != np.int64 or d2t.shape != (self.draft_rows,) or d2t.min() < 0 or d2t.max() >= rows:
                raise ArtifactError(
                    f"{self.manifest.draft.vocab_map!r} must hold {self.draft_rows} int64"
                    f" target ids in [0, {rows}), got {d2t.dtype} {list(d2t.shape)}"
                )
            self._d2t = d2t
        return self._d2t
