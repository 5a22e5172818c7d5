"""Chat prompts: a model's chat template (Jinja, `tokenizer.chat_template` in the GGUF or
the file of --chat-template) rendered over a conversation into prompt tokens.

The template runs in jinja2's immutable sandbox with what Hugging Face's
`apply_chat_template` gives it: `messages`, `add_generation_prompt`, `bos_token`,
`eos_token` and `raise_exception`. No BOS is added beyond what the template writes.

Special tokens come only from the template's own text, never from a message. The
conversation is rendered twice: as it is, and with every message's content between
two markers that hold a random nonce (inside its leading and trailing whitespace, so a
template that trims the content trims the same characters). The marked rendering
without its markers must equal the plain one; its text outside the markers is read
for special tokens (`Tokenizer.split_special`), the text between them never: the
prompt is then the text between special tokens encoded in one piece each, as a
tokenizer reading the whole rendering would, except that `<|im_end|>` typed by a user
stays the characters `<|im_end|>`.
When a template changes a content beyond recognition (the two renderings differ) the
plain rendering is read with special tokens, which is safe only when no content holds
a special-token string: such a conversation is refused (INVALID_ARGUMENT).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from inference_svc.errors import FailedPrecondition, InvalidArgument

if TYPE_CHECKING:
    from inference_svc.core import Tokenizer

MAX_MESSAGES = 4096
MAX_ROLE_CHARS = 64


@dataclass(frozen=True)
class Message:
    role: str
    content: str


class TemplateError(ValueError):
    """The chat template does not compile (a bad --chat-template file or GGUF value)."""


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


class ChatTemplate:
    """A compiled chat template with the tokenizer whose special tokens it writes."""

    def __init__(self, source: str, tokenizer: Tokenizer) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise_exception
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(f"the chat template does not compile: line {exc.lineno}: "
                                f"{exc.message}") from exc
        self.source = source
        self.tokenizer = tokenizer
        tok = tokenizer.data.tokens
        self._bos = tok[tokenizer.bos_id] if tokenizer.bos_id is not None else ""
        self._eos = tok[tokenizer.eos_id] if tokenizer.eos_id is not None else ""

    def render_text(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
        """The template's text for the conversation (INVALID_ARGUMENT when it refuses)."""
        return self._render([{"role": m.role, "content": m.content} for m in messages],
                            add_generation_prompt)

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        try:
            return self._template.render(messages=messages,
                                         add_generation_prompt=add_generation_prompt,
                                         bos_token=self._bos, eos_token=self._eos)
        except jinja2.TemplateError as exc:
            raise InvalidArgument(f"the chat template rejected the messages: {exc}") from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise InvalidArgument(f"the chat template failed on the messages: "
                                  f"{type(exc).__name__}: {exc}") from exc

    def tokens(self, messages: Sequence[Message], add_generation_prompt: bool) -> list[int]:
        """The prompt tokens of the conversation (see the module's docstring)."""
        check_messages(messages, self.tokenizer)
        plain = self.render_text(messages, add_generation_prompt)
        nonce = secrets.token_hex(8)
        start, end = f"\ue000{nonce}\ue001", f"\ue000{nonce}\ue002"
        marked = self._render([{"role": m.role, "content": _wrap(m.content, start, end)}
                               for m in messages], add_generation_prompt)
        pieces = _split_marked(marked, start, end)
        if pieces is not None and "".join(text for text, _ in pieces) == plain:
            parts: list[str | int] = []
            for text, is_content in pieces:
                parts += [text] if is_content else self.tokenizer.split_special(text)
            return self.tokenizer.encode_parts(parts)
        for m in messages:
            hit = _special_in(m.content, self.tokenizer)
            if hit is not None:
                raise InvalidArgument(
                    f"a {m.role!r} message holds the special-token text {hit!r} and this chat "
                    "template rewrites message contents, so it cannot be kept as text")
        return self.tokenizer.encode_special(plain)


def _wrap(content: str, start: str, end: str) -> str:
    core = content.strip()
    if not core:
        return content + start + end
    lead = content[:len(content) - len(content.lstrip())]
    trail = content[len(content.rstrip()):]
    return lead + start + core + end + trail


def _split_marked(text: str, start: str, end: str) -> list[tuple[str, bool]] | None:
    """(piece, is content) in order; None when the markers do not pair up."""
    pieces: list[tuple[str, bool]] = []
    inside = False
    pos = 0
    for m in re.finditer(re.escape(start) + "|" + re.escape(end), text):
        if (m.group() == start) == inside:
            return None
        pieces.append((text[pos:m.start()], inside))
        inside = not inside
        pos = m.end()
    if inside:
        return None
    pieces.append((text[pos:], False))
    return pieces


def _special_in(text: str, tokenizer: Tokenizer) -> str | None:
    """A special-token string the text holds, or None."""
    hit = next((p for p in tokenizer.split_special(text) if isinstance(p, int)), None)
    return None if hit is None else tokenizer.data.tokens[hit]


def check_messages(messages: Sequence[Message], tokenizer: Tokenizer) -> None:
    """What any template needs of a conversation: at least one message, each with a
    role of 1..MAX_ROLE_CHARS characters that holds no special-token string (a role is
    written into the template's text, where it would become that token)."""
    if not messages:
        raise InvalidArgument("messages is empty: a conversation needs at least one message")
    if len(messages) > MAX_MESSAGES:
        raise InvalidArgument(f"{len(messages)} messages, at most {MAX_MESSAGES}")
    for i, m in enumerate(messages):
        if not 0 < len(m.role) <= MAX_ROLE_CHARS:
            raise InvalidArgument(f"message {i}: the role must be 1..{MAX_ROLE_CHARS} characters "
                                  f"(got {len(m.role)})")
        hit = _special_in(m.role, tokenizer)
        if hit is not None:
            raise InvalidArgument(f"message {i}: the role {m.role!r} holds the special-token "
                                  f"text {hit!r}")


def load_template(path_or_none: Any, tokenizer: Tokenizer) -> ChatTemplate | None:
    """The template of --chat-template FILE when given, else the model's, else None."""
    if path_or_none is not None:
        try:
            source = path_or_none.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise TemplateError(f"cannot read --chat-template {path_or_none}: {exc}") from exc
        return ChatTemplate(source, tokenizer)
    if tokenizer.data.chat_template:
        return ChatTemplate(tokenizer.data.chat_template, tokenizer)
    return None


def require(template: ChatTemplate | None) -> ChatTemplate:
    if template is None:
        raise FailedPrecondition("the model has no chat template (tokenizer.chat_template); "
                                 "start the server with --chat-template FILE")
    return template
