"""Detached ed25519 signatures over an artifact's manifest (docs/artifact.md).

The manifest lists every file's sha256, so a signature over the manifest covers every file:
`load(..., trusted_keys=[...])` checks the signature first, then the checksums. What is signed is
the canonical form of manifest.json (parsed, then dumped with sorted keys, no whitespace, ASCII),
so re-indenting the file does not break a signature but any change of content does.

    manifest.sig   {"format": "specexport-signature/1", "algorithm": "ed25519",
                    "key_id": first 16 hex of sha256(raw public key), "signature": base64}

Keys are PEM files (`specexport keygen`): the private key PKCS#8 (written 0600), the public key
SubjectPublicKeyInfo. The crypto is the `cryptography` package's (pip install ./runtime[sign]);
nothing here is hand-written crypto.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

from .errors import ArtifactError, InvalidArgument

SIGNATURE_NAME = "manifest.sig"
SIGNATURE_FORMAT = "specexport-signature/1"
MANIFEST = "manifest.json"
MAX_SIGNATURE_BYTES = 4096


class SignatureError(ArtifactError):
    """The artifact is unsigned, its signature is malformed or wrong, or its key is not trusted."""


def _crypto():
    try:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:
        raise InvalidArgument("signatures need the cryptography package: pip install './runtime[sign]'") from None
    return ed25519, serialization, InvalidSignature


def canonical_manifest(root: Path) -> bytes:
    path = Path(root) / MANIFEST
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArtifactError(f"{str(path)!r} is not a readable JSON manifest: {exc}") from exc
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def _raw_public(public) -> bytes:
    _, serialization, _ = _crypto()
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_id(public) -> str:
    return hashlib.sha256(_raw_public(public)).hexdigest()[:16]


def keygen(folder: Path, name: str = "specexport") -> tuple[Path, Path]:
    """Write NAME.key (private, 0600) and NAME.pub into `folder`; refuses to overwrite a key."""
    ed25519, serialization, _ = _crypto()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    private_path, public_path = folder / f"{name}.key", folder / f"{name}.pub"
    for path in (private_path, public_path):
        if path.exists():
            raise InvalidArgument(f"{str(path)!r} exists; keygen never overwrites a key")
    key = ed25519.Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(pem)
    public_path.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return private_path, public_path


def _load_private(path: Path):
    ed25519, serialization, _ = _crypto()
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as exc:
        raise InvalidArgument(f"private key {str(path)!r} is not a readable unencrypted PEM key: {exc}") from None
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise InvalidArgument(f"private key {str(path)!r} is a {type(key).__name__}, expected an ed25519 key")
    return key


def load_public(source: Path | str | bytes):
    """A trusted public key: a PEM file path or PEM bytes."""
    ed25519, serialization, _ = _crypto()
    try:
        pem = source if isinstance(source, bytes) else Path(source).read_bytes()
        key = serialization.load_pem_public_key(pem)
    except (OSError, ValueError, TypeError) as exc:
        raise InvalidArgument(f"trusted key {str(source)[:80]!r} is not a readable PEM public key: {exc}") from None
    if not isinstance(key, ed25519.Ed25519PublicKey):
        raise InvalidArgument(f"trusted key {str(source)[:80]!r} is a {type(key).__name__}, expected an ed25519 key")
    return key


def sign(root: Path, private_key: Path) -> Path:
    """Write ROOT/manifest.sig for the manifest as it is now (written to a temporary file, then
    renamed, so a reader never sees half a signature)."""
    key = _load_private(private_key)
    root = Path(root)
    message = canonical_manifest(root)
    record = {
        "format": SIGNATURE_FORMAT,
        "algorithm": "ed25519",
        "key_id": key_id(key.public_key()),
        "signature": base64.b64encode(key.sign(message)).decode("ascii"),
    }
    tmp = root / f".{SIGNATURE_NAME}.tmp"
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, root / SIGNATURE_NAME)
    return root / SIGNATURE_NAME


def verify(root: Path, trusted_keys: Iterable[Path | str | bytes]) -> str:
    """Check ROOT/manifest.sig against the trusted keys; returns the signing key's id."""
    _, _, InvalidSignature = _crypto()
    keys = {key_id(k): k for k in (load_public(s) for s in trusted_keys)}
    if not keys:
        raise InvalidArgument("trusted_keys is empty: give at least one public key, or none to skip verification")
    path = Path(root) / SIGNATURE_NAME
    if not path.is_file():
        raise SignatureError(
            f"artifact {str(root)!r} is not signed ({SIGNATURE_NAME} is missing) and trusted keys are set"
        )
    if path.stat().st_size > MAX_SIGNATURE_BYTES:
        raise SignatureError(
            f"{SIGNATURE_NAME} is {path.stat().st_size} bytes; a signature file is < {MAX_SIGNATURE_BYTES}"
        )
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        ok = (
            isinstance(record, dict)
            and record.get("format") == SIGNATURE_FORMAT
            and record.get("algorithm") == "ed25519"
            and isinstance(record.get("key_id"), str)
        )
        signature = base64.b64decode(record["signature"], validate=True) if ok else b""
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        raise SignatureError(f"{SIGNATURE_NAME} is malformed (expected {SIGNATURE_FORMAT} with an ed25519 signature)")
    key = keys.get(record["key_id"])
    if key is None:
        raise SignatureError(
            f"the artifact is signed by key {record['key_id']!r}, which is not among the trusted keys"
            f" ({', '.join(sorted(keys))})"
        )
    try:
        key.verify(signature, canonical_manifest(Path(root)))
    except InvalidSignature:
        raise SignatureError(
            f"the signature of {str(root)!r} does not match its manifest (modified after signing,"
            f" or signed by another key with the same id)"
        ) from None
    return record["key_id"]


__all__ = ["SIGNATURE_NAME", "SignatureError", "canonical_manifest", "keygen", "load_public", "sign", "verify"]
