"""The longest common prefix of two token sequences: one helper for the radix cache, the
router's routing tries and the DSL's choice scoring; and the cache namespace of a LoRA
adapter's requests, which the worker's cache and the router's routing both key prefixes by,
and what may name an adapter (torch-free, so every layer and the clients may import them)."""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix_len(a: Sequence[int], b: Sequence[int], b_start: int = 0) -> int:
    """Length of the longest common prefix of ``a`` and ``b[b_start:]``.

    Gallops with doubling slice comparisons, then bisects the mismatching chunk: O(log L)
    Python steps, O(L) element compares in C. Slices compare equal only between sequences of
    one type, so mixed types (a list and a tuple) are compared as tuples.
    """
    if type(a) is not type(b):
        a, b = tuple(a), tuple(b)
    limit = max(0, min(len(a), len(b) - b_start))
    lo, step = 0, 64  # invariant: a[:lo] == b[b_start:b_start + lo]
    while True:
        if lo >= limit:
            return limit
        hi = min(lo + step, limit)
        if a[lo:hi] != b[b_start + lo : b_start + hi]:
            break
        lo, step = hi, step * 2
    while hi - lo > 1:  # a mismatch lies in [lo, hi)
        mid = (lo + hi) // 2
        if a[lo:mid] == b[b_start + lo : b_start + mid]:
            lo = mid
        else:
            hi = mid
    return lo


LORA_NAMESPACE_MARK = "#lora:"
# An adapter's name is a request's ``model`` (alone, or as ``base:name``) and part of its
# cache key (``name@digest``): no separators, and short.
MAX_ADAPTER_NAME_CHARS = 128
MAX_ADAPTER_PATH_CHARS = 4096  # a directory on the workers' hosts, named by an operator
_NAME_FORBIDDEN = frozenset(":#@/\\")


def check_adapter_name(name: str) -> None:
    """``ValueError`` unless ``name`` can name an adapter: 1 to 128 printable characters,
    no whitespace and none of ``: # @ / \\``."""
    if not 0 < len(name) <= MAX_ADAPTER_NAME_CHARS:
        raise ValueError(
            f"a LoRA adapter's name is 1 to {MAX_ADAPTER_NAME_CHARS} characters, got {len(name)}"
        )
    if not name.isprintable() or any(c.isspace() or c in _NAME_FORBIDDEN for c in name):
        raise ValueError(
            f"a LoRA adapter's name has no whitespace and none of ': # @ / \\', got {name!r}"
        )


def lora_namespace(namespace: str | None, adapter_key: str | None) -> str | None:
    """The radix-cache namespace of a request in ``namespace`` (a tenant's, or None) of the
    LoRA adapter whose cache key is ``adapter_key`` (its name and files' digest:
    radixserve.model.lora's LoraAdapter.cache_key): an adapter's keys and values are shared
    with its own requests only, and the router routes its prompts by the same namespace."""
    if adapter_key is None:
        return namespace
    return f"{namespace or ''}{LORA_NAMESPACE_MARK}{adapter_key}"
