"""A GGUF file's tokenizer, built from its `tokenizer.ggml.*` metadata whatever the architecture.

llama.cpp's converter writes the tokenizer under the same keys for every architecture: the
vocabulary model (`tokenizer.ggml.model`: "gpt2" byte-level BPE, "llama" SentencePiece), the
tokens by id, their types (3 = control, 4 = user-defined), the BPE merges, the special ids, the
chat template, and for BPE the pre-tokenizer's name (`tokenizer.ggml.pre`), which llama.cpp maps to
a list of regular expressions (llama-vocab.cpp, llm_tokenizer_bpe). The tokenizer is built here by
transformers' own GGUF converters (integrations.gguf: the vocabulary, merges and added tokens; the
architecture only picks its SentencePiece variant for gemma* / phi3 files), and the BPE
pre-tokenizer from that name:

    PRE_SPLITS[name] -> the regular expressions llama.cpp applies in turn, each piece matched or
                        not kept as a piece (tokenizers' Split "isolated"), then the byte-level map

A vocabulary model other than gpt2 / llama, or a BPE file whose pre-tokenizer name is missing,
"default" (llama.cpp's fallback for a tokenizer its converter did not recognize) or not in
PRE_SPLITS, is refused in one line: the split decides the tokens, and a guessed one gives other
tokens than the model was trained on.
"""

from __future__ import annotations

from pathlib import Path

from .sources import ModelSourceError

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# llama.cpp pre-tokenizer names transformers' table (GGUF_PRE_TOKENIZER_SPLITS) lacks -> regexes
# (llama-vocab.cpp: LLAMA_VOCAB_PRE_TYPE_GPT2 and its kin; STARCODER / SMOLLM and kin split every
# digit first; STABLELM2 shares QWEN2's expression)
_EXTRA_SPLITS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(
        ("gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4", "gigachat", "mellum"),
        (_GPT2,),
    ),
    **dict.fromkeys(
        ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"), (r"\p{N}", _GPT2)
    ),
    "stablelm2": (_QWEN2,),
}
TOKENIZER_MODELS = ("gpt2", "llama")  # byte-level BPE, SentencePiece


def pre_splits() -> dict[str, tuple[str, ...]]:
    """Every BPE pre-tokenizer name read here -> its regexes, applied in turn."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    return {**{k: (v,) for k, v in GGUF_PRE_TOKENIZER_SPLITS.items()}, **_EXTRA_SPLITS}


def _pre_tokenizer(regexes: tuple[str, ...]):
    from tokenizers import Regex, pre_tokenizers

    steps = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
    return pre_tokenizers.Sequence([*steps, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def check_tokenizer(model: str | None, pre: str | None, where: str) -> tuple[str, ...] | None:
    """The BPE split of (tokenizer.ggml.model, tokenizer.ggml.pre), None for SentencePiece (its
    pre name is not read); ModelSourceError in one line for what is not read here."""
    if model not in TOKENIZER_MODELS:
        raise ModelSourceError(
            f"GGUF tokenizer.ggml.model {model!r} of {where!r} is not supported (expected one of {TOKENIZER_MODELS})"
        )
    if model == "llama":
        return None
    splits = pre_splits()
    if pre not in splits:
        raise ModelSourceError(
            f"GGUF tokenizer.ggml.pre {pre!r} of {where!r} names no pre-tokenizer read here"
            f" (expected one of: {', '.join(sorted(splits))})"
        )
    return splits[pre]


def load_gguf_tokenizer(path: str | Path):
    """The transformers fast tokenizer a GGUF file's metadata describes: special tokens, chat
    template and add-BOS flag from the file."""
    from transformers import TokenizersBackend
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    try:
        architecture, tokenizer_dict, config = get_gguf_tokenizer(str(path))
    except (KeyError, ValueError, OSError) as exc:  # no vocabulary, not a GGUF file
        raise ModelSourceError(f"could not read the tokenizer metadata of {str(path)!r}: {exc!r}") from exc
    if "tokens" not in tokenizer_dict:
        raise ModelSourceError(f"GGUF file {str(path)!r} has no tokenizer.ggml.tokens (no tokenizer in its metadata)")
    split = check_tokenizer(tokenizer_dict.get("tokenizer_type"), tokenizer_dict.get("pre_tokenizer_type"), str(path))
    backend, _ = convert_gguf_tokenizer(architecture, tokenizer_dict)
    if split is not None:
        backend.pre_tokenizer = _pre_tokenizer(split)
    backend = _file_tokens_only(backend, len(tokenizer_dict["tokens"]))
    return TokenizersBackend(tokenizer_object=backend, name_or_path=str(path), **config)


def _file_tokens_only(backend, n: int):
    """`backend` without the added tokens past the file's n tokens (transformers' byte-level
    builder adds its default "<|endoftext|>" to a vocabulary without one, at id n: one id more
    than the file, and the model, has)."""
    import json

    from tokenizers import Tokenizer

    data = json.loads(backend.to_str())
    kept = [t for t in data["added_tokens"] if t["id"] < n]
    if len(kept) == len(data["added_tokens"]):
        return backend
    data["added_tokens"] = kept
    return Tokenizer.from_str(json.dumps(data))
