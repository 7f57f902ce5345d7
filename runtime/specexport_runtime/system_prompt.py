"""A system prompt prefilled at build time (`specexport build --system-prompt FILE`, docs/prefix-cache.md).

The artifact holds, under system_prompt/ and listed in the manifest's `files` like every other
file (so a signature over the manifest covers them):
    prompt.txt       the system prompt as given (UTF-8)
    ids.npy          int64 [n]: the ids every chat with that system prompt starts with (the
                     chat template's rendering up to the first user message)
    <part>.npy       a model's rows of those ids, as the prefix pool keeps them (prefix_pool.py):
                       target, draft, head  float32 [2 x layers, r, H_kv, D]  (r <= n)
                       features             float32 [1, r, F]  (an EAGLE-3 head's target features)
The manifest's `system_prompt` section (SystemPromptEntry) names them, their shapes, and what
the rows were built with (`built_with`: each graph's file checksums and padding, the provider,
the prefill call). A runtime whose graphs differ from those refuses the artifact at load, in
one line; rows from another graph are never restored.

Lazy: nothing under system_prompt/ is read at load (verify_files(..., lazy=True) skips it) or for
a request whose prompt does not start with the stored ids (the manifest's `key`, a sha256 of
them, decides). A request whose prompt does, and whose prefix pool lacks those rows, streams each
file it needs straight into its model's cache (`stream`): one reused buffer per K/V buffer, every
byte hashed as it is read, the sha256 checked against the manifest before the rows are used
(ChecksumError otherwise, on every such request). Before the first use on this runtime the
target checks them: the request restores all but the last stored row and its prefill's call
recomputes that row with the rest of the prompt; a `bitwise` target must give the stored row bit
for bit (another CPU's kernels may not; the prompt is then refused, the prefill starts again from
row 0, and `describe()` says why), a `numerical` one within NUMERICAL_TOL. The draft's rows follow
after the first token (prefix_cache.Lease.restore_late). What the generation leaves goes into the
prefix pool as any other generation's rows.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ArtifactError, ChecksumError

FOLDER = "system_prompt"
PARTS = ("target", "draft", "head", "features")  # prefix_cache's pool parts
HEADER_BYTES = 4096  # an .npy header of the stored rows fits in this many bytes
NUMERICAL_TOL = 1e-3  # max |row difference| accepted for a `numerical` target


@dataclass(frozen=True)
class SystemPromptEntry:
    """The manifest's `system_prompt` section (module docstring); paths relative to the root."""

    text: str  # prompt.txt
    ids: str  # ids.npy, int64 [tokens]
    tokens: int  # n
    key: str  # sha256 of ids[:n - 1] as little-endian int64 bytes (prompt_key): matched without reading a file
    rows: dict[str, str] = field(default_factory=dict)  # part -> .npy path
    shapes: dict[str, list[int]] = field(default_factory=dict)  # part -> the array's shape
    built_with: dict[str, Any] = field(default_factory=dict)  # graph facts and the prefill (graph_facts)

    def files(self) -> list[str]:
        return [self.text, self.ids, *self.rows.values()]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SystemPromptEntry:
        entry = cls(**{**data, "rows": dict(data.get("rows", {})), "shapes": dict(data.get("shapes", {}))})
        for part, path in entry.rows.items():
            shape = entry.shapes.get(part)
            if part not in PARTS or not isinstance(path, str):
                raise ArtifactError(f"manifest system_prompt.rows key {part!r} is not one of {', '.join(PARTS)}")
            if (
                not isinstance(shape, list)
                or len(shape) != (3 if part == "features" else 4)
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
                or shape[1] > entry.tokens
            ):
                raise ArtifactError(
                    f"manifest system_prompt.shapes[{part!r}] {shape!r:.80} is not a row shape of at most"
                    f" {entry.tokens} rows"
                )
        if "target" not in entry.rows:
            raise ArtifactError("manifest system_prompt.rows lacks 'target' (the target's rows are what it stores)")
        return entry


def prompt_key(ids) -> str:
    """sha256 of token ids as little-endian int64 bytes (SystemPromptEntry.key of ids[:n - 1])."""
    return hashlib.sha256(np.asarray(ids, "<i8").tobytes()).hexdigest()


def graph_facts(manifest, role: str) -> dict[str, Any] | None:
    """What a stored row depends on in the artifact, for the target or the draft entry: its graph
    files' checksums (the weights and the graph), layout, padding and cache shape; None without
    that entry."""
    entry = manifest.target if role == "target" else manifest.draft
    if entry is None:
        return None
    return {
        "graph": entry.graph,
        "sha256": manifest.files.get(entry.graph),
        "data_sha256": manifest.files.get(entry.graph + ".data"),
        "kv_layout": entry.kv_layout,
        "kv_dtype": entry.kv_dtype,
        "min_rows": entry.min_rows,
        "cache_pad": entry.cache_pad,
        "num_layers": entry.num_layers,
        "num_kv_heads": entry.num_kv_heads,
        "head_dim": entry.head_dim,
        "exactness": entry.exactness,
    }


def _role(part: str) -> str:
    return "target" if part in ("target", "features") else "draft"


def check_built_with(manifest, entry: SystemPromptEntry) -> None:
    """ArtifactError (one line) if the stored rows were built with graphs other than the
    artifact's: rows are only ever restored into the graph that computed them."""
    built = entry.built_with if isinstance(entry.built_with, dict) else {}
    for role in sorted({_role(p) for p in entry.rows}):
        have, was = graph_facts(manifest, role), built.get(role)
        if have is None or not isinstance(was, dict):
            raise ArtifactError(f"the stored system prompt has {role} rows, but the artifact has no {role} graph")
        diff = sorted(k for k in have if have[k] != was.get(k))
        if diff:
            key = diff[0]
            raise ArtifactError(
                f"the stored system prompt's {role} rows were built with {key} {was.get(key)!r:.40}, but the"
                f" artifact's {role} graph has {have[key]!r:.40}: rebuild it with --system-prompt"
            )


def read_checked(root: Path, rel: str, expected: str | None) -> np.ndarray:
    """The .npy file `rel`, read once: its sha256 checked against the manifest's, the array
    parsed from the same bytes."""
    data = (root / rel).read_bytes()
    _verify(rel, hashlib.sha256(data), expected)
    return parse_npy(rel, data)


def npy_header(rel: str, data: bytes) -> tuple[tuple[tuple[int, ...], np.dtype], int]:
    """((shape, dtype), offset of the array's bytes) from the start of an .npy file's bytes.
    Called on one thread at a time: numpy parses the header with ast.literal_eval, which CPython
    3.11 can fail with "AST constructor recursion depth mismatch" when two threads compile at once."""
    buf = io.BytesIO(data)
    try:
        version = np.lib.format.read_magic(buf)
        header = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}.get(version)
        if header is None:
            raise ArtifactError(f"{rel!r} is an .npy file of version {version}; expected 1.0 or 2.0")
        shape, fortran, dtype = header(buf)
    except ValueError as exc:
        raise ArtifactError(f"{rel!r} is not an .npy file: {str(exc).splitlines()[0]:.120}") from None
    if fortran or dtype.hasobject:
        raise ArtifactError(f"{rel!r} is not a C-ordered numeric array")
    return (tuple(shape), dtype), buf.tell()


def parse_npy(rel: str, data: bytes) -> np.ndarray:
    """The array of an .npy file's bytes (a view of them); on one thread at a time (npy_header)."""
    (shape, dtype), offset = npy_header(rel, data)
    return np.frombuffer(data, dtype, count=int(np.prod(shape)), offset=offset).reshape(shape)


def _verify(rel: str, digest, expected: str | None) -> None:
    actual = digest.hexdigest()
    if actual != expected:
        raise ChecksumError(
            f"checksum mismatch for {rel!r}: manifest says {str(expected)[:16]}..., file has {actual[:16]}..."
            " (the stored system prompt was modified or truncated; rebuild the artifact)"
        )


class StoredPrompt:
    """An artifact's stored system prompt at run time (module docstring)."""

    def __init__(self, root: Path, manifest, entry: SystemPromptEntry):
        check_built_with(manifest, entry)
        self.root, self.entry, self.files = Path(root), entry, manifest.files
        self.bitwise = manifest.target.exactness == "bitwise"
        self._ids: np.ndarray | None = None  # read on first use (a few KB)
        self.refused: str | None = None  # why it is not restored on this runtime
        self.checked = False  # the target recomputed a stored row here and agreed
        self.restored: dict[str, int] = {}  # part -> times a request's rows came from its file

    @classmethod
    def of(cls, root: Path, manifest) -> StoredPrompt | None:
        entry = getattr(manifest, "system_prompt", None)
        return None if entry is None else cls(root, manifest, entry)

    @property
    def ids(self) -> np.ndarray:
        if self._ids is None:
            ids = read_checked(self.root, self.entry.ids, self.files.get(self.entry.ids))
            if ids.dtype != np.int64 or ids.shape != (self.entry.tokens,):
                raise ArtifactError(
                    f"{self.entry.ids!r} is not int64 [{self.entry.tokens}] (got {ids.dtype} {list(ids.shape)})"
                )
            if prompt_key(ids[:-1]) != self.entry.key:
                raise ArtifactError(f"{self.entry.ids!r} does not hold the ids of the manifest's system_prompt.key")
            self._ids = ids
        return self._ids

    def covers(self, prompt: Sequence[int]) -> bool:
        """Whether `prompt` starts with the stored ids (all but possibly the last, which a first
        user message may merge with) and goes on after them."""
        n = self.entry.tokens
        if self.refused is not None or len(prompt) < n or n < 2:
            return False
        return prompt_key(prompt[: n - 1]) == self.entry.key

    def stream(self, part: str, stop: int, dests: Sequence[np.ndarray], keep: int | None = None) -> np.ndarray | None:
        """Copy rows [0, stop) of the stored `part` ([B, r, ...] float32) into `dests` (B views
        [stop, ...], a model's cache rows), reading its file once, one buffer b at a time into two
        reused arrays in turn: every byte is hashed as it is read (on a second thread, beside the
        copy), and the sha256 is checked against the manifest after the last (ChecksumError: the
        views then hold unchecked rows, which the request's next prefill resets before any use).
        keep: a row whose rows [B, 1, ...] come back (a copy; the machine check's). No array of
        the file's size is made."""
        rel, shape = self.entry.rows[part], self.entry.shapes[part]
        digest = hashlib.sha256()
        with open(self.root / rel, "rb") as f:
            head = f.read(HEADER_BYTES)
            try:
                got, offset = npy_header(rel, head)
            except ArtifactError:
                digest.update(head)
                digest.update(f.read())
                _verify(rel, digest, self.files.get(rel))
                raise
            digest.update(head[:offset])
            f.seek(offset)
            if got != (tuple(shape), np.dtype("<f4")):
                raise ArtifactError(f"{rel!r} holds {got[1]} {list(got[0])}, the manifest says float32 {shape}")
            kept = None if keep is None else np.empty((shape[0], 1, *shape[2:]), np.float32)
            slabs = [np.empty(shape[1:], np.float32) for _ in range(2)]  # one buffer's rows [r, ...], two in turn
            hashing: list[Future | None] = [None, None]
            with ThreadPoolExecutor(1) as hasher:  # one worker: updates run in order, beside the copies
                for b in range(shape[0]):
                    i = b % 2
                    slab = slabs[i]
                    if hashing[i] is not None:
                        hashing[i].result()  # its last bytes are hashed: the slab may be read into
                    raw = memoryview(slab).cast("B")
                    if f.readinto(raw) != raw.nbytes:
                        raise ChecksumError(f"{rel!r} is truncated (the stored system prompt was modified; rebuild it)")
                    hashing[i] = hasher.submit(digest.update, raw)
                    dests[b][...] = slab[:stop]
                    if kept is not None:
                        kept[b, 0] = slab[keep]
                hasher.submit(digest.update, f.read()).result()
        _verify(rel, digest, self.files.get(rel))
        self.restored[part] = self.restored.get(part, 0) + 1
        return kept

    def agree(self, got: np.ndarray, want: np.ndarray) -> bool:
        """Whether target rows this runtime computed (`got`) match the stored ones (`want`): bit
        for bit for a `bitwise` target, within NUMERICAL_TOL for a `numerical` one. The first
        answer is final: `checked`, or `refused` with the difference (the prompt is then never
        restored on this runtime)."""
        diff = float(np.max(np.abs(got - want)))
        ok = diff == 0 if self.bitwise else diff <= NUMERICAL_TOL
        if not ok:
            self.refused = (
                f"this machine's target rows differ from the stored ones by up to {diff:.3g}"
                f" (built on {self.entry.built_with.get('machine')!r}, {self.entry.built_with.get('cpu')!r})"
            )
        self.checked = ok
        return ok

    def describe(self) -> dict:
        return {
            "tokens": self.entry.tokens,
            "parts": sorted(self.entry.rows),
            "restored": dict(self.restored),
            "checked": self.checked,
            "refused": self.refused,
        }
