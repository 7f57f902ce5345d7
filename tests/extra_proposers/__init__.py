"""Proposers that exist only for the tests: each one a module in this folder plus its
ProposerSpec in TEST_PROPOSERS. tests/runtime/test_proposer_matrix.py registers them
(registry.extended) while it runs, so the registry-driven matrix covers them like the built-in
ones; the rest of the suite never sees them."""

from __future__ import annotations

from specexport_runtime.registry import ProposerSpec

TEST_PROPOSERS: tuple[ProposerSpec, ...] = (
    ProposerSpec("repeat", "extra_proposers.repeat:build", "the last token again (test only)"),
)
