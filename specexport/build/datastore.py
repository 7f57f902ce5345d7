"""Build a corpus datastore (recipe `retrieval: {corpus: [...], max_tokens: N}`) for the runtime's
retrieval drafts (specexport_runtime/datastore.py has the layout and the lookup).

The corpus files are read as UTF-8 text in sorted path order, tokenized with the artifact's
tokenizer (no special tokens), joined with SEP between documents and cut at `max_tokens`. The
suffix array of the reversed token array is built here with numpy prefix doubling
(`suffix_array`: O(N log N) sorts per round, rounds until every rank is unique, i.e. about
log2 of the longest repeated stretch); no suffix-array package is needed at build or run time.
"""

from __future__ import annotations

import glob
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specexport_runtime.suffix import SEP

from ..errors import BuildError

TOKENS_NAME = "retrieval/tokens.npy"
SUFFIX_ARRAY_NAME = "retrieval/suffix_array.npy"
MAX_FILE_BYTES = 16 << 20  # larger files are skipped (data dumps, not text)


class DatastoreError(BuildError, ValueError):
    """A corpus entry matches no readable text file, or the corpus is empty."""


def suffix_array(seq: np.ndarray) -> np.ndarray:
    """Start indices of the suffixes of `seq` (integers >= -1) in lexicographic order, a suffix
    that ends sorting before any longer one it prefixes. int32 when N < 2**31, else int64."""
    n = int(seq.shape[0])
    if n == 0:
        return np.zeros(0, np.int32)
    rank = np.asarray(seq, np.int64) - int(seq.min()) + 1  # >= 1; 0 = past the end
    k = 1
    while True:
        second = np.zeros(n, np.int64)
        if k < n:
            second[: n - k] = rank[k:]
        order = np.lexsort((second, rank))  # by rank, then by the rank k further on
        r1, r2 = rank[order], second[order]
        new = np.empty(n, np.int64)
        new[order] = np.concatenate([[1], 1 + np.cumsum((r1[1:] != r1[:-1]) | (r2[1:] != r2[:-1]))])
        rank = new
        if int(rank.max()) == n or k >= n:
            return order.astype(np.int32 if n < 2**31 else np.int64)
        k *= 2


def corpus_files(patterns: Sequence[str], base: Path) -> list[Path]:
    """Files named by paths, folders (recursive) or globs, relative to `base`, sorted, deduplicated."""
    files: set[Path] = set()
    for pattern in patterns:
        path = (
            (base / pattern).expanduser()
            if not Path(pattern).expanduser().is_absolute()
            else Path(pattern).expanduser()
        )
        if path.is_file():
            found = [path]
        elif path.is_dir():
            found = [p for p in path.rglob("*") if p.is_file()]
        else:
            found = [Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file()]
        if not found:
            raise DatastoreError(f"retrieval.corpus entry {pattern!r} matches no file (relative to {base})")
        files.update(p.resolve() for p in found)
    return sorted(files)


@dataclass(frozen=True)
class DatastoreInfo:
    files: int
    files_skipped: int  # unreadable as UTF-8 or larger than MAX_FILE_BYTES
    documents: int
    tokens: int  # SEPs included
    truncated: bool  # max_tokens reached
    seconds_tokenize: float
    seconds_suffix_array: float
    bytes: int

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def build_datastore(files: Sequence[Path], tokenizer, max_tokens: int, out_dir: Path) -> DatastoreInfo:
    """Write out_dir/retrieval/{tokens,suffix_array}.npy; `tokenizer` is a tokenizers.Tokenizer."""
    t0 = time.perf_counter()
    parts: list[np.ndarray] = []
    total, skipped, truncated = 0, 0, False
    for path in files:
        try:
            if path.stat().st_size > MAX_FILE_BYTES:
                skipped += 1
                continue
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            skipped += 1
            continue
        ids = np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, np.int32)
        if ids.size == 0:
            continue
        room = max_tokens - total - 1
        if room <= 0:
            truncated = True
            break
        if ids.size > room:
            ids, truncated = ids[:room], True
        parts += [ids, np.array([SEP], np.int32)]
        total += ids.size + 1
        if truncated:
            break
    if not parts:
        raise DatastoreError(f"retrieval.corpus gives no text: {len(files)} file(s), {skipped} unreadable or too large")
    tokens = np.concatenate(parts)
    t1 = time.perf_counter()
    sa = suffix_array(tokens[::-1])
    t2 = time.perf_counter()
    (out_dir / TOKENS_NAME).parent.mkdir(parents=True, exist_ok=True)
    np.save(out_dir / TOKENS_NAME, tokens, allow_pickle=False)
    np.save(out_dir / SUFFIX_ARRAY_NAME, sa, allow_pickle=False)
    return DatastoreInfo(
        files=len(files),
        files_skipped=skipped,
        documents=len(parts) // 2,
        tokens=int(tokens.size),
        truncated=truncated,
        seconds_tokenize=round(t1 - t0, 3),
        seconds_suffix_array=round(t2 - t1, 3),
        bytes=int(tokens.nbytes + sa.nbytes),
    )


__all__ = [
    "SUFFIX_ARRAY_NAME",
    "TOKENS_NAME",
    "DatastoreError",
    "DatastoreInfo",
    "build_datastore",
    "corpus_files",
    "suffix_array",
]
