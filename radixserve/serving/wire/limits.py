"""Request-size limits and text checks that run before any tokenizing.

A request's cost on the router must be bounded before the router spends anything on it
proportional to its size. The checks here are cheap (lengths, a scan for invalid text)
and torch-free, so the router, the HTTP gateway and the clients can all use them:

* :class:`RequestLimits`: the byte size of one request (an HTTP body, a ZeroMQ frame), the
  characters of a prompt (derived from the context length: a prompt with more characters
  than ``context_length`` tokens can hold cannot fit), and the batch size of one HTTP
  request (prompts × ``n``).
* :func:`surrogate_path` / :func:`invalid_utf8_path`: where a request carries text that is
  not valid Unicode (a lone surrogate such as ``"\\udc80"`` in JSON; invalid UTF-8 in a
  msgpack string), so that the reply is a 400 naming the field instead of a failure deep
  in a tokenizer or an encoder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_REQUEST_BYTES = 4 << 20  # 4 MiB: ~1M tokens of text, far past any context we serve
DEFAULT_MAX_BATCH_SIZE = 256  # router requests one HTTP request may start (prompts × n)
# A token is at most this many characters in the vocabularies we serve (BPE pieces of
# repeated spaces or punctuation are the longest); the character limit of a prompt is
# ``context_length`` of them. Generous on purpose: the exact check is the token count.
DEFAULT_CHARS_PER_TOKEN = 16
# A request's own chat template (vLLM's chat_template, where the server trusts them): the
# longest model templates are a few tens of kilobytes (tool-calling ones).
MAX_CHAT_TEMPLATE_CHARS = 1 << 16


@dataclass(frozen=True)
class RequestLimits:
    """Limits checked before tokenizing (see the module doc). ``0`` disables a limit."""

    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    chars_per_token: int = DEFAULT_CHARS_PER_TOKEN
    # Whether a request may bring its own chat template (vLLM's
    # --trust-request-chat-template): a template is code the server runs (in jinja's sandbox,
    # in a tokenizer process), so only a server whose clients are trusted takes them.
    request_chat_templates: bool = False

    def chat_template_error(self, template: str | None, has_messages: bool) -> str | None:
        """Why a request's own chat ``template`` is refused, or ``None`` (none sent, or
        allowed and of a size a template has)."""
        if template is None:
            return None
        if not self.request_chat_templates:
            return (
                "a per-request chat_template is not accepted by this server (start it with "
                "--trust-request-chat-template); the model's applies"
            )
        if not has_messages:
            return "chat_template applies to chat messages only"
        if not 0 < len(template) <= MAX_CHAT_TEMPLATE_CHARS:
            return f"chat_template must have 1 to {MAX_CHAT_TEMPLATE_CHARS} characters"
        return None

    def max_prompt_chars(self, context_length: int | None) -> int | None:
        """The most characters a prompt may have for ``context_length`` (``None``: no limit yet)."""
        if not context_length or self.chars_per_token <= 0:
            return None
        return context_length * self.chars_per_token

    def prompt_chars_error(
        self, chars: int, context_length: int | None, what: str = "the prompt"
    ) -> str | None:
        """Why a prompt (or ``what`` else is tokenized with it: a prediction) of ``chars``
        characters is refused without tokenizing it, or ``None``."""
        limit = self.max_prompt_chars(context_length)
        if limit is not None and chars > limit:
            return (
                f"{what} has {chars} characters, more than the {limit} that a context of "
                f"{context_length} tokens can hold ({self.chars_per_token} characters per token at most)"
            )
        return None

    def request_bytes_error(self, size: int) -> str | None:
        """Why a request of ``size`` bytes is refused before it is parsed, or ``None``."""
        if self.max_request_bytes > 0 and size > self.max_request_bytes:
            return f"the request has {size} bytes, more than the limit of {self.max_request_bytes} bytes"
        return None

    def batch_error(self, size: int) -> str | None:
        """Why a batch of ``size`` generations in one request is refused, or ``None``."""
        if self.max_batch_size > 0 and size > self.max_batch_size:
            return (
                f"the request asks for {size} generations (prompts × n), more than the limit "
                f"of {self.max_batch_size}"
            )
        return None


def prompt_chars(req: Any) -> int:
    """Characters of a :class:`~radixserve.serving.wire.protocol.GenerateRequest`'s text prompt
    (its text, or its chat messages' contents); 0 for token ids."""
    if req.text is not None:
        return len(req.text)
    if req.messages is not None:
        extra = len(req.tools or "") + len(req.chat_template_kwargs or "")
        extra += len(getattr(req, "chat_template", None) or "")
        return extra + sum(
            len(m.content)
            + len(m.role)
            + len(m.reasoning_content or "")
            + sum(len(c.name) + len(c.arguments) for c in m.tool_calls or ())
            for m in req.messages
        )
    return 0


# --------------------------------------------------------------------------- invalid text


def _has_surrogate(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def surrogate_path(obj: Any, path: str = "") -> str | None:
    """The path (``messages[0].content``) of the first string in ``obj`` (parsed JSON) that
    holds a lone surrogate and so is not valid Unicode; ``None`` if all text is valid.
    Keys are checked too (a key's path is its parent's, with the key's valid prefix)."""
    stack: list[tuple[str, Any]] = [(path, obj)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str):
            if _has_surrogate(value):
                return where or "body"
        elif isinstance(value, dict):
            items = list(value.items())
            for key, item in reversed(items):
                if isinstance(key, str) and _has_surrogate(key):
                    return _join(where, key.encode("utf-8", "replace").decode())
                stack.append((_join(where, str(key)), item))
        elif isinstance(value, (list, tuple)):
            stack.extend((_join(where, i), v) for i, v in reversed(list(enumerate(value))))
    return None


class _Malformed(Exception):
    """The frame is not msgpack at all (the strict decoder explains that itself)."""


class _MsgpackWalker:
    """Reads just enough msgpack to find the first string that is not valid UTF-8.

    msgspec rejects such a frame with "Invalid UTF-8 encoded string" but does not say
    where; this walk names the field so that the client learns which of its texts is bad."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def _take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise _Malformed
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def _uint(self, size: int) -> int:
        return int.from_bytes(self._take(size), "big")

    def value(self, path: str) -> tuple[Any, str | None]:
        """(the value when it is a string key candidate, else None; the bad path or None)."""
        b = self._take(1)[0]
        if b <= 0x7F or b >= 0xE0 or b in (0xC0, 0xC2, 0xC3):  # fixint, nil, bool
            return None, None
        if 0xA0 <= b <= 0xBF or b in (0xD9, 0xDA, 0xDB):
            n = b & 0x1F if b <= 0xBF else self._uint({0xD9: 1, 0xDA: 2, 0xDB: 4}[b])
            raw = self._take(n)
            try:
                return raw.decode("utf-8"), None
            except UnicodeDecodeError:
                return None, path or "message"
        if 0x90 <= b <= 0x9F or b in (0xDC, 0xDD):
            n = b & 0x0F if b <= 0x9F else self._uint(2 if b == 0xDC else 4)
            for i in range(n):
                _, bad = self.value(_join(path, i))
                if bad:
                    return None, bad
            return None, None
        if 0x80 <= b <= 0x8F or b in (0xDE, 0xDF):
            n = b & 0x0F if b <= 0x8F else self._uint(2 if b == 0xDE else 4)
            for _ in range(n):
                key, bad = self.value(path)
                if bad:
                    return None, bad
                _, bad = self.value(_join(path, key if isinstance(key, str) else "?"))
                if bad:
                    return None, bad
            return None, None
        fixed = {
            0xCC: 1,
            0xCD: 2,
            0xCE: 4,
            0xCF: 8,
            0xD0: 1,
            0xD1: 2,
            0xD2: 4,
            0xD3: 8,
            0xCA: 4,
            0xCB: 8,
            0xD4: 2,
            0xD5: 3,
            0xD6: 5,
            0xD7: 9,
            0xD8: 17,
        }
        if b in fixed:
            self._take(fixed[b])
            return None, None
        if b in (0xC4, 0xC5, 0xC6):  # bin
            self._take(self._uint({0xC4: 1, 0xC5: 2, 0xC6: 4}[b]))
            return None, None
        if b in (0xC7, 0xC8, 0xC9):  # ext
            n = self._uint({0xC7: 1, 0xC8: 2, 0xC9: 4}[b])
            self._take(n + 1)
            return None, None
        raise _Malformed


def invalid_utf8_path(data: bytes) -> str | None:
    """The field path of the first msgpack string in ``data`` that is not valid UTF-8
    (e.g. an encoded lone surrogate), or ``None`` (all strings valid, or not msgpack)."""
    try:
        return _MsgpackWalker(data).value("")[1]
    except (_Malformed, KeyError, RecursionError):
        return None
