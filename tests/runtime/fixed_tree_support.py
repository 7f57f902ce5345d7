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


@contextlib.contextmanager
def oracle_tree(reference: Sequence[int]) -> Iterator[None]:
    """The test-only `oracletree` proposer, drafting `reference` (target-only output) on the
    second branch of a tree each round."""
    from extra_proposers import fixed_tree as module

    old, module.REFERENCE = module.REFERENCE, tuple(reference)
    spec = ProposerSpec("oracletree", "extra_proposers.fixed_tree:build_oracle", "an oracle draft tree (test only)")
    try:
        with registry.extended(spec):
            yield
    finally:
        module.REFERENCE = old
