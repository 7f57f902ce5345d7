"""The corpus datastore: the suffix array (specexport/build/datastore.py) against Python's sort of the
explicit suffixes, and the runtime lookup (specexport_runtime/datastore.py, memory-mapped)
against test_suffix's brute-force reference over the corpus documents."""

from __future__ import annotations

import random

import numpy as np
import pytest
from test_suffix import reference
from tokenizers import Tokenizer, models, pre_tokenizers

from specexport.build.datastore import (
    SUFFIX_ARRAY_NAME,
    TOKENS_NAME,
    DatastoreError,
    build_datastore,
    corpus_files,
    suffix_array,
)
from specexport_runtime.datastore import Datastore
from specexport_runtime.errors import ArtifactError
from specexport_runtime.suffix import SEP, SuffixConfig


@pytest.mark.parametrize("seed", range(30))
def test_suffix_array_sorts_the_suffixes(seed):
    rng = random.Random(seed)
    seq = [rng.choice([SEP, 0, 1, 2, 5]) for _ in range(rng.randrange(1, 200))]
    want = sorted(range(len(seq)), key=lambda i: seq[i:])  # a prefix sorts before its extensions
    got = suffix_array(np.asarray(seq, np.int32))
    assert got.dtype == np.int32 and got.tolist() == want


def _docs(rng: random.Random, alphabet: int) -> list[list[int]]:
    return [[rng.randrange(alphabet) for _ in range(rng.randrange(1, 60))] for _ in range(rng.randrange(1, 12))]


def _store(docs: list[list[int]], tmp_path, name: str = "ds") -> Datastore:
    tokens = np.asarray([t for d in docs for t in d + [SEP]], np.int32)
    (tmp_path / name).mkdir()
    np.save(tmp_path / name / "t.npy", tokens)
    np.save(tmp_path / name / "sa.npy", suffix_array(tokens[::-1]))
    return Datastore.open(tmp_path / name / "t.npy", tmp_path / name / "sa.npy")


@pytest.mark.parametrize("seed", range(40))
def test_lookup_matches_the_brute_force_reference(seed, tmp_path, monkeypatch):
    rng = random.Random(seed)
    docs = _docs(rng, rng.choice([2, 4, 9]))
    store = _store(docs, tmp_path)
    assert isinstance(store.tokens, np.memmap)  # memory-mapped, not read whole
    if seed % 2:  # the scalar binary search path as well as the vectorized one
        monkeypatch.setattr("specexport_runtime.datastore.VECTOR_RANGE", 0)
    config = SuffixConfig(
        max_depth=rng.choice([1, 4, 24]), max_spec=rng.choice([2, 8]), min_prob=rng.choice([0.0, 0.3])
    )
    for _ in range(5):
        context = [rng.randrange(9) for _ in range(rng.randrange(1, 10))]
        tokens, score, m = store.propose(context, config, room=100)
        want = reference(docs, context, config)
        assert (tokens, m) == (want[0], want[2]), (docs, context)
        assert score == pytest.approx(want[1])


def test_bad_arrays_are_refused(tmp_path):
    np.save(tmp_path / "t.npy", np.arange(5, dtype=np.int64))
    np.save(tmp_path / "sa.npy", np.arange(5, dtype=np.int32))
    with pytest.raises(ArtifactError, match="int32 tokens"):
        Datastore.open(tmp_path / "t.npy", tmp_path / "sa.npy")
    with pytest.raises(ArtifactError, match="not readable"):
        Datastore.open(tmp_path / "missing.npy", tmp_path / "sa.npy")


def _word_tokenizer(words: list[str]) -> Tokenizer:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def test_build_from_files_and_globs(tmp_path):
    words = ["<unk>", "alpha", "beta", "gamma", "delta"]
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "a.txt").write_text("alpha beta gamma")
    (corpus / "sub" / "b.md").write_text("beta gamma delta alpha")
    (corpus / "bin.dat").write_bytes(b"\xff\xfe\x00")  # not UTF-8: skipped
    files = corpus_files(["corpus/*.txt", "corpus/sub"], tmp_path)
    assert [f.name for f in files] == ["a.txt", "b.md"]
    info = build_datastore(files, _word_tokenizer(words), max_tokens=1000, out_dir=tmp_path / "art")
    tokens = np.load(tmp_path / "art" / TOKENS_NAME)
    assert tokens.tolist() == [1, 2, 3, SEP, 2, 3, 4, 1, SEP]
    assert np.load(tmp_path / "art" / SUFFIX_ARRAY_NAME).tolist() == suffix_array(tokens[::-1]).tolist()
    assert (info.documents, info.tokens, info.truncated) == (2, 9, False)
    store = Datastore.open(tmp_path / "art" / TOKENS_NAME, tmp_path / "art" / SUFFIX_ARRAY_NAME)
    assert store.propose([9, 2, 3], SuffixConfig(min_prob=0.0), room=8)[0] == [4, 1]  # beta gamma -> delta alpha
    small = build_datastore(files, _word_tokenizer(words), max_tokens=5, out_dir=tmp_path / "small")
    assert small.truncated and small.tokens <= 5
    assert (
        build_datastore(corpus_files(["corpus"], tmp_path), _word_tokenizer(words), 1000, tmp_path / "c").files_skipped
        == 1
    )
    with pytest.raises(DatastoreError, match="'nothing/\\*.py' matches no file"):
        corpus_files(["nothing/*.py"], tmp_path)
