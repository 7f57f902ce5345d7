"""Streaming, incremental detokenization, stop strings, EOS and chat()."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specexport_runtime.api import load
from specexport_runtime.config import GeneratorConfig
from specexport_runtime.generator import GenerationStats, StopText, run_generation
from specexport_runtime.tokenizer import REPLACEMENT, IncrementalDecoder, TextCodec

MULTIBYTE = "héllo wörld — 😀 ñ 中文! café 👍🏽 ok"


@pytest.fixture(scope="module")
def codec(gens) -> TextCodec:
    return gens("self").codec


# ------------------------------------------------------------------ stream == generate


@pytest.mark.parametrize(
    "kind, prompt, kwargs",
    [
        ("self", "def add(a, b):", {}),
        ("noisy", "The quick brown fox", {"gamma": 3}),
        ("noisy", [40, 41, 42, 43, 44], {"speculative": False}),
        ("noisy", "The quick brown fox", {"temperature": 0.9, "seed": 7, "gamma": 2}),
        ("int8", "for i in range(10):", {"temperature": 1.0, "top_k": 30, "top_p": 0.9, "seed": 3, "gamma": 4}),
        ("ngram", [40, 41, 42, 43] * 3, {}),
    ],
    ids=["self", "noisy-gamma3", "target-only-ids", "sampled", "topk-topp", "ngram"],
)
def test_stream_joins_to_generate_text(gens, kind, prompt, kwargs):
    """(Sampled cases use a fixed gamma: with adaptive gamma a seed does not fix the output,
    see test_sampling_law.test_seeded_sampling_reproducible_with_adaptive_gamma.)"""
    gen = gens(kind)
    result = gen.generate(prompt, max_new_tokens=60, **kwargs)
    run = gen.events(prompt, max_new_tokens=60, **kwargs)
    pieces = list(run.pieces())
    assert run.stats.new_tokens == len(result.token_ids)
    assert "".join(gen.stream(prompt, max_new_tokens=60, **kwargs)) == "".join(pieces)
    assert "".join(pieces) == result.text
    assert result.text == gen.codec.decode(result.token_ids)  # incremental == one-shot decode
    assert all(pieces), "stream yielded an empty piece"
    assert len(pieces) > 1 or len(result.token_ids) < 5


def test_generated_pieces_never_split_a_character(gens):
    """Over many generations of the random tiny models (which emit byte tokens freely): a piece
    holds U+FFFD only where the one-shot decode of the whole output holds one at that place."""
    gen = gens("noisy")
    checked = 0
    for seed in range(12):
        pieces = list(gen.stream([5, 130, 105, 223, 161], max_new_tokens=40, temperature=1.0, seed=seed, gamma=3))
        tokens = gen.generate([5, 130, 105, 223, 161], max_new_tokens=40, temperature=1.0, seed=seed, gamma=3).token_ids
        full = gen.codec.decode(tokens)
        assert "".join(pieces) == full
        pos = 0
        for piece in pieces:
            assert full[pos : pos + len(piece)] == piece
            pos += len(piece)
            checked += 1
    assert checked > 50


# ------------------------------------------------------------------ IncrementalDecoder


def decode_pieces(codec, chunks) -> list[str]:
    dec = IncrementalDecoder(codec)
    return [dec.push(c) for c in chunks] + [dec.flush()]


def test_incremental_decoder_one_token_at_a_time(codec):
    ids = codec.encode(MULTIBYTE)
    assert len(ids) > len(MULTIBYTE.encode("utf-8")) // 2  # byte tokens: characters span several ids
    assert codec.decode(ids) == MULTIBYTE
    pieces = decode_pieces(codec, [[t] for t in ids])
    assert "".join(pieces) == MULTIBYTE
    assert not any(REPLACEMENT in p for p in pieces)
    # some ids completed nothing (the first bytes of a character): those pushes returned ''
    assert pieces.count("") > 0
    assert "😀" in pieces and "中" in pieces


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_incremental_decoder_any_chunking(codec, data):
    text = data.draw(st.text(alphabet=st.sampled_from(list("ab cdé😀中ñ—\n")), min_size=1, max_size=30))
    ids = codec.encode(text)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(ids)), max_size=8)))
    chunks = [ids[a:b] for a, b in zip([0] + cuts, cuts + [len(ids)])]
    pieces = decode_pieces(codec, chunks)
    assert "".join(pieces) == codec.decode(ids) == text
    assert not any(REPLACEMENT in p for p in pieces)


def test_incremental_decoder_invalid_bytes_are_not_lost(codec):
    """A lone UTF-8 lead byte followed by ASCII (or left at the end) decodes to U+FFFD in the
    one-shot decode; the pieces must reproduce that, not drop or duplicate it."""
    lead = codec.encode("é")[0]  # the first byte of é only
    assert codec.decode([lead]) == REPLACEMENT
    ids = codec.encode("ab") + [lead] + codec.encode("cd") + [lead]
    pieces = decode_pieces(codec, [[t] for t in ids])
    assert "".join(pieces) == codec.decode(ids)
    assert pieces[-1] == codec.decode(ids)[-1:]  # the trailing lone byte appears only at flush


def test_incremental_decoder_metaspace_tokenizer(tmp_path):
    """Sentencepiece-style decoders drop the leading space of a sequence; the windowed decode
    must still keep the spaces between words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(
        ["hello world, the quick brown fox jumps over the lazy dog"] * 20,
        trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>"]),
    )
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    meta = TextCodec(path)
    text = "the lazy fox jumps over the brown dog"
    ids = meta.encode(text)
    full = meta.decode(ids)
    assert full.strip() == text
    for size in (1, 2, 3):
        pieces = decode_pieces(meta, [ids[i : i + size] for i in range(0, len(ids), size)])
        assert "".join(pieces) == full


# ------------------------------------------------------------------ StopText


def run_stop(stops, pieces) -> tuple[str, bool]:
    s = StopText(tuple(stops))
    out = []
    for piece in pieces:
        emitted, hit = s.push(piece)
        out.append(emitted)
        if hit:
            return "".join(out), True
    return "".join(out) + s.flush(), False


def test_stop_string_spanning_two_pieces():
    text, hit = run_stop(["STOP"], ["hello ST", "OP world"])
    assert hit and text == "hello "
    text, hit = run_stop(["<end>"], ["a<", "e", "n", "d", ">b"])
    assert hit and text == "a"
    text, hit = run_stop(["xyz"], ["abc", "def"])
    assert not hit and text == "abcdef"


def test_stop_text_never_emits_part_of_a_stop():
    s = StopText(("STOP",))
    emitted, hit = s.push("abcST")
    assert not hit and "S" not in emitted  # "ST" may start "STOP": held back
    emitted2, hit = s.push("x")
    assert not hit and emitted + emitted2 + s.flush() == "abcSTx"


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="abc ", max_size=40),
    stops=st.lists(st.text(alphabet="abc ", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=6),
)
def test_stop_text_cuts_at_first_completed_stop(text, stops, cuts):
    cuts = sorted(c for c in cuts if c <= len(text))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    # reference: the occurrence that completes first (ties: the longer stop), independent of pieces
    ends = [(text.find(s) + len(s), -len(s), text.find(s)) for s in stops if s in text]
    got, hit = run_stop(stops, pieces)
    if ends:
        assert hit and got == text[: min(ends)[2]]
    else:
        assert not hit and got == text


# ------------------------------------------------------------------ run_generation on a scripted loop


@dataclass
class ScriptedLoop:
    """Stands in for SpeculativeLoop: yields fixed rounds of token ids."""

    script: list[list[int]]
    stats: GenerationStats = field(default_factory=GenerationStats)

    def rounds(self, prompt, max_context):
        yield from (list(r) for r in self.script)


def scripted(codec, script, eos=frozenset({2}), max_new=100, stop=(), prompt=(5, 6), max_context=256):
    loop = ScriptedLoop(script)
    options = GeneratorConfig(max_new_tokens=max_new, stop=tuple(stop))
    events = list(run_generation(loop, codec, list(prompt), options, set(eos), max_context))
    tokens = [t for new, _, _ in events for t in new]
    text = "".join(piece for _, piece, _ in events)
    reasons = [r for _, _, r in events]
    assert all(r is None for r in reasons[:-1])
    return tokens, text, reasons[-1], events, loop.stats


def split_rounds(ids, sizes):
    out, i = [], 0
    for n in sizes:
        out.append(ids[i : i + n])
        i += n
    return out + ([ids[i:]] if i < len(ids) else [])


def test_run_generation_multibyte_rounds(codec):
    ids = codec.encode(MULTIBYTE)
    tokens, text, reason, events, stats = scripted(
        codec, split_rounds(ids, [1, 3, 2, 5, 1, 4, 2] * 5), max_new=len(ids)
    )
    assert tokens == ids and text == MULTIBYTE and reason == "length"
    assert not any(REPLACEMENT in piece for _, piece, _ in events)
    assert stats.new_tokens == len(ids) and len(stats.token_times) == len(ids)


def test_run_generation_eos_mid_round(codec):
    ids = codec.encode("abc def ghi")
    script = [ids[:2], ids[2:4] + [2] + ids[4:6], ids[6:]]
    tokens, text, reason, _, stats = scripted(codec, script)
    assert reason == "eos"
    assert tokens == ids[:4]  # the EOS and everything after it in the round are dropped
    assert text == codec.decode(ids[:4])
    assert stats.new_tokens == 4


def test_run_generation_eos_first_token(codec):
    tokens, text, reason, _, _ = scripted(codec, [[2, 70, 71], [72]])
    assert (tokens, text, reason) == ([], "", "eos")


def test_run_generation_max_new_tokens_mid_round(codec):
    ids = codec.encode("the quick brown fox jumps")
    tokens, text, reason, _, stats = scripted(codec, split_rounds(ids, [1, 4, 4, 4]), max_new=7)
    assert tokens == ids[:7] and reason == "length"
    assert text == codec.decode(ids[:7]) and stats.new_tokens == 7


def test_run_generation_context_limit(codec):
    ids = codec.encode("the quick brown fox jumps over")
    prompt = list(range(3, 3 + 250))
    tokens, _, reason, _, _ = scripted(codec, split_rounds(ids, [1, 3, 3, 3]), prompt=prompt, max_context=256)
    assert reason == "length"
    assert len(prompt) + len(tokens) >= 256


def test_run_generation_stop_across_rounds(codec):
    text_full = "alpha beta STOP gamma delta"
    ids = codec.encode(text_full)
    stop_tok = next(i for i in range(1, len(ids)) if codec.decode(ids[:i]).endswith("ST"))  # stop split across rounds
    script = split_rounds(ids, [1, stop_tok - 1, 2, 3, 50])
    tokens, text, reason, _, _ = scripted(codec, script, stop=["STOP"])
    assert reason == "stop" and text == "alpha beta "
    # without the stop string the whole text comes out
    _, text2, reason2, _, _ = scripted(codec, script, max_new=len(ids))
    assert text2 == text_full and reason2 == "length"


def test_run_generation_stop_wins_over_length_and_eos_text_kept(codec):
    ids = codec.encode("one two three")
    # the stop string completes in the last allowed round: 'stop', not 'length'
    tokens, text, reason, _, _ = scripted(codec, [ids], stop=["three"], max_new=len(ids))
    assert reason == "stop" and text == "one two "
    # the held-back tail is flushed at EOS
    tokens, text, reason, _, _ = scripted(codec, [ids + [2]], stop=["three!"])
    assert reason == "eos" and text == "one two three"


# ------------------------------------------------------------------ stop / EOS end to end


def test_stop_string_end_to_end(gens):
    gen = gens("self")
    prompt = "def add(a, b):"
    full = gen.generate(prompt, max_new_tokens=60)
    text = full.text
    # a stop string taken from the middle of the output (4 characters, no replacement char)
    start = next(i for i in range(len(text) // 3, len(text) - 4) if REPLACEMENT not in text[i : i + 4])
    stop = text[start : start + 4]
    cut = text.find(stop)
    for kwargs in ({}, {"gamma": 3}, {"speculative": False}):
        result = gen.generate(prompt, max_new_tokens=60, stop=stop, **kwargs)
        assert result.finish_reason == "stop"
        assert result.text == text[:cut]
        assert "".join(gen.stream(prompt, max_new_tokens=60, stop=[stop], **kwargs)) == text[:cut]
    # a stop string that never occurs changes nothing
    result = gen.generate(prompt, max_new_tokens=60, stop=["\x00never\x00"])
    assert (result.text, result.finish_reason, result.token_ids) == (text, "length", full.token_ids)


def test_eos_end_to_end(tiny_artifacts, gens, tmp_path):
    """Make a token the greedy output produces the artifact's EOS: generation stops right
    before it, in speculative (mid-round) and target-only mode alike."""
    base = gens("self").generate("The quick brown fox", max_new_tokens=40)
    ids = base.token_ids
    at = next(i for i in range(6, len(ids)) if ids[i] not in ids[:i])  # first occurrence, not at the start
    root = tmp_path / "artifact"
    shutil.copytree(tiny_artifacts["self"], root)
    manifest = json.loads((root / "manifest.json").read_text(encoding="utf-8"))
    manifest["tokenizer"]["eos_token_ids"] = [ids[at]]
    (root / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    gen = load(root)
    for kwargs in ({"gamma": 4}, {"gamma": 8}, {"speculative": False}, {}):
        result = gen.generate("The quick brown fox", max_new_tokens=40, **kwargs)
        assert result.finish_reason == "eos"
        assert result.token_ids == ids[:at]
        assert result.text == gen.codec.decode(ids[:at])
        assert "".join(gen.stream("The quick brown fox", max_new_tokens=40, **kwargs)) == result.text


# ------------------------------------------------------------------ chat


MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Add 2 and 3, café ☕"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "And 4?"},
]


def test_chat_template_rendering(tiny_artifacts, gens):
    import jinja2

    gen = gens("self")
    template = (tiny_artifacts["self"] / "chat_template.jinja").read_text(encoding="utf-8")
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    expected = env.from_string(template).render(messages=MESSAGES, add_generation_prompt=True)
    assert gen.codec.render_chat(MESSAGES) == expected
    assert expected.endswith("<|im_start|>assistant\n") and "café ☕" in expected
    no_prompt = env.from_string(template).render(messages=MESSAGES, add_generation_prompt=False)
    assert gen.codec.render_chat(MESSAGES, add_generation_prompt=False) == no_prompt


def test_chat_ids_match_transformers(tiny_artifacts, gens):
    """The runtime's chat encoding equals transformers' apply_chat_template on the same files."""
    from transformers import PreTrainedTokenizerFast

    root = tiny_artifacts["self"]
    hf = PreTrainedTokenizerFast(tokenizer_file=str(root / "tokenizer.json"))
    hf.chat_template = (root / "chat_template.jinja").read_text(encoding="utf-8")
    expected = hf.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    if isinstance(expected, dict) or hasattr(expected, "input_ids"):
        expected = expected["input_ids"]
    assert gens("self").codec.encode_chat(MESSAGES) == list(expected)
    # the special tokens are single ids, not spelled out byte by byte
    assert gens("self").codec.encode_chat(MESSAGES).count(1) == len(MESSAGES) + 1


@pytest.mark.parametrize("kind", ["self", "noisy", "ngram"])
def test_chat_generates_like_generate(gens, kind):
    gen = gens(kind)
    ids = gen.codec.encode_chat(MESSAGES)
    for n in (1, 9):
        result = gen.chat(MESSAGES, max_new_tokens=n)
        plain = gen.generate(ids, max_new_tokens=n, speculative=False)
        assert result.token_ids == plain.token_ids
        assert len(result.token_ids) == n and result.finish_reason == "length"
        assert result.stats.prompt_tokens == len(ids)
        assert "".join(gen.chat(MESSAGES, stream=True, max_new_tokens=n)) == result.text
