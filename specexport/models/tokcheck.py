"""Tokenizer compatibility of a target/draft pair.

Speculative decoding hands draft token ids to the target, so both models must give every id the
same meaning. `check_pair` compares the two tokenizers piece by piece (model type and options,
vocabulary, merges, special and added tokens, normalizer, pre-tokenizer, the ids of a set of probe
texts) and the two models' embedding row counts, and returns a `CompatReport`:

    report = check_pair(target_tok, draft_tok, target_rows=152064, draft_rows=151936)
    report.compatible, report.pad_rows      # True, 128
    report.raise_if_incompatible()          # TokenizerMismatch with report.summary()

Tokenizers are `transformers.PreTrainedTokenizerFast` objects (anything with `.backend_tokenizer`);
a bare `tokenizers.Tokenizer` is accepted too, in which case the BOS/EOS/UNK/PAD roles, which live
in the transformers wrapper, are not compared.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import InvalidArgument, TokenizerMismatch

if TYPE_CHECKING:  # importing transformers is slow; only the type is needed
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

__all__ = ["CHECKS", "DEFAULT_PROBES", "MAX_ROW_DIFFERENCE", "CompatReport", "check_pair", "tokenizer_hash"]

MAX_ROW_DIFFERENCE = 128  # embedding rows may differ by this much when the shared ids agree
MAX_SHOWN = 5  # detail lines per check
_SHOW_CHARS = 120

# Checks in report order; "special_tokens" and "embedding_rows" appear only when they can be run.
CHECKS = (
    "model_type",
    "model_options",
    "vocab",
    "merges",
    "special_tokens",
    "added_tokens",
    "normalizer",
    "pre_tokenizer",
    "probes",
    "embedding_rows",
)
_BLOCKING_SPECIALS = ("bos", "eos", "unk")
_RUNTIME_STATE = ("truncation", "padding")  # per-call settings, not part of the tokenizer's identity

DEFAULT_PROBES: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    '{"id": 42, "tags": ["a", "b"], "ok": true, "ratio": -0.125}',
    "Prices: $1,299.99 vs €1.049,50 — 3.14159e-10, 0x1F, 2024-06-30 17:45:03",
    "Naïve café façade: Straße, Ångström, İstanbul, ǅ, ﬁ ligature",
    "日本語のテキスト、中文文本、한국어 텍스트, Ελληνικά, русский, العربية, עברית, हिन्दी",
    "emoji: 🙂👍🏽 👨‍👩‍👧‍👦 🇯🇵 ❤️ 🧑🏿‍🚀",
    "tabs\tand  double  spaces,   triple,\n\n\nnewlines and trailing spaces   ",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "[INST] <<SYS>>\nBe brief.\n<</SYS>>\nWhat is 2+2? [/INST] 4 </s><s>",
    "SELECT name, COUNT(*) FROM users WHERE age >= 18 GROUP BY name; -- ok",
    "x = a[i][j] ** 2 // 3 != b; y <<= 1; z = {k: v for k, v in d.items()}",
    "   leading spaces, CamelCaseIdentifiers, snake_case_names, ALLCAPS, http://example.com/a?b=c#d",
)


# --------------------------------------------------------------------------- report


@dataclass
class CompatReport:
    """Outcome of `check_pair`. `differences` lists human lines, most important (lowest id) first."""

    compatible: bool
    differences: list[str] = field(default_factory=list)
    pad_rows: int = 0  # rows to append to the smaller model's distribution (see target_rows/draft_rows)
    checks: dict[str, bool] = field(default_factory=dict)  # check name -> passed
    warnings: list[str] = field(default_factory=list)  # non-blocking findings (PAD, decoder, ...)
    target_rows: int | None = None
    draft_rows: int | None = None
    target_hash: str = ""
    draft_hash: str = ""

    @property
    def failed(self) -> list[str]:
        return [name for name, ok in self.checks.items() if not ok]

    @property
    def padded_side(self) -> str | None:
        """ "draft" or "target": the model whose distribution is padded by pad_rows; None when 0."""
        if not self.pad_rows or self.target_rows is None or self.draft_rows is None:
            return None
        return "draft" if self.draft_rows < self.target_rows else "target"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["failed"] = self.failed
        data["padded_side"] = self.padded_side
        return data

    def summary(self, max_lines: int = 20) -> str:
        passed = sum(self.checks.values())
        if self.compatible:
            head = f"tokenizers compatible: {passed}/{len(self.checks)} checks passed"
            if self.pad_rows:
                head += f"; the {self.padded_side} distribution is padded by {self.pad_rows} rows"
        else:
            head = (
                f"tokenizers incompatible: {len(self.failed)} of {len(self.checks)} checks failed"
                f" ({', '.join(self.failed)})"
            )
        lines = [head]
        body = [f"  {line}" for line in self.differences] + [f"  warning: {line}" for line in self.warnings]
        lines += body[:max_lines]
        if len(body) > max_lines:
            lines.append(f"  ... {len(body) - max_lines} more lines")
        return "\n".join(lines)

    def raise_if_incompatible(self) -> None:
        if not self.compatible:
            raise TokenizerMismatch(self.summary())


# --------------------------------------------------------------------------- helpers


def _backend(tok: Any) -> Tokenizer:
    backend = getattr(tok, "backend_tokenizer", tok)
    if not hasattr(backend, "to_str") or not hasattr(backend, "encode"):
        raise InvalidArgument(
            f"expected a transformers PreTrainedTokenizerFast or a tokenizers.Tokenizer, got {type(tok).__name__}"
        )
    return backend


def _tokenizer_json(tok: Any) -> dict[str, Any]:
    data = json.loads(_backend(tok).to_str())
    for key in _RUNTIME_STATE:
        data.pop(key, None)
    return data


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def tokenizer_hash(tok: PreTrainedTokenizerFast | Tokenizer) -> str:
    """sha256 (hex) of the backend tokenizer's canonical JSON (sorted keys; truncation/padding state left out)."""
    return _json_hash(_tokenizer_json(tok))


def _json_hash(data: dict[str, Any]) -> str:
    return hashlib.sha256(_canonical(data).encode("utf-8")).hexdigest()


def _short(value: Any) -> str:
    text = value if isinstance(value, str) and value.startswith(("{", "[")) else repr(value)
    return text if len(text) <= _SHOW_CHARS else text[: _SHOW_CHARS - 3] + "..."


def _first_json_difference(a: Any, b: Any, path: str = "") -> tuple[str, Any, Any] | None:
    """The first (path, a-part, b-part) where two JSON values differ, or None when equal."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            sub = f"{path}.{key}" if path else str(key)
            if key not in a or key not in b:
                return sub, a.get(key, "(absent)"), b.get(key, "(absent)")
            found = _first_json_difference(a[key], b[key], sub)
            if found:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list):
        for i, (x, y) in enumerate(zip(a, b)):
            found = _first_json_difference(x, y, f"{path}[{i}]")
            if found:
                return found
        if len(a) != len(b):
            return f"{path} length", len(a), len(b)
        return None
    if a != b or type(a) is not type(b):
        return path or "(whole)", a, b
    return None


def _vocab_by_id(model: dict[str, Any]) -> tuple[dict[int, str], dict[int, float]]:
    """id -> token text (and id -> score for Unigram) from a tokenizer JSON `model` section."""
    vocab = model.get("vocab") or {}
    if isinstance(vocab, list):  # Unigram: [[piece, score], ...], id = position
        return {i: entry[0] for i, entry in enumerate(vocab)}, {i: entry[1] for i, entry in enumerate(vocab)}
    return {int(i): t for t, i in vocab.items()}, {}


# options whose "unset" spellings differ between converters (GGUF-loaded tokenizers write "" and
# tokenizer.json files write null) without changing how text is split
_EMPTY_MEANS_UNSET = {"continuing_subword_prefix": "", "end_of_word_suffix": "", "dropout": 0.0}


def _model_options(model: dict[str, Any]) -> dict[str, Any]:
    options = {k: v for k, v in model.items() if k not in ("type", "vocab", "merges")}
    for key, empty in _EMPTY_MEANS_UNSET.items():
        if key in options and options[key] == empty:
            options[key] = None
    return options


def _merges(model: dict[str, Any]) -> list[tuple[str, ...]]:
    out = []
    for merge in model.get("merges") or []:
        out.append(tuple(merge.split(" ", 1)) if isinstance(merge, str) else tuple(merge))
    return out


def _added_by_id(data: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {int(entry["id"]): {k: v for k, v in entry.items() if k != "id"} for entry in data.get("added_tokens", [])}


def _full_id_map(data: dict[str, Any]) -> dict[int, str]:
    ids, _ = _vocab_by_id(data.get("model", {}))
    for i, entry in _added_by_id(data).items():
        ids[i] = entry.get("content")
    return ids


def _encoder(tok: Any) -> Tokenizer:
    """The backend tokenizer, cloned without truncation/padding when a caller left them switched on."""
    backend = _backend(tok)
    if getattr(backend, "truncation", None) or getattr(backend, "padding", None):
        from tokenizers import Tokenizer

        backend = Tokenizer.from_str(backend.to_str())
        backend.no_truncation()
        backend.no_padding()
    return backend


_ABSENT = object()


class _Collector:
    def __init__(self) -> None:
        self.checks: dict[str, bool] = {}
        self.differences: list[str] = []
        self.warnings: list[str] = []

    def record(self, name: str, lines: list[str]) -> None:
        self.checks[name] = self.checks.get(name, True) and not lines
        self.differences.extend(lines)


def _diff_maps(name: str, a: dict[int, Any], b: dict[int, Any], unit: str, fmt=_short) -> list[str]:
    keys = sorted(set(a) | set(b))
    diff = [k for k in keys if a.get(k, _ABSENT) != b.get(k, _ABSENT)]
    if not diff:
        return []
    lines = [f"{name}: {len(diff)} of {len(keys)} {unit}s differ (target has {len(a)}, draft has {len(b)})"]
    for k in diff[:MAX_SHOWN]:
        t = fmt(a[k]) if k in a else "(absent)"
        d = fmt(b[k]) if k in b else "(absent)"
        lines.append(f"{name} {unit} {k}: target {t} vs draft {d}")
    if len(diff) > MAX_SHOWN:
        lines.append(f"{name}: ... {len(diff) - MAX_SHOWN} more")
    return lines


def _json_section(name: str, a: Any, b: Any) -> list[str]:
    found = _first_json_difference(a, b)
    if found is None:
        return []
    path, x, y = found
    whole = f"{name}: target {_short(_canonical(a))} vs draft {_short(_canonical(b))}"
    if path == "(whole)":
        return [whole]
    return [f"{name} differs at {path}: target {_short(x)} vs draft {_short(y)}", whole]


def _special(tok: Any, role: str) -> tuple[str | None, int | None] | None:
    if not hasattr(tok, f"{role}_token"):
        return None
    text = getattr(tok, f"{role}_token", None)
    ident = getattr(tok, f"{role}_token_id", None) if text is not None else None
    return (None if text is None else str(text)), ident


def _stops_on(tok: Any, ident: int | None) -> bool:
    """Whether an artifact's tokenizer (`stop_token_ids`) ends generation on `ident`."""
    return ident is not None and ident in (getattr(tok, "stop_token_ids", None) or ())


def _fmt_special(value: tuple[str | None, int | None]) -> str:
    text, ident = value
    return "none" if text is None else f"{text!r} (id {ident})"


# --------------------------------------------------------------------------- the check


def check_pair(
    target_tok: PreTrainedTokenizerFast,
    draft_tok: PreTrainedTokenizerFast,
    target_rows: int | None = None,
    draft_rows: int | None = None,
    probe_texts: tuple[str, ...] | list[str] = DEFAULT_PROBES,
) -> CompatReport:
    """Compare two tokenizers (and optionally the models' embedding row counts); never raises on a mismatch."""
    for label, rows in (("target_rows", target_rows), ("draft_rows", draft_rows)):
        if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
            raise InvalidArgument(f"{label} = {rows!r}; expected a positive integer (the model's embedding rows)")
    t_json, d_json = _tokenizer_json(target_tok), _tokenizer_json(draft_tok)
    out = _Collector()
    _compare_models(out, t_json.get("model") or {}, d_json.get("model") or {})
    _compare_specials(out, target_tok, draft_tok)
    _compare_pipeline(out, t_json, d_json)
    out.record("probes", _probe_differences(_encoder(target_tok), _encoder(draft_tok), probe_texts))
    pad_rows = 0
    if target_rows is not None or draft_rows is not None:
        lines, pad_rows = _compare_rows(_full_id_map(t_json), _full_id_map(d_json), target_rows, draft_rows)
        out.record("embedding_rows", lines)
    return CompatReport(
        compatible=all(out.checks.values()),
        differences=out.differences,
        pad_rows=pad_rows,
        checks=out.checks,
        warnings=out.warnings,
        target_rows=target_rows,
        draft_rows=draft_rows,
        target_hash=_json_hash(t_json),
        draft_hash=_json_hash(d_json),
    )


def _compare_models(out: _Collector, t_model: dict[str, Any], d_model: dict[str, Any]) -> None:
    """Model type and options (dropout, byte_fallback, unk_token, ...), the vocabulary (id -> token
    text), Unigram scores and merges (rank -> pair)."""
    t_type, d_type = t_model.get("type"), d_model.get("type")
    out.record("model_type", [] if t_type == d_type else [f"model_type: target {t_type!r} vs draft {d_type!r}"])
    out.record("model_options", _json_section("model_options", _model_options(t_model), _model_options(d_model)))
    t_vocab, t_scores = _vocab_by_id(t_model)
    d_vocab, d_scores = _vocab_by_id(d_model)
    out.record(
        "vocab", _diff_maps("vocab", t_vocab, d_vocab, "id") + _diff_maps("vocab score", t_scores, d_scores, "id")
    )
    out.record(
        "merges",
        _diff_maps(
            "merges",
            dict(enumerate(_merges(t_model))),
            dict(enumerate(_merges(d_model))),
            "rank",
            fmt=lambda pair: repr(" ".join(pair)),
        ),
    )


def _compare_specials(out: _Collector, target_tok: Any, draft_tok: Any) -> None:
    """Special token roles known on both sides: BOS/EOS/UNK block, PAD warns. A bare
    tokenizers.Tokenizer has none; a built artifact's (`stop_token_ids`: the eos ids it stops on)
    has BOS and EOS, and its EOS agrees with an EOS id among those."""
    specials = {role: (_special(target_tok, role), _special(draft_tok, role)) for role in (*_BLOCKING_SPECIALS, "pad")}
    known = {role: pair for role, pair in specials.items() if None not in pair}
    if not known:
        out.warnings.append("special tokens (BOS/EOS/UNK/PAD) not compared: a bare tokenizers.Tokenizer was given")
        return
    if len(known) < len(specials):
        missing = "/".join(role.upper() for role in specials if role not in known)
        out.warnings.append(f"special tokens {missing} not compared: not known on both sides (an artifact has BOS/EOS)")
    lines = []
    for role, (t, d) in known.items():
        if t == d or (role == "eos" and (_stops_on(target_tok, d[1]) or _stops_on(draft_tok, t[1]))):
            continue
        line = f"{role}_token: target {_fmt_special(t)} vs draft {_fmt_special(d)}"
        if role in _BLOCKING_SPECIALS:
            lines.append(f"special_tokens {line}")
        else:  # PAD never reaches the models during decoding
            out.warnings.append(f"{line} (PAD is not used in decoding)")
    out.record("special_tokens", lines)


def _compare_pipeline(out: _Collector, t_json: dict[str, Any], d_json: dict[str, Any]) -> None:
    """Added tokens (id -> content and matching flags), normalizer and pre-tokenizer (which ids a
    text maps to); post-processor and decoder only warn: the artifact ships the target's."""
    out.record("added_tokens", _diff_maps("added_tokens", _added_by_id(t_json), _added_by_id(d_json), "id"))
    out.record("normalizer", _json_section("normalizer", t_json.get("normalizer"), d_json.get("normalizer")))
    out.record(
        "pre_tokenizer", _json_section("pre_tokenizer", t_json.get("pre_tokenizer"), d_json.get("pre_tokenizer"))
    )
    for section in ("post_processor", "decoder"):
        for line in _json_section(section, t_json.get(section), d_json.get(section))[:1]:
            out.warnings.append(f"{line} (the artifact uses the target's)")


def _probe_differences(t_enc: Tokenizer, d_enc: Tokenizer, probe_texts) -> list[str]:
    """The probe texts both tokenizers encode differently (the first MAX_SHOWN, where they part)."""
    lines, bad = [], 0
    for index, text in enumerate(probe_texts):
        a = t_enc.encode(text, add_special_tokens=False).ids
        b = d_enc.encode(text, add_special_tokens=False).ids
        if a == b:
            continue
        bad += 1
        if bad > MAX_SHOWN:
            continue
        pos = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        ta = f"{a[pos]} ({t_enc.id_to_token(a[pos])!r})" if pos < len(a) else "(end)"
        db = f"{b[pos]} ({d_enc.id_to_token(b[pos])!r})" if pos < len(b) else "(end)"
        lines.append(
            f"probes #{index} {_short(text[:40])}: first difference at token {pos}: target {ta} vs draft {db}"
            f" ({len(a)} vs {len(b)} tokens)"
        )
    if bad:
        lines.insert(0, f"probes: {bad} of {len(probe_texts)} probe texts encode differently")
    return lines


def _compare_rows(
    t_ids: dict[int, str], d_ids: dict[int, str], target_rows: int | None, draft_rows: int | None
) -> tuple[list[str], int]:
    """(differences, draft rows to pad): each model's embedding covers its tokenizer's ids; rows
    that differ by at most MAX_ROW_DIFFERENCE are padded when the shared ids' texts agree."""
    lines = []
    for label, rows, ids in (("target", target_rows, t_ids), ("draft", draft_rows, d_ids)):
        if rows is not None and ids and rows <= max(ids):
            lines.append(
                f"embedding_rows: the {label} model has {rows} rows but its tokenizer uses ids up to {max(ids)}"
            )
    if target_rows is None or draft_rows is None or lines:
        return lines, 0
    gap = abs(target_rows - draft_rows)
    if gap > MAX_ROW_DIFFERENCE:
        return [
            f"embedding_rows: target {target_rows} vs draft {draft_rows} differ by {gap}"
            f" (at most {MAX_ROW_DIFFERENCE} can be padded)"
        ], 0
    shared = min(target_rows, draft_rows)
    wrong = [i for i in sorted(set(t_ids) | set(d_ids)) if i < shared and t_ids.get(i) != d_ids.get(i)]
    if gap and wrong:
        return [
            f"embedding_rows: target {target_rows} vs draft {draft_rows} could be padded, but"
            f" {len(wrong)} shared ids have different token text (first: id {wrong[0]})"
        ], 0
    return [], gap
