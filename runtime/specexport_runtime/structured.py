"""Constrained decoding: grammars (JSON Schema, any JSON object, regex, Lark) turned into token
masks, forced tokens and draft validation by llguidance (the `structured` extra:
`pip install specexport-runtime[structured]`).

    grammar = Grammar.json_schema({"type": "object", ...})
    gen.generate(prompt, grammar=grammar)

Exactness with a constraint: the reference is constrained target-only decoding, the target's
distribution with the tokens the grammar forbids masked out and renormalised (greedy: the masked
argmax). A speculative round keeps it exactly (generator.py): every draft is cut at its first
forbidden token before the target sees it, the target's rows are masked with the grammar's state
after each drafted token, and rejection sampling runs on the masked distributions; the matcher
only ever advances over committed tokens. Tokens the grammar forces (a JSON object's known keys
and punctuation) are drafted for free.

A Matcher is one request's grammar state; a ConstraintEngine (one per artifact: the tokenizer
as llguidance needs it, built once) makes them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import InvalidArgument, SpecExportError
from .regex_size import schema_patterns, too_large

EXTRA = "structured"  # pip install specexport-runtime[structured]
GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "lark")
# JSON is written with fixed separators and no free whitespace, so the grammar forces every byte
# between values (keys, quotes, separators, brackets): '{"name": "Bob", "age": 42}'. A schema's
# own "x-guidance" options override these.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class StructuredUnavailable(SpecExportError):
    """A constrained request without the `structured` extra installed."""


class GrammarError(InvalidArgument):
    """A grammar that cannot be compiled (an invalid schema, an unsupported keyword, a bad regex)."""


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise StructuredUnavailable(
            "constrained decoding (grammar, response_format, tools) needs llguidance: pip install"
            f" 'specexport-runtime[{EXTRA}]'"
        ) from None
    return llguidance


@dataclass(frozen=True)
class Grammar:
    """What a constrained generation must match. Build with the class methods."""

    kind: str
    source: str  # the schema as canonical JSON, the regex or the Lark text
    strict: bool = True  # json_schema: refuse keywords llguidance does not implement (else ignore them)

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise GrammarError(f"grammar kind {self.kind!r} is not one of {', '.join(GRAMMAR_KINDS)}")
        if not isinstance(self.source, str):
            raise GrammarError(f"grammar source must be a string, got {type(self.source).__name__}")

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str, strict: bool = True) -> Grammar:
        """Output is one JSON value matching `schema` (a dict, or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise GrammarError(f"json_schema is not valid JSON: {exc.msg} at {exc.pos}") from None
        if not isinstance(schema, Mapping):
            raise GrammarError(f"json_schema must be a JSON object (a schema), got {type(schema).__name__}")
        for pattern in schema_patterns(schema):  # refused now, not after the prefill (regex_size.py)
            if (reason := too_large(pattern)) is not None:
                raise GrammarError(f"json_schema: {reason}")
        return cls("json_schema", json.dumps(schema), bool(strict))  # key order kept: properties follow it

    @classmethod
    def json_object(cls) -> Grammar:
        """Output is any JSON object (OpenAI's response_format json_object)."""
        return cls("json_object", json.dumps({"type": "object"}))

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        if not isinstance(pattern, str) or not pattern:
            raise GrammarError(f"regex must be a non-empty string, got {pattern!r}")
        if (reason := too_large(pattern)) is not None:
            raise GrammarError(reason)
        return cls("regex", pattern)

    @classmethod
    def lark(cls, text: str) -> Grammar:
        if not isinstance(text, str) or not text.strip():
            raise GrammarError(f"lark grammar must be a non-empty string, got {text!r}")
        return cls("lark", text)

    def compiled(self) -> str:
        """The grammar in llguidance's format."""
        llg = _llguidance()
        if self.kind in ("json_schema", "json_object"):
            options = dict(JSON_OPTIONS, lenient=not self.strict)
            try:
                return llg.LLMatcher.grammar_from_json_schema(self.source, defaults=options)
            except ValueError as exc:
                raise GrammarError(f"json_schema: {exc}") from None
        if self.kind == "regex":
            return llg.LLMatcher.grammar_from_regex(self.source)
        return llg.LLMatcher.grammar_from_lark(self.source)

    def check(self) -> Grammar:
        """self, or GrammarError (one line) when it does not compile; no tokenizer needed."""
        problem = _llguidance().LLMatcher.validate_grammar(self.compiled())
        if problem and not problem.startswith("WARNING"):
            raise GrammarError(f"{self.kind}: {' '.join(problem.split())[:300]}")
        return self

    def describe(self) -> str:
        text = self.source if len(self.source) <= 60 else self.source[:57] + "..."
        return f"{self.kind} {text}"


class ConstraintEngine:
    """llguidance's view of an artifact's tokenizer (built once: about a second for a large
    vocabulary) and its vocabulary size V (the target's embedding rows: mask rows are this wide)."""

    def __init__(self, tokenizer_json: str, vocab_rows: int, eos_ids: Sequence[int]):
        llg = _llguidance()
        self.vocab_rows, self.eos_ids = vocab_rows, frozenset(int(t) for t in eos_ids)
        self.tokenizer = llg.LLTokenizer(tokenizer_json, n_vocab=vocab_rows, eos_token=list(eos_ids))
        self._executor = llg.LLExecutor(1)

    def matcher(self, grammar: Grammar) -> Matcher:
        """A fresh matcher for one request; GrammarError (one line) if the grammar does not compile."""
        llg = _llguidance()
        compiled = grammar.compiled()
        problem = llg.LLMatcher.validate_grammar(compiled, self.tokenizer)
        if problem and not problem.startswith("WARNING"):
            raise GrammarError(f"{grammar.kind}: {' '.join(problem.split())[:300]}")
        inner = llg.LLMatcher(self.tokenizer, compiled, log_level=0)
        if inner.is_error():
            raise GrammarError(f"{grammar.kind}: {' '.join(inner.get_error().split())[:300]}")
        return Matcher(inner, self, grammar)


@dataclass
class Matcher:
    """One request's grammar state. It advances only over committed tokens (commit); masks of a
    draft's positions are computed without moving it."""

    inner: Any  # llguidance.LLMatcher
    engine: ConstraintEngine
    grammar: Grammar
    committed: int = 0  # tokens consumed
    _bits: np.ndarray = field(default=None, repr=False)  # int32 [rows, ceil(V / 32)] mask buffer

    def forced(self) -> list[int]:
        """Tokens the grammar forces from here (may be empty)."""
        return list(self.inner.compute_ff_tokens())

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` the grammar allows in a row from here."""
        return int(self.inner.validate_tokens(list(tokens))) if tokens else 0

    def masks(self, draft: Sequence[int]) -> np.ndarray:
        """bool [len(draft) + 1, V]: row i holds the tokens allowed after draft[:i] (every draft
        token must be allowed: valid_prefix(draft) == len(draft))."""
        from llguidance.numpy import fill_next_token_bitmask, fill_next_token_bitmask_par_with_draft_tokens

        rows, words = len(draft) + 1, (self.engine.vocab_rows + 31) // 32
        if self._bits is None or self._bits.shape[0] < rows:
            self._bits = np.empty((max(rows, 16), words), np.int32)
        bits = self._bits[:rows]
        if draft:
            fill_next_token_bitmask_par_with_draft_tokens(self.engine._executor, [(self.inner, 0, list(draft))], bits)
        else:
            fill_next_token_bitmask(self.inner, bits)
        allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, : self.engine.vocab_rows]
        return allowed.view(bool)  # 0/1 bytes read as bools, no copy

    def commit(self, tokens: Sequence[int]) -> None:
        """The tokens were emitted (accepted drafts and the target's own); they must be allowed.
        An end-of-sequence token after a complete match ends the output: it and whatever the
        same round emitted after it (never output) are not consumed."""
        tokens = list(tokens)
        end = next((i for i, t in enumerate(tokens) if t in self.engine.eos_ids), len(tokens))
        head = tokens[:end]
        if head and not self.inner.consume_tokens(head):
            raise GrammarError(f"the grammar refused committed tokens {head[:8]}: {self.inner.get_error()[:200]}")
        self.committed += len(head)
        if end < len(tokens) and not (self.inner.is_stopped() or self.inner.is_accepting()):
            raise GrammarError(f"the grammar refused end-of-sequence token {tokens[end]}: the match is incomplete")

    @property
    def accepting(self) -> bool:
        """The output so far is a complete match (EOS is allowed)."""
        return bool(self.inner.is_accepting())

    @property
    def stopped(self) -> bool:
        """No token but EOS can follow."""
        return bool(self.inner.is_stopped())


class Guide:
    """The grammar's part in the speculative loop (generator.SpeculativeLoop), for one request:
    forced tokens first, a proposer's draft cut at its first forbidden token, target rows masked
    as the grammar stands after each drafted token, the emitted tokens committed."""

    def __init__(self, matcher: Matcher):
        self.matcher = matcher

    def forced(self, limit: int) -> list[int]:
        """The tokens the grammar forces next, at most `limit`."""
        return self.matcher.forced()[: max(0, limit)] if limit > 0 else []

    def shape(self, proposal, forced: list[int], limit: int):
        """The round's draft, a proposers.Proposal: `forced` and then what the proposal drafted
        beyond it, or `forced` alone when the proposal leaves the forced run or drew its tokens
        from a distribution (q: choosing between it and the forced run would depend on the draw);
        then cut at the first token the grammar forbids, after an end of sequence, and at `limit`
        tokens. proposal: made on the committed tokens, or None. Under sampling the distribution of
        a token the grammar cut travels as cut_q (sampling.verify_sampled): it was drawn, so it
        counts as rejected."""
        from dataclasses import replace

        from .drafts import Proposal

        f = len(forced)
        if proposal is not None and (f == 0 or (proposal.q is None and list(proposal.tokens[:f]) == forced)):
            base, tokens, q = proposal, list(proposal.tokens[:limit]), proposal.q
        else:
            base, tokens, q = Proposal([], None, free=True, source="grammar"), list(forced[:limit]), None
        k = self.matcher.valid_prefix(tokens)  # nothing is valid after an end of sequence
        cut_q = q[k] if q is not None and k < len(tokens) else None
        return replace(
            base, tokens=tokens[:k], q=None if q is None else q[:k], forced=min(f, k), cut_q=cut_q, cut=len(tokens) - k
        )

    def allowed(self, draft: Sequence[int]) -> np.ndarray:
        """bool [V]: the tokens allowed after the committed tokens and `draft` (each allowed): a
        draft model masks its drafting with it (proposers.Proposer.constrain). Nothing follows an
        end of sequence."""
        if draft and draft[-1] in self.matcher.engine.eos_ids:
            return np.zeros(self.matcher.engine.vocab_rows, dtype=bool)
        return self.matcher.masks(draft)[-1]

    def masked(self, logits: np.ndarray, draft: Sequence[int]) -> np.ndarray:
        """logits [k+1, V'] of a call on [last, draft] with each row masked as the grammar stands
        after draft[:i]."""
        return apply_mask(logits, self.matcher.masks(draft))

    def commit(self, tokens: Sequence[int]) -> None:
        self.matcher.commit(tokens)


def apply_mask(logits: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """logits [R, V'] with the forbidden entries at -inf (V' >= V: rows past the grammar's
    vocabulary are forbidden too); a new array."""
    out = np.full(logits.shape, -np.inf, dtype=logits.dtype)
    width = min(allowed.shape[1], logits.shape[1])
    np.copyto(out[:, :width], logits[:, :width], where=allowed[: logits.shape[0], :width])
    return out


__all__ = [
    "EXTRA",
    "GRAMMAR_KINDS",
    "ConstraintEngine",
    "Grammar",
    "GrammarError",
    "Guide",
    "Matcher",
    "StructuredUnavailable",
    "apply_mask",
]
