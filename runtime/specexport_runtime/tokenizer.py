"""Tokenizer, chat template and incremental detokenizer, without transformers."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from .errors import InvalidArgument, PromptError

REPLACEMENT = "\ufffd"


def _raise(message: str):
    raise TemplateError(message)


class TextCodec:
    def __init__(
        self, tokenizer_file: Path, chat_template: str | None = None, bos: str | None = None, eos: str | None = None
    ):
        self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        self.bos_token, self.eos_token = bos, eos
        self._template = None
        # the template renders tool definitions itself (a `tools` variable): tools.ToolPlan.native
        self.reads_tools = bool(chat_template) and "tools" in chat_template
        if chat_template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            self._template = env.from_string(chat_template)

    def encode(self, text: str | bytes, add_special_tokens: bool = True) -> list[int]:
        if isinstance(text, bytes):
            try:
                text = text.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise PromptError(f"prompt is not valid UTF-8: {exc}") from None
        if not isinstance(text, str):
            raise PromptError(f"prompt must be str, bytes or a list of token ids, got {type(text).__name__}")
        if not text:
            raise PromptError("prompt is empty (expected at least one character)")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def render_chat(
        self, messages: Iterable[Mapping[str, str]], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> str:
        """The template's text of `messages` ({'role', 'content'} each); tools: OpenAI tool
        definitions for a template that reads them (tools.ToolPlan.template_tools)."""
        if self._template is None:
            raise InvalidArgument("this artifact has no chat template; pass a plain prompt instead of messages")
        messages = [dict(m) for m in messages]
        for i, message in enumerate(messages):
            if set(message) - {"role", "content"} or not isinstance(message.get("content"), str):
                raise InvalidArgument(
                    f"message {i} must be {{'role': str, 'content': str}}, got keys {sorted(message)}"
                )
        if not messages:
            raise PromptError("messages is empty (expected at least one message)")
        try:
            extra = {"tools": tools} if tools else {}
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **extra,
            )
        except TemplateError as exc:
            raise InvalidArgument(f"chat template rejected the messages: {exc}") from exc

    def encode_chat(self, messages: Iterable[Mapping[str, str]], tools: list[dict] | None = None) -> list[int]:
        # like transformers' apply_chat_template: the template writes the special tokens itself
        return self.encode(self.render_chat(messages, tools=tools), add_special_tokens=False)


class IncrementalDecoder:
    """Turns accepted token ids into text pieces, never splitting a multi-byte character.

    Decodes a short window (from `prefix` to the end) and emits only what is new and complete,
    so the cost per piece stays constant over a long generation."""

    def __init__(self, codec: TextCodec):
        self.codec = codec
        self.ids: list[int] = []
        self.prefix = 0  # start of the decode window
        self.read = 0  # tokens already emitted as text

    def push(self, new_ids: Sequence[int]) -> str:
        self.ids.extend(new_ids)
        done = self.codec.decode(self.ids[self.prefix : self.read])
        text = self.codec.decode(self.ids[self.prefix :])
        if len(text) > len(done) and not text.endswith(REPLACEMENT):
            piece = text[len(done) :]
            self.prefix, self.read = self.read, len(self.ids)
            return piece
        return ""

    def flush(self) -> str:
        done = self.codec.decode(self.ids[self.prefix : self.read])
        text = self.codec.decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return text[len(done) :]
