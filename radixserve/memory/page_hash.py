"""Content keys of KV pages: a chained hash of the token prefix a page ends.

A page's KV depends on every token before it, so its key hashes the whole prefix up to the
end of the page, chained page by page (vLLM's block hashes, SGLang's storage keys)::

    seed        = H("radixserve-kv" | model | KV layout | namespace)
    key(page i) = H(key(page i-1) | tokens of page i)       key(page -1) = seed

The seed folds in the model and the KV layout, so a page written by another model, another
dtype or another page size can never be read back as ours, and the namespace, so tenants
never share a page in any tier. Keys are 16-byte BLAKE2b digests: collisions are not a
practical concern and the hex form is a safe file name (the L3 store uses it).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Hashable, Sequence

PageKey = bytes
DIGEST_SIZE = 16


class PrefixHasher:
    """Computes page keys for one model and KV layout (``identity``)."""

    __slots__ = ("identity", "page_size", "_seeds")

    def __init__(self, identity: str, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.identity = identity
        self.page_size = page_size
        self._seeds: dict[Hashable | None, PageKey] = {}

    def rename(self, identity: str) -> None:
        """Key pages for ``identity`` from now on (new weights served: pages keyed before,
        in L3 or a Mooncake store, never match again)."""
        self.identity = identity
        self._seeds.clear()

    def seed(self, namespace: Hashable | None) -> PageKey:
        """The key "before page 0" of ``namespace`` (memoized: namespaces are few)."""
        s = self._seeds.get(namespace)
        if s is None:
            text = f"radixserve-kv|{self.identity}|ps={self.page_size}|ns={namespace!r}"
            s = hashlib.blake2b(text.encode(), digest_size=DIGEST_SIZE).digest()
            if len(self._seeds) < 4096:  # per-request salts must not grow this without bound
                self._seeds[namespace] = s
        return s

    def chain(self, prev: PageKey, tokens: Sequence[int]) -> list[PageKey]:
        """Keys of the whole pages of ``tokens``, continuing after the page keyed ``prev``."""
        ps = self.page_size
        out: list[PageKey] = []
        for i in range(0, len(tokens) - ps + 1, ps):
            prev = hashlib.blake2b(
                prev + array("q", tokens[i : i + ps]).tobytes(), digest_size=DIGEST_SIZE
            ).digest()
            out.append(prev)
        return out

    def keys(self, tokens: Sequence[int], namespace: Hashable | None = None) -> list[PageKey]:
        """Keys of every whole page of ``tokens`` from the start of a prompt."""
        return self.chain(self.seed(namespace), tokens)
