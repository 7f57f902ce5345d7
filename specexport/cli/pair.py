"""The tokenizers `specexport check-pair` compares: a built artifact's, or a model source's, loaded
without waiting on a hub that cannot answer.

A side is
- a built artifact: a folder with manifest.json, or a .spx package; its tokenizer file (checked
  against the manifest's checksum of it) with the BOS and EOS ids the manifest records (ArtifactTokenizer);
- anything `resolve_source` takes (a Hugging Face folder, a .gguf, builtin:NAME, a hub id). A hub
  id is read from the local cache first (local_files_only); when it is not cached and the hub
  cannot be reached (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE set, or the endpoint's host does not
  answer within PROBE_SECONDS), the answer is one ModelSourceError line at once instead of
  huggingface_hub's retries (about 45 s).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import tarfile
from pathlib import Path
from urllib.parse import urlparse

from ..models.sources import ModelSourceError, load_tokenizer, resolve_source

MANIFEST = "manifest.json"
PACKAGE_SUFFIX = ".spx"
PROBE_SECONDS = 3.0  # how long the hub's host may take to accept a connection
_TRUE = ("1", "true", "yes", "on")
_PROXIES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


class ArtifactTokenizer:
    """A built artifact's tokenizer as tokcheck.check_pair reads it: `backend_tokenizer`, the BOS
    and EOS roles (EOS: the first of the manifest's eos_token_ids; `stop_token_ids` all of them).
    UNK and PAD are not recorded in an artifact, so they are absent (not compared)."""

    def __init__(self, tokenizer_json: bytes, info: dict, where: str):
        from tokenizers import Tokenizer

        try:
            self.backend_tokenizer = Tokenizer.from_str(tokenizer_json.decode("utf-8"))
        except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
            raise ModelSourceError(f"the tokenizer file of artifact {where!r} is unreadable: {exc}") from None
        bos, eos = info.get("bos_token_id"), tuple(info.get("eos_token_ids") or ())
        self.bos_token_id = bos
        self.bos_token = None if bos is None else self.backend_tokenizer.id_to_token(bos)
        self.stop_token_ids = eos
        self.eos_token_id = eos[0] if eos else None
        self.eos_token = None if not eos else self.backend_tokenizer.id_to_token(eos[0])


def is_artifact(spec: str) -> bool:
    path = Path(spec).expanduser()
    return (path.is_dir() and (path / MANIFEST).is_file()) or (path.suffix == PACKAGE_SUFFIX and path.is_file())


def artifact_tokenizer(spec: str) -> ArtifactTokenizer:
    """The tokenizer of the artifact folder or .spx package `spec`; ModelSourceError in one line."""
    path = Path(spec).expanduser()
    try:
        if path.is_dir():
            manifest = json.loads((path / MANIFEST).read_text())
            info = manifest["tokenizer"]
            data = (path / info["file"]).read_bytes()
        else:
            with tarfile.open(path, "r:") as tar:
                manifest = json.loads(tar.extractfile(MANIFEST).read())
                info = manifest["tokenizer"]
                data = tar.extractfile(info["file"]).read()
    except (
        OSError,
        tarfile.TarError,
        json.JSONDecodeError,
        UnicodeDecodeError,
        KeyError,
        TypeError,
        AttributeError,
    ) as exc:
        detail = f"missing {exc}" if isinstance(exc, KeyError) else str(exc) or type(exc).__name__
        raise ModelSourceError(f"cannot read the tokenizer of artifact {spec!r}: {detail}") from None
    files = manifest.get("files")
    want = files.get(info["file"]) if isinstance(files, dict) else None  # the file's sha256, as load checks it
    if want is not None and hashlib.sha256(data).hexdigest() != want:
        raise ModelSourceError(
            f"the tokenizer file of artifact {spec!r} does not match its manifest's sha256 (modified or truncated)"
        )
    return ArtifactTokenizer(data, info, spec)


def offline_reason() -> str | None:
    """Why the hub cannot be asked now, or None when it may answer."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(name, "").strip().lower() in _TRUE:
            return f"{name} is set"
    if any(os.environ.get(name) for name in _PROXIES):  # a proxy may reach what this machine cannot
        return None
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    url = urlparse(endpoint)
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=PROBE_SECONDS).close()
    except OSError as exc:
        return f"{host}:{port} cannot be reached ({exc.strerror or exc})"
    return None


def _cached(source):
    """The hub source's tokenizer from the local cache only, or None when it is not cached."""
    from transformers import AutoTokenizer

    kwargs = {"local_files_only": True}
    if source.gguf_file:
        kwargs["gguf_file"] = source.gguf_file
    if source.revision:
        kwargs["revision"] = source.revision
    try:
        tok = AutoTokenizer.from_pretrained(source.location, **kwargs)
    except (OSError, ValueError):
        return None
    return tok if getattr(tok, "is_fast", False) else None


def pair_tokenizer(spec: str):
    """check_pair's tokenizer for one side of `check-pair` (module docstring)."""
    if is_artifact(spec):
        return artifact_tokenizer(spec)
    source = resolve_source(spec)
    if source.kind != "hub":
        return load_tokenizer(source)
    tok = _cached(source)
    if tok is not None:
        return tok
    reason = offline_reason()
    if reason is not None:
        raise ModelSourceError(
            f"hub id {spec!r} is not in the local cache and the hub cannot be asked: {reason}; give a model"
            " folder, a .gguf or a built artifact instead"
        )
    return load_tokenizer(source)
