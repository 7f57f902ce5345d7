"""Typed errors of the build side.

Every error the build side raises on purpose subclasses
`specexport_runtime.errors.SpecExportError`, so the CLI prints it in one line. Each message names
the bad value and what was expected. Runtime errors are re-exported for convenience.
"""

from __future__ import annotations

from specexport_runtime.errors import (  # noqa: F401  (re-exported)
    ArtifactError,
    ChecksumError,
    ContractError,
    InvalidArgument,
    PromptError,
    ProviderUnavailable,
    SpecExportError,
)


class BuildError(SpecExportError):
    """Base of the errors raised while building an artifact."""


class RecipeError(BuildError, ValueError):
    """A recipe file is missing, is not valid YAML, or does not follow the recipe schema."""


class TokenizerMismatch(BuildError):
    """Target and draft tokenizers do not map the same text to the same token ids."""


class HarnessError(SpecExportError, ValueError):
    """Invalid measurement input: no prompts, a warm-up inside the measured set, a repeated name, ..."""
