"""Registers the test-only `fixedtree` proposer (tests/extra_proposers/fixed_tree.py) with a
given tree for the duration of a with-block."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from specexport_runtime import registry
from specexport_runtime.registry import ProposerSpec


@contextlib.contextmanager
def _registered(name: str, value, spec: ProposerSpec) -> Iterator[None]:
    """extra_proposers.fixed_tree.<name> = value and `spec` registered, for the with-block."""
    from extra_proposers import fixed_tree as module

    old = getattr(module, name)
    setattr(module, name, value)
    try:
        with registry.extended(spec):
            yield
    finally:
        setattr(module, name, old)


def fixed_tree(tokens: Sequence[int], parents: Sequence[int]):
    """The test-only `fixedtree` proposer, drafting the tree (tokens, parents) each round."""
    spec = ProposerSpec("fixedtree", "extra_proposers.fixed_tree:build", "a fixed draft tree (test only)")
    return _registered("TREE", (tuple(tokens), tuple(parents)), spec)


def oracle_tree(reference: Sequence[int]):
    """The test-only `oracletree` proposer, drafting `reference` (target-only output) on the
    second branch of a tree each round."""
    spec = ProposerSpec("oracletree", "extra_proposers.fixed_tree:build_oracle", "an oracle draft tree (test only)")
    return _registered("REFERENCE", tuple(reference), spec)
