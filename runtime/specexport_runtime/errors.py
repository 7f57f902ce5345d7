"""Typed errors of the runtime. Each message names the bad value and what was expected."""

from __future__ import annotations


class SpecExportError(Exception):
    """Base of every error specexport raises on purpose (the CLI prints these in one line)."""


class ArtifactError(SpecExportError):
    """The artifact folder is missing, incomplete, tampered with or of an unsupported version."""


class ChecksumError(ArtifactError):
    """A file's sha256 differs from the one recorded in the manifest."""


class ContractError(ArtifactError):
    """A graph does not follow the graph contract the manifest declares."""


class InvalidArgument(SpecExportError, ValueError):
    """A caller passed a value outside its allowed range."""


class ProviderUnavailable(SpecExportError):
    """The requested execution provider is not available in this onnxruntime build."""


class PromptError(SpecExportError, ValueError):
    """The prompt is empty, not valid UTF-8, or longer than the context allows."""
