"""A GGUF file's tokenizer from its tokenizer.ggml.* metadata (models/gguf_tokenizer.py), for every
architecture the GGUF reader reads, hybrids included (transformers' own GGUF tokenizer loader
first builds the model's config and fails on nemotron_h, granitehybrid and falcon-h1 files).

Each case trains a byte-level BPE with the `tokenizers` library, split the way its family's
tokenizer.json splits (the expressions are written here from those files, not taken from the
loader's table), writes its vocabulary, merges, token types, special ids and chat template as
llama.cpp's converter does (gguf_support._tokenizer) under the family's tokenizer.ggml.pre name,
and compares what load_tokenizer builds from the file with the original `tokenizers` object.
"""

from __future__ import annotations

import pytest
from gguf import GGUFWriter
from gguf_support import _tokenizer
from tiny import CHAT_TEMPLATE, SPECIALS
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from specexport.models.sources import ModelSource, ModelSourceError, load_tokenizer

LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _split(regex: str):
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _gpt2():
    return pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2's expression built in


def _smollm():
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )


# the families' pre-tokenizers as their tokenizer.json files write them
SPLITS = {
    "gpt2": _gpt2,
    "smollm": _smollm,
    "llama3": lambda: _split(LLAMA3),
    "qwen2": lambda: _split(QWEN2),
    "qwen35": lambda: _split(QWEN35),
    "tekken": lambda: _split(TEKKEN),
}
# case -> (general.architecture, tokenizer.ggml.pre, its family's split in SPLITS)
CASES = {
    "llama-smollm": ("llama", "smollm", "smollm"),
    "llama-gpt2": ("llama", "gpt-2", "gpt2"),
    "qwen35": ("qwen35", "qwen35", "qwen35"),
    "qwen35-qwen2": ("qwen35", "qwen2", "qwen2"),
    "lfm2": ("lfm2", "lfm2", "llama3"),
    "falcon-h1": ("falcon-h1", "falcon-h1", "llama3"),
    "granitehybrid": ("granitehybrid", "dbrx", "llama3"),
    "nemotron_h": ("nemotron_h", "tekken", "tekken"),
}
CORPUS = [
    "def add(a, b):\n    return a + b\n\n\n",
    "The quick brown fox jumps over the lazy dog; it's 12345 times faster, isn't it?",
    "for i in range(1000):\n\tprint(i * 2024)  # 3.14159 ... !!!\r\n",
    "Ünïcödé wörds, naïve café — 日本語のテキスト, русский текст, emoji 🚀🦙 and ñ.",
    "HTTPServer getURL XMLParser camelCase snake_case   three   spaces",
    "I've been told he's there, 'RE you sure? We'Ve a'lL 42 2048 999999",
    "नमस्ते दुनिया, combining marks: cafe\u0301 nai\u0308ve e\u0301te\u0301 https://example.org/a/b",
]
TEXTS = [
    "Hello  world 12345\n\nnew paragraph",
    "def f(x):\n    return x**2  # ok\t\ttab\r\n",
    "héllo wörld — 日本語 🚀 3.14159 1,000,000",
    "   leading spaces and trailing   ",
    "I've 'RE 'll don't CamelCaseHTTP getURL",
    "\n\n\n \n  \n",
    "naïve café 2024-06-01 12:30",
    "नमस्ते cafe\u0301 de\u0301ja\u0300 vu /usr/local/bin",
]


def train(pre, vocab_size: int = 500) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    return tok


def _fast(tok: Tokenizer):
    """`tok` as the transformers tokenizer gguf_support._tokenizer writes (specials, chat template)."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=SPECIALS[0], bos_token=SPECIALS[1], eos_token=SPECIALS[2]
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def write_tokenizer_gguf(path, arch: str, tok: Tokenizer, pre: str | None, model: str = "gpt2"):
    """A GGUF file of `arch` holding only tokenizer metadata (the tokenizer reads nothing else)."""
    w = GGUFWriter(str(path), arch)
    _tokenizer(w, _fast(tok), pre="-" if pre is None else pre)
    if pre is None or model != "gpt2":  # rewrite the two keys _tokenizer set
        w.kv_data[0].pop("tokenizer.ggml.pre")
        w.kv_data[0].pop("tokenizer.ggml.model")
        w.add_tokenizer_model(model)
        if pre is not None:
            w.add_tokenizer_pre(pre)
    w.add_pad_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file):
        step()
    w.close()
    return ModelSource("gguf", str(path.parent), path.name)


@pytest.fixture(scope="module")
def originals():
    return {case: train(SPLITS[split]()) for case, (_, _, split) in CASES.items()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_files_tokenizer_encodes_and_decodes_as_the_original(tmp_path, originals, case):
    arch, pre, _ = CASES[case]
    ref = originals[case]
    tok = load_tokenizer(write_tokenizer_gguf(tmp_path / "t.gguf", arch, ref, pre))
    assert len(tok) == ref.get_vocab_size()
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok.chat_template == CHAT_TEMPLATE
    for text in TEXTS + CORPUS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids == ref.encode(text, add_special_tokens=False).ids, text
        assert tok.decode(ids) == ref.decode(ids) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi 42"}], add_generation_prompt=True)
    ids = chat["input_ids"] if hasattr(chat, "keys") else chat
    assert ids == ref.encode("<|im_start|>user\nhi 42<|im_end|>\n<|im_start|>assistant\n").ids
    assert ids[0] == 1 and ids.count(2) == 1  # the specials stay whole
    artifact = Tokenizer.from_str(tok.backend_tokenizer.to_str())  # what an artifact ships
    assert all(artifact.encode(t, add_special_tokens=False).ids == ref.encode(t).ids for t in TEXTS)


# (a case's split, another split) reading its vocabulary the same on these texts: a vocabulary
# learned on the finer pieces (single digits; tekken's case-split words) has no merge the coarser
# split's pieces would use
SAME_READING = {("smollm", "gpt2"), ("qwen2", "llama3"), ("tekken", "qwen35")}
PRE_NAMES = {
    "gpt2": "gpt-2",
    "smollm": "smollm",
    "llama3": "llama3",
    "qwen2": "qwen2",
    "qwen35": "qwen35",
    "tekken": "tekken",
}


def test_a_wrong_pre_tokenizer_name_gives_other_tokens(tmp_path, originals):
    """Each case's file under every other split's name gives other tokens for some text (but the
    pairs in SAME_READING): the parity above fails on a wrong name-to-split mapping."""
    for case, (arch, _, split) in CASES.items():
        ref = originals[case]
        want = [ref.encode(t).ids for t in TEXTS + CORPUS]
        for other, pre in PRE_NAMES.items():
            if other == split or (split, other) in SAME_READING:
                continue
            tok = load_tokenizer(write_tokenizer_gguf(tmp_path / f"{case}-{other}.gguf", arch, ref, pre))
            got = [tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS + CORPUS]
            assert got != want, (case, pre)


def test_a_sentencepiece_file_ignores_the_pre_name(tmp_path):
    """tokenizer.ggml.model "llama": the vocabulary's own scores order the merges, "▁" marks a
    space and starts the text, BOS is added (llama.cpp's SentencePiece defaults)."""
    toks = [
        "<unk>",
        "<s>",
        "</s>",
        *(f"<0x{i:02X}>" for i in range(256)),
        "▁",
        "h",
        "i",
        "a",
        "b",
        "▁h",
        "▁hi",
        "▁a",
        "▁ab",
    ]
    w = GGUFWriter(str(tmp_path / "s.gguf"), "qwen35")
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(toks)
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * 9)
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(9)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file):
        step()
    w.close()
    tok = load_tokenizer(ModelSource("gguf", str(tmp_path), "s.gguf"))
    assert tok("hi ab")["input_ids"] == [1, toks.index("▁hi"), toks.index("▁ab")]
    assert tok("h\n")["input_ids"] == [1, toks.index("▁h"), toks.index("<0x0A>")]


@pytest.mark.parametrize(
    "model, pre, message",
    [
        ("gpt2", None, "tokenizer.ggml.pre None of .* names no pre-tokenizer read here"),
        ("gpt2", "default", "tokenizer.ggml.pre 'default' of .* names no pre-tokenizer read here"),
        ("gpt2", "not-a-pre", r"tokenizer.ggml.pre 'not-a-pre' of .*expected one of: .*qwen35"),
        (
            "rwkv",
            "default",
            r"tokenizer.ggml.model 'rwkv' of .* is not supported \(expected one of \('gpt2', 'llama'\)\)",
        ),
    ],
    ids=["no-pre", "default", "unknown-pre", "unknown-model"],
)
def test_a_tokenizer_not_read_here_is_refused_in_one_line(tmp_path, originals, model, pre, message):
    source = write_tokenizer_gguf(tmp_path / "t.gguf", "nemotron_h", originals["nemotron_h"], pre, model=model)
    with pytest.raises(ModelSourceError, match=message) as info:
        load_tokenizer(source)
    assert "\n" not in str(info.value)


def test_a_file_without_a_tokenizer_is_refused_in_one_line(tmp_path):
    w = GGUFWriter(str(tmp_path / "n.gguf"), "lfm2")
    w.add_uint32("lfm2.block_count", 1)
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file):
        step()
    w.close()
    with pytest.raises(ModelSourceError, match="has no tokenizer.ggml.tokens") as info:
        load_tokenizer(ModelSource("gguf", str(tmp_path), "n.gguf"))
    assert "\n" not in str(info.value)


# --------------------------------------------------------------------------- a build from a hybrid GGUF


def _with_tokenizer(src, dst, tok: Tokenizer, pre: str):
    """A copy of the GGUF file at src (metadata and tensors as they are) with `tok`'s metadata."""
    import numpy as np
    from gguf import GGUFReader

    reader = GGUFReader(src)
    arch = reader.get_field("general.architecture").contents()
    w = GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name.startswith(f"{arch}."):
            sub = field.types[-1] if len(field.types) > 1 else None
            w.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    _tokenizer(w, _fast(tok), pre=pre)
    w.add_pad_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for t in reader.tensors:
        shape = [int(n) for n in reversed(t.shape.tolist())]
        w.add_tensor(t.name, np.array(t.data).reshape(shape), raw_dtype=t.tensor_type)
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file):
        step()
    w.close()
    return dst


NEW = 16  # generated tokens


def test_a_qwen35_gguf_with_its_tokenizer_builds_and_decodes_as_transformers(tmp_path):
    """`specexport build` (the library function, unvalidated) of a tiny Qwen3.5 GGUF (F32, tokenizer
    metadata with the qwen35 split):
    the artifact's tokenizer encodes as the original, and its greedy output, with and without
    n-gram speculation, equals the original transformers model's greedy output."""
    import torch
    from test_gguf_qwen35 import _model, write_qwen35_gguf
    from tiny import write_recipe

    from specexport.build.artifact import build_artifact
    from specexport.recipe.load import load_recipe
    from specexport_runtime.api import load

    model = _model()
    write_qwen35_gguf(model, tmp_path / "w.gguf")
    ref = train(SPLITS["qwen35"](), vocab_size=300)  # within the model's 320 embedding rows
    path = _with_tokenizer(tmp_path / "w.gguf", tmp_path / "m.gguf", ref, "qwen35")
    draft = {"proposer": "ngram", "ngram_sizes": [3, 2, 1]}
    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", path, draft, graph="fused", max_context=128))
    build_artifact(recipe, tmp_path / "a", validate=False)
    shipped = Tokenizer.from_file(str(tmp_path / "a" / "tokenizer.json"))
    assert all(shipped.encode(t).ids == ref.encode(t).ids for t in TEXTS)
    ids = ref.encode("def add(a, b):\n    return a + b  # 12345 ").ids
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False, eos_token_id=2, pad_token_id=0)
    want = out[0, len(ids) :].tolist()
    want = want[: want.index(2)] if 2 in want else want
    assert len(want) >= 4  # a few tokens before any end of sequence
    gen = load(tmp_path / "a")
    assert list(gen.generate(ids, max_new_tokens=NEW, speculative=False).token_ids) == want
    assert list(gen.generate(ids, max_new_tokens=NEW, proposer="ngram", gamma=4).token_ids) == want


@pytest.mark.real
@pytest.mark.slow  # ~9 s; the arch/pre pairs above keep the file-tokenizer check in the default run
def test_the_default_models_tokens_are_those_of_transformers_gguf_loader():
    """SmolLM2-135M-Instruct's GGUF (llama, pre 'smollm'): the same tokens, specials and chat
    template as transformers' AutoTokenizer reading the same file (whose split lacks llama.cpp's
    digit split: this vocabulary has no token of two digits, so both read it alike)."""
    from transformers import AutoTokenizer

    from specexport.models.sources import DEFAULT_MODEL, resolve_source

    try:
        source = resolve_source(DEFAULT_MODEL)
    except ModelSourceError as exc:
        pytest.skip(f"default model unavailable: {exc}")
    ours = load_tokenizer(source)
    theirs = AutoTokenizer.from_pretrained(source.location, gguf_file=source.gguf_file)
    assert len(ours) == len(theirs) == 49152
    assert ours.special_tokens_map == theirs.special_tokens_map and ours.chat_template == theirs.chat_template
    for text in TEXTS + CORPUS + ["<|im_start|>user\nWrite 2048 lines<|im_end|>\n"]:
        for special in (True, False):
            ids = ours(text, add_special_tokens=special)["input_ids"]
            assert ids == theirs(text, add_special_tokens=special)["input_ids"], text
            assert ours.decode(ids) == theirs.decode(ids)
