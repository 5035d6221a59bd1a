"""Token ids to the strings and bytes that logprob results show.

OpenAI's logprob entries carry each token's text and its exact ``bytes``: a character
split across tokens (common with byte-level BPE) shows as U+FFFD in the text of each
piece, but the pieces' bytes join back into the character. Byte-level BPE pieces are
mapped back through GPT-2's byte alphabet, ``<0xNN>`` byte-fallback pieces (SentencePiece)
give that byte, anything else its decoded text's UTF-8.
"""

from __future__ import annotations

import builtins
import json
import re
from typing import Any

_CACHE_LIMIT = 1 << 20
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the byte each stand-in character means."""
    keep = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {b: b for b in keep}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


_BYTE_DECODER = _byte_decoder()


def is_byte_level(tokenizer: Any) -> bool:
    """Whether a fast tokenizer decodes with the byte-level decoder (GPT-2, Llama 3, SmolLM2)."""
    try:
        decoder = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
    except Exception:  # a slow (Python) tokenizer has no backend
        return False
    return decoder.get("type") == "ByteLevel" or any(
        d.get("type") == "ByteLevel" for d in decoder.get("decoders", [])
    )


class TokenNames:
    """Cached token texts and bytes for one tokenizer (``None``: shown as ``token_id:N``)."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        self._byte_level = tokenizer is not None and is_byte_level(tokenizer)
        self._special = set(tokenizer.all_special_ids) if tokenizer is not None else set()
        self._texts: dict[int, str] = {}
        self._bytes: dict[int, bytes] = {}

    def text(self, token_id: int) -> str:
        """The token decoded alone (a partial character shows as U+FFFD)."""
        text = self._texts.get(token_id)
        if text is None:
            text = (
                self.tokenizer.decode([token_id])
                if self.tokenizer is not None
                else f"token_id:{token_id}"
            )
            if len(self._texts) < _CACHE_LIMIT:
                self._texts[token_id] = text
        return text

    def bytes(self, token_id: int) -> bytes:
        """The token's exact bytes."""
        raw = self._bytes.get(token_id)
        if raw is None:
            raw = self._lookup(token_id)
            if len(self._bytes) < _CACHE_LIMIT:
                self._bytes[token_id] = raw
        return raw

    def _lookup(self, token_id: int) -> builtins.bytes:  # `bytes` here is the method above
        if self.tokenizer is None:
            return self.text(token_id).encode()
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if self._byte_level and token_id not in self._special:
                try:
                    return bytes(_BYTE_DECODER[c] for c in piece)
                except KeyError:
                    pass
            m = _BYTE_FALLBACK.fullmatch(piece)
            if m:
                return bytes([int(m.group(1), 16)])
        return self.text(token_id).encode()
