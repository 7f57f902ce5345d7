"""`specexport inspect`: what an artifact holds, with its checksums verified."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from specexport_runtime.manifest import SIGNATURE_NAME, read_manifest, verify_files
from specexport_runtime.signing import verify as verify_signature


def summarize(root: Path, verify: bool = True, trusted_keys=()) -> dict:
    """Manifest facts plus file sizes; raises ChecksumError/ArtifactError when verify fails, and
    SignatureError when trusted_keys are given and the signature does not verify."""
    signature = (
        "not signed" if not (Path(root) / SIGNATURE_NAME).is_file() else "present, not checked (no --trusted-key)"
    )
    if trusted_keys:
        signature = f"verified (key {verify_signature(Path(root), trusted_keys)})"
        verify = True
    manifest = read_manifest(root)
    if verify:
        verify_files(root, manifest)
    summary: dict = {
        "name": manifest.name,
        "contract_version": manifest.contract_version,
        "schema_version": manifest.schema_version,
        "max_context": manifest.max_context,
        "proposer": manifest.speculation.proposer,
        "gamma": manifest.speculation.gamma,
        "files": len(manifest.files),
        "bytes": sum((root / rel).stat().st_size for rel in manifest.files),
        "checksums": "verified" if verify else "not checked",
        "signature": signature,
        "eos_token_ids": list(manifest.tokenizer.eos_token_ids),
        "tools": manifest.tools,
    }
    for role, entry in (("target", manifest.target), ("draft", manifest.draft)):
        if entry is None:
            continue
        folder = (root / entry.graph).parent
        data = asdict(entry)
        data["bytes"] = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
        data["kv_cache_bytes"] = entry.graph_spec().kv_bytes(manifest.max_context)
        summary[role] = data
    if manifest.retrieval is not None:
        r = manifest.retrieval
        summary["retrieval"] = {
            "token_count": r.token_count,
            "documents": r.info.get("documents"),
            "corpus": r.info.get("corpus"),
            "bytes": sum((root / f).stat().st_size for f in (r.tokens, r.suffix_array)),
        }
    return summary
