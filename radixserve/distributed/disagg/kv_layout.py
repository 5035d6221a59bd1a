"""Where a page's bytes lie in a pool, and which bytes of which pages go where: the pure part
of a KV transfer (no transfer engine here, so it is tested on plain numbers).

A pool's page of one layer is ``[page_size, kv_heads, packed_head_dim]`` (per-token scales:
``[page_size, kv_heads]``): token-major, each token's heads side by side. A tensor-parallel
rank holds the global KV heads ``[lo, hi)`` of its shard (:class:`PoolDescriptor.heads`)::

    prefill TP 1, heads 0..3          decode TP 2
    token t: | h0 | h1 | h2 | h3 |    rank 0, token t: | h0 | h1 |     rank 1: | h2 | h3 |
             '---------'---------'---------------------^               ^
                        '----------------------------------------------'

When both sides hold the same heads (equal tensor-parallel sizes, rank ``r`` to rank ``r``)
a page is one contiguous range and runs of pages consecutive on both sides coalesce into one
entry per tensor and layer. When they differ, each token's slice of heads is one entry, as
SGLang's ``send_kvcache_slice`` does; every source rank writes the heads it holds into every
decode rank that holds them (:func:`head_sources` decides who sends which).
"""

from __future__ import annotations

from typing import NamedTuple

import msgspec

__all__ = [
    "PoolDescriptor",
    "Segment",
    "check_peer",
    "head_sources",
    "page_runs",
    "transfer_entries",
]


class PoolDescriptor(msgspec.Struct, frozen=True):
    """Where a pool's pages live in its process, as its peer needs to write them."""

    session: str  # the transfer engine's "host:rpc_port"
    layout: str  # KVPool.layout(heads=False): equal on both sides, or no transfer
    num_layers: int
    num_pages: int
    bases: list[int]  # address of each page tensor (K, V[, K scales, V scales])
    page_bytes: list[int]  # bytes of one page of one layer, per tensor
    page_size: int
    heads: tuple[int, int]  # the global KV heads [lo, hi) this pool holds (its TP shard's)
    total_heads: int  # the model's KV heads

    @property
    def num_heads(self) -> int:
        return self.heads[1] - self.heads[0]


class Segment(NamedTuple):
    """One source rank's share of a transfer: heads ``[lo, hi)`` into decode rank ``rank``."""

    rank: int
    lo: int
    hi: int


def page_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """``(src start, dst start, length)`` for runs of pages consecutive on both sides."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            a, b, n = runs[-1]
            runs[-1] = (a, b, n + 1)
        else:
            runs.append((s, d, 1))
    return runs


def head_sources(src: list[tuple[int, int]], dst: list[tuple[int, int]]) -> list[list[Segment]]:
    """For each source rank (its heads ``src[i]``), the segments it writes into the decode
    ranks (their heads ``dst[j]``): every decode head comes from exactly one source rank, the
    one of the same index when it holds the head (equal TP: rank r to rank r), else the first
    that does (replicated heads are sent once per decode rank that holds them)."""
    out: list[list[Segment]] = [[] for _ in src]
    for j, (dlo, dhi) in enumerate(dst):
        for h in range(dlo, dhi):
            holders = [i for i, (lo, hi) in enumerate(src) if lo <= h < hi]
            if not holders:
                raise ValueError(f"no prefill rank holds KV head {h}")
            i = j if j in holders else holders[0]
            segs = out[i]
            if segs and segs[-1].rank == j and segs[-1].hi == h:
                segs[-1] = segs[-1]._replace(hi=h + 1)
            else:
                segs.append(Segment(j, h, h + 1))
    return out


def check_peer(mine: PoolDescriptor, peer: PoolDescriptor, src: list[int], dst: list[int]) -> None:
    """``ValueError`` unless pages ``src`` of ``mine`` can be written into pages ``dst`` of
    ``peer`` (same model, page size and KV dtype; head slices of the same heads)."""
    if peer.layout != mine.layout or peer.total_heads != mine.total_heads:
        raise ValueError(
            f"KV layouts differ: this pool {mine.layout} of {mine.total_heads} KV heads, the "
            f"peer's {peer.layout} of {peer.total_heads} (KV dtype, page size and model must match)"
        )
    if [b * peer.num_heads for b in mine.page_bytes] != [
        b * mine.num_heads for b in peer.page_bytes
    ]:
        raise ValueError("KV layouts differ: bytes per head and token")
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source pages for {len(dst)} destination pages")
    if any(not 0 <= p < mine.num_pages for p in src) or any(
        not 0 <= p < peer.num_pages for p in dst
    ):
        raise ValueError("page id out of range")


def transfer_entries(
    mine: PoolDescriptor, peer: PoolDescriptor, src: list[int], dst: list[int], heads: Segment
) -> tuple[list[int], list[int], list[int]]:
    """``(src addresses, dst addresses, lengths)`` copying heads ``[heads.lo, heads.hi)`` of
    pages ``src`` of ``mine`` into pages ``dst`` of ``peer``, every tensor and layer: whole
    runs of pages when both pools hold exactly those heads, else one entry per token slot."""
    whole = (heads.lo, heads.hi) == mine.heads == peer.heads
    runs = page_runs(src, dst) if whole else [(s, d, 1) for s, d in zip(src, dst)]
    srcs: list[int] = []
    dsts: list[int] = []
    lengths: list[int] = []
    for i, pb in enumerate(mine.page_bytes):
        qb = peer.page_bytes[i]
        unit = pb // (mine.page_size * mine.num_heads)  # one head of one token
        tokens = [(0, 0, pb)] if whole else _token_slices(mine, peer, heads, unit)
        for layer in range(mine.num_layers):
            src_layer = mine.bases[i] + layer * mine.num_pages * pb
            dst_layer = peer.bases[i] + layer * peer.num_pages * qb
            for s, d, n in runs:
                for s_off, d_off, length in tokens:
                    srcs.append(src_layer + s * pb + s_off)
                    dsts.append(dst_layer + d * qb + d_off)
                    lengths.append(n * length)
    return srcs, dsts, lengths


def _token_slices(
    mine: PoolDescriptor, peer: PoolDescriptor, heads: Segment, unit: int
) -> list[tuple[int, int, int]]:
    """``(offset in my page, offset in the peer's page, length)`` of the heads' slice of each
    token of a page."""
    s0 = (heads.lo - mine.heads[0]) * unit
    d0 = (heads.lo - peer.heads[0]) * unit
    n = (heads.hi - heads.lo) * unit
    return [
        (t * mine.num_heads * unit + s0, t * peer.num_heads * unit + d0, n)
        for t in range(mine.page_size)
    ]
