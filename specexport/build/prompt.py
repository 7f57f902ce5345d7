"""`specexport build --system-prompt FILE`: the system prompt's rows, prefilled at build time.

After packaging (the folder is then a complete artifact, still the build's temporary folder),
the runtime itself opens it, renders the system prompt through the artifact's chat template and
generates a few greedy tokens from those ids with the prefix pool on: the pool then holds what a
run-time prefill of the same ids keeps (prefix_cache.py), computed by the same graphs, sessions
and calls. Those rows go to system_prompt/ (runtime system_prompt.py has the layout) and the
manifest is written again, its `files` (checksums, hence the signature) covering them.

Which ids: the longest common prefix of the chat template's rendering of [system, user] for a
few unlike user messages, i.e. every id before the first user message's text. A request's
prompt then starts with them (the radix match stops at the first id that differs, should a user
message's first characters merge with the last id).
"""

from __future__ import annotations

import platform
from dataclasses import replace
from pathlib import Path

import numpy as np

from specexport_runtime.contract import DECODER, EAGLE3_HEAD
from specexport_runtime.errors import SpecExportError
from specexport_runtime.manifest import read_manifest, write_manifest
from specexport_runtime.prefix_cache import FEATURES, TARGET
from specexport_runtime.system_prompt import FOLDER, PARTS, SystemPromptEntry, graph_facts, prompt_key

from ..errors import BuildError
from .progress import Progress

PROBES = ("A", "7", "\u00bfQu\u00e9?", " x", "\n")  # unlike first user messages
NEW_TOKENS = 4  # greedy tokens generated after the ids: the draft (or head) runs over them once
MAX_BYTES = 1 << 20  # a system prompt file's size limit


def read_system_prompt(path: str | Path) -> str:
    """The text of a system prompt file: UTF-8, non-empty, at most MAX_BYTES."""
    p = Path(path)
    if not p.is_file():
        raise BuildError(f"system prompt file {str(p)!r} does not exist (expected a UTF-8 text file)")
    data = p.read_bytes()
    if len(data) > MAX_BYTES:
        raise BuildError(f"system prompt file {str(p)!r} holds {len(data)} bytes; expected at most {MAX_BYTES}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BuildError(f"system prompt file {str(p)!r} is not UTF-8 text: {exc}") from None
    if not text.strip():
        raise BuildError(f"system prompt file {str(p)!r} is empty; expected the system prompt's text")
    return text


def prompt_ids(codec, text: str) -> list[int]:
    """The ids every chat with system prompt `text` starts with (module docstring)."""
    try:
        system = {"role": "system", "content": text}
        runs = [codec.encode_chat([system, {"role": "user", "content": p}]) for p in PROBES]
    except SpecExportError as exc:
        raise BuildError(f"the system prompt cannot be rendered with the artifact's chat template: {exc}") from None
    n = min(len(r) for r in runs)
    for i in range(n):
        if any(r[i] != runs[0][i] for r in runs):
            n = i
            break
    return runs[0][:n]


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def store_system_prompt(root: Path, text: str, progress: Progress, threads: int | None = None):
    """Prefill `text` (module docstring) into the artifact at `root`; returns its new Manifest."""
    import onnxruntime

    from specexport_runtime.api import load

    manifest = read_manifest(root)
    gen = load(root, verify=False, threads=threads)
    ids = prompt_ids(gen.codec, text)
    if len(ids) < 2 or len(ids) + NEW_TOKENS > manifest.max_context:
        raise BuildError(
            f"the system prompt renders to {len(ids)} ids before the first user message; expected 2 to"
            f" {manifest.max_context - NEW_TOKENS} (max_context {manifest.max_context})"
        )
    progress(f"prefilling the system prompt ({len(ids)} ids)")
    kind = manifest.draft_kind
    proposer = "draft" if kind == DECODER else "eagle" if kind == EAGLE3_HEAD else "none"
    gen.generate(ids, max_new_tokens=NEW_TOKENS, temperature=0.0, proposer=proposer, cache_prompt=True)
    pool = gen.prefix_cache.pool
    match = pool.match("", ids, PARTS)
    if match.rows.get(TARGET, 0) < len(ids):
        raise BuildError(f"the prefix pool kept {match.rows.get(TARGET, 0)} of the system prompt's {len(ids)} rows")
    folder = root / FOLDER
    folder.mkdir()
    (folder / "prompt.txt").write_text(text, encoding="utf-8")
    np.save(folder / "ids.npy", np.asarray(ids, np.int64))
    rows, shapes = {}, {}
    for part in PARTS:
        count = match.rows.get(part, 0)
        if count == 0:
            continue
        pieces: list[np.ndarray] = []
        pool.read(match, part, count, lambda start, a, pieces=pieces: pieces.append(np.array(a)))
        array = np.ascontiguousarray(np.concatenate(pieces, axis=1), np.float32)  # [B, r, H_kv, D] or [1, r, F]
        rel = f"{FOLDER}/{part}.npy"
        np.save(root / rel, array)
        rows[part], shapes[part] = rel, list(array.shape)
    roles = {"target" if p in (TARGET, FEATURES) else "draft" for p in rows}
    built_with = {role: graph_facts(manifest, role) for role in sorted(roles)}
    built_with.update(
        provider="cpu",
        prepack=True,
        threads=threads,
        onnxruntime=onnxruntime.__version__,
        machine=platform.machine(),
        cpu=_cpu(),
        prefill=f"the {len(ids)} ids in one target call from an empty cache, then {NEW_TOKENS} greedy"
        f" tokens with proposer {proposer!r} (runtime load + generate)",
    )
    entry = SystemPromptEntry(
        text=f"{FOLDER}/prompt.txt",
        ids=f"{FOLDER}/ids.npy",
        tokens=len(ids),
        key=prompt_key(ids[:-1]),
        rows=rows,
        shapes=shapes,
        built_with=built_with,
    )
    del gen
    manifest = replace(manifest, system_prompt=entry)
    write_manifest(root, manifest)
    return read_manifest(root)
