"""Each token's exact bytes, read off a transformers tokenizer.

A character can be split across tokens (common with byte-level BPE): each piece then decodes
alone as U+FFFD, but the pieces' bytes join back into the character. Two readers need those
bytes: OpenAI's logprob entries (their ``bytes`` field, :mod:`radixserve.serving.http.tokens`)
and a thinking budget, which must not close a ``<think>`` block in the middle of a character
(:mod:`radixserve.constrained.thinking_budget`). Byte-level BPE pieces are mapped back through
GPT-2's byte alphabet, ``<0xNN>`` byte-fallback pieces (SentencePiece) give that byte, anything
else its decoded text's UTF-8.
"""

from __future__ import annotations

import json
import re
from typing import Any

CACHE_LIMIT = 1 << 20  # entries a per-token cache keeps (the gateway's names use it too)
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
    try:  # the decoder's own JSON: the whole tokenizer's is megabytes for a large vocabulary
        decoder = json.loads(tokenizer.backend_tokenizer.decoder.__getstate__()) or {}
    except Exception:  # a slow (Python) tokenizer has no backend, a bare model no decoder
        return False
    return decoder.get("type") == "ByteLevel" or any(
        d.get("type") == "ByteLevel" for d in decoder.get("decoders", [])
    )


class TokenBytes:
    """One tokenizer's token bytes, cached as they are asked for (up to a million ids)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._byte_level = is_byte_level(tokenizer)
        self._special = set(tokenizer.all_special_ids)
        self._bytes: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        """The token's exact bytes (a special token's: its text's)."""
        raw = self._bytes.get(token_id)
        if raw is None:
            raw = self._lookup(token_id)
            if len(self._bytes) < CACHE_LIMIT:
                self._bytes[token_id] = raw
        return raw

    def _lookup(self, token_id: int) -> bytes:
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
        return str(self.tokenizer.decode([token_id])).encode()


# A lead byte's character: its size in bytes, and the range its second byte must lie in
# (Unicode's table of well-formed UTF-8, 3-7: no overlong forms, no surrogates, nothing past
# U+10FFFF).
_LEADS: dict[int, tuple[int, range]] = {
    **{b: (2, range(0x80, 0xC0)) for b in range(0xC2, 0xE0)},
    0xE0: (3, range(0xA0, 0xC0)),
    **{b: (3, range(0x80, 0xC0)) for b in (*range(0xE1, 0xED), 0xEE, 0xEF)},
    0xED: (3, range(0x80, 0xA0)),
    0xF0: (4, range(0x90, 0xC0)),
    **{b: (4, range(0x80, 0xC0)) for b in range(0xF1, 0xF4)},
    0xF4: (4, range(0x80, 0x90)),
}


def pending_bytes(tail: bytes) -> int:
    """How many more bytes the character that ``tail`` ends in needs: 0 when ``tail`` ends at
    a character boundary, or in bytes that no byte to come can make well-formed."""
    cont = 0  # continuation bytes (10xxxxxx) at the end, at most 3
    while cont < min(3, len(tail)) and 0x80 <= tail[-1 - cont] <= 0xBF:
        cont += 1
    if cont == len(tail) or tail[-1 - cont] not in _LEADS:
        return 0
    size, second = _LEADS[tail[-1 - cont]]
    if cont >= size - 1 or (cont > 0 and tail[-cont] not in second):
        return 0
    return size - 1 - cont
