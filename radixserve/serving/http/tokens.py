"""Token ids to the strings and bytes that logprob results show.

OpenAI's logprob entries carry each token's text and its exact ``bytes``
(:class:`~radixserve.token_bytes.TokenBytes`): a character split across tokens shows as
U+FFFD in the text of each piece, but the pieces' bytes join back into the character.
"""

from __future__ import annotations

from typing import Any

from radixserve.token_bytes import CACHE_LIMIT, TokenBytes


class TokenNames:
    """Cached token texts and bytes for one tokenizer (``None``: shown as ``token_id:N``)."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        self._bytes = TokenBytes(tokenizer) if tokenizer is not None else None
        self._texts: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        """The token decoded alone (a partial character shows as U+FFFD)."""
        text = self._texts.get(token_id)
        if text is None:
            text = (
                self.tokenizer.decode([token_id])
                if self.tokenizer is not None
                else f"token_id:{token_id}"
            )
            if len(self._texts) < CACHE_LIMIT:
                self._texts[token_id] = text
        return text

    def bytes(self, token_id: int) -> bytes:
        """The token's exact bytes."""
        if self._bytes is None:
            return self.text(token_id).encode()
        return self._bytes(token_id)
