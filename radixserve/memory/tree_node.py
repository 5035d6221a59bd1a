"""One node of the radix cache: an edge of whole pages of token ids and the pages holding their KV."""

from __future__ import annotations

from collections.abc import Hashable


class TreeNode:
    """A node of :class:`~radixserve.memory.radix_cache.RadixCache`.

    The node owns the edge from its parent: ``key`` (token ids, a whole number of pages) and
    ``pages`` (one KV page id per ``page_size`` tokens of ``key``). ``depth`` is the number of
    tokens from the root to the end of this edge, so a request locked on this node is backed
    by tree pages for exactly its first ``depth`` tokens.

    Reference counts:
        ``holders``  requests that locked this very node.
        ``lock_ref`` holders of this node or of any node below it. A node with
                     ``lock_ref > 0`` is on some running request's path and is never evicted;
                     ``lock_ref == holders + sum(child.lock_ref)`` always.

    A namespace root has ``parent is None``, an empty key and no pages; it is never locked or
    evicted. Nodes compare and hash by identity, so they can sit in sets and heap entries.
    """

    __slots__ = (
        "id",
        "key",
        "pages",
        "children",
        "parent",
        "depth",
        "lock_ref",
        "holders",
        "last_access",
        "alive",
        "namespace",
    )

    def __init__(
        self,
        node_id: int,
        key: tuple[int, ...],
        pages: list[int],
        parent: TreeNode | None,
        depth: int,
        last_access: int,
        namespace: Hashable | None = None,
    ) -> None:
        self.id = node_id
        self.key = key
        self.pages = pages
        # Children keyed by their first token (page_size 1) or first page of tokens (a tuple).
        self.children: dict[object, TreeNode] = {}
        self.parent = parent
        self.depth = depth
        self.lock_ref = 0
        self.holders = 0
        self.last_access = last_access
        self.alive = True
        self.namespace = namespace  # only meaningful on roots

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self) -> str:
        kind = "root" if self.parent is None else ("leaf" if not self.children else "node")
        return (
            f"TreeNode({kind} id={self.id}, tokens={len(self.key)}, pages={len(self.pages)}, depth={self.depth}, "
            f"lock_ref={self.lock_ref}, holders={self.holders}, last_access={self.last_access}, alive={self.alive})"
        )
