"""Registers the test-only `fixedtree` proposer (tests/extra_proposers/fixed_tree.py) with a
given tree for the duration of a with-block."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from specexport_runtime import registry
from specexport_runtime.registry import ProposerSpec


@contextlib.contextmanager
def fixed_tree(tokens: Sequence[int], parents: Sequence[int]) -> Iterator[None]:
    from extra_proposers import fixed_tree as module

    old, module.TREE = module.TREE, (tuple(tokens), tuple(parents))
    spec = ProposerSpec("fixedtree", "extra_proposers.fixed_tree:build", "a fixed draft tree (test only)")
    try:
        with registry.extended(spec):
            yield
    finally:
        module.TREE = old
