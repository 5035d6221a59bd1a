"""Tensor parallelism for the model layer: the rank group, each rank's shard, the parallel layers.

A model with ``Q`` query heads over ``K`` KV heads (GQA groups of ``g = Q / K``), MLP width
``I`` and vocabulary ``V`` is split over ``N`` ranks like this::

    q/k/v, gate/up   column-parallel: rank r computes its own heads / MLP columns, no communication
    o, down          row-parallel:    each rank's partial sum over its own input columns,
                                      then ONE all-reduce per projection
    embedding        vocab-parallel:  rank r holds rows [v_lo, v_hi); ids outside give zeros; all-reduce
    LM head          vocab-parallel:  rank r computes logits [v_lo, v_hi); one all-gather

Heads are split by GQA group so that every rank keeps a uniform group size (the attention
backends map q head ``h`` to KV head ``h // g``):

- ``K >= N``: rank r owns a contiguous run of KV heads (sizes differ by at most one, the larger
  shares first) and the ``g`` query heads of each. SmolLM2 (9 q over 3 KV) on 2 ranks: rank 0
  keeps KV heads 0-1 with q heads 0-5, rank 1 KV head 2 with q heads 6-8.
- ``K < N``: KV heads are *replicated*: the ranks ``r`` with ``r * K // N == k`` all hold KV
  head ``k`` and share its ``g`` query heads between them. SmolLM2 on 4 ranks: ranks 0-1 hold
  KV head 0 (q heads 0-1 and 2), rank 2 KV head 1, rank 3 KV head 2.

Rank 0 always has the largest shard, so sizing memory from rank 0's shard bounds every rank.
Uneven splits (9 heads on 2 ranks) are allowed, unlike vLLM/SGLang which require divisibility:
the row-parallel all-reduce sums partial products of any widths.

The split rules and each rank's checkpoint slices are ``model/tp_shard.py``'s (re-exported
here). The new families' parts (docs/parallelism.md):

- Phi-3's fused ``qkv_proj`` / ``gate_up_proj`` in the checkpoint: the rank's rows of each
  part (q, k, v; gate, up), read as separate ranges and concatenated (:class:`TensorSlice`);
- a "proj" q/k norm (OLMo 2, OLMoE) over the whole projection: its weight cut like the
  heads; the rank's sum of squares all-reduced (``Attention``, ``ModelConfig.qk_norm_tp``);
- mixture-of-experts blocks: every expert tensor-parallel on its own MLP width (rank r holds
  rows ``expert_intermediate`` of every expert), the router replicated; the block's partial
  output is summed by one all-reduce, as a dense MLP's.

The communication is :class:`TPGroup`, a thin wrapper over one torch.distributed backend
(gloo on the CPU, NCCL on CUDA) made from a ``TCPStore`` without touching torch.distributed's
global default group, so several engines (and tests) can live in one process. With one rank no
group exists and the model is exactly the single-device code.
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import time
from typing import Any

import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from radixserve.model.tp_shard import (
    TensorSlice,
    TPShard,
    checkpoint_slice,
    local_tensor_name,
    shard_for_rank,
    split_range,
)

__all__ = [
    "TPGroup",
    "TPShard",
    "TensorSlice",
    "checkpoint_slice",
    "local_tensor_name",
    "VocabParallelEmbedding",
    "ParallelLMHead",
    "make_gloo",
    "shard_for_rank",
    "split_range",
]


def listen_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` exactly (port 0: any free one), for rank 0's
    store: ``TCPStore`` left to itself listens on every interface."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock


def tcp_store(
    host: str,
    port: int,
    rank: int,
    world_size: int,
    timeout: datetime.timedelta,
    listen: socket.socket | None = None,
) -> dist.TCPStore:
    """The rendezvous store: served by rank 0 on ``listen`` (a :func:`listen_socket` bound to
    ``host:port``), joined by the others at ``host:port``. Unauthenticated: see docs/security.md."""
    if rank == 0:
        if listen is None:
            listen = listen_socket(host, port)
        return dist.TCPStore(
            host,
            listen.getsockname()[1],
            world_size,
            True,
            timeout=timeout,
            wait_for_workers=False,
            # The store's server owns the socket from here (a closed Python socket would
            # close it under the server's feet).
            master_listen_fd=listen.detach(),
        )
    return dist.TCPStore(host, port, world_size, False, timeout=timeout)


def rendezvous_store(
    host: str,
    port: int,
    rank: int,
    world_size: int,
    timeout: datetime.timedelta,
    listen: socket.socket | None = None,
    path: str | None = None,
) -> dist.Store:
    """Where the ranks meet: with ``path`` (ranks on one host), a file store in a directory
    only this user can open (:func:`private_store_path`), so no other local process can read
    the ranks' addresses or write keys into it; else the :func:`tcp_store` at ``host:port``."""
    if path is None:
        return tcp_store(host, port, rank, world_size, timeout, listen)
    store = dist.FileStore(path, world_size)
    store.set_timeout(timeout)
    return store


def private_store_path() -> str:
    """A fresh file-store path in a new directory of mode 0700 (remove it with its directory)."""
    return os.path.join(tempfile.mkdtemp(prefix="radixserve-ranks-"), "store")


def make_gloo(
    store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta, bind_host: str
) -> dist.ProcessGroupGloo:
    """A gloo backend whose sockets listen on ``bind_host`` only (not on every interface)."""
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
    return dist.ProcessGroupGloo(store, rank, world_size, opts)


class TPGroup:
    """The tensor-parallel ranks of one worker: rank, world size and the three collectives the
    model needs. ``comm_seconds`` accumulates the time spent in them while ``timing`` is on
    (the benchmark's communication share; on CUDA it synchronizes, so it is off by default)."""

    def __init__(
        self,
        backend: Any,
        rank: int,
        world_size: int,
        device: torch.device,
        timeout: datetime.timedelta | None = None,
    ) -> None:
        """``backend``: a ``ProcessGroupGloo`` / ``ProcessGroupNCCL`` of ``world_size`` ranks;
        ``timeout``: each collective's (default: the backend's own)."""
        self.backend = backend
        self._reduce_opts = c10d.AllreduceOptions()
        self._gather_opts = c10d.AllgatherOptions()
        if timeout is not None:
            self._reduce_opts.timeout = timeout
            self._gather_opts.timeout = timeout
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.timing = False
        self.comm_seconds = 0.0
        self.comm_calls = 0

    @staticmethod
    def create(
        store: dist.Store,
        rank: int,
        world_size: int,
        device: torch.device,
        timeout: datetime.timedelta,
        bind_host: str,
        connect_timeout: datetime.timedelta | None = None,
    ) -> TPGroup:
        """Gloo on the CPU, NCCL on CUDA, over ``store`` (a ``TCPStore``/``PrefixStore``).
        ``timeout`` bounds every collective; ``connect_timeout`` (default ``timeout``) the
        wait for the other ranks to join (gloo connects at creation, NCCL at first use)."""
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            backend: Any = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        else:
            backend = make_gloo(store, rank, world_size, connect_timeout or timeout, bind_host)
        return TPGroup(backend, rank, world_size, device, timeout)

    def _timed(self, work: dist.Work) -> None:
        if not self.timing:
            work.wait()
            return
        t0 = time.perf_counter()
        work.wait()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.comm_seconds += time.perf_counter() - t0
        self.comm_calls += 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x``."""
        self._timed(self.backend.allreduce([x], self._reduce_opts))
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``x`` (all the same shape), in rank order."""
        out = [torch.empty_like(x) for _ in range(self.world_size)]
        self._timed(self.backend.allgather([out], [x.contiguous()], self._gather_opts))
        return out


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows ``[v_lo, v_hi)`` live on this rank; one all-reduce assembles rows."""

    def __init__(self, shard: TPShard, hidden_size: int, tp: TPGroup | None) -> None:
        super().__init__()
        self.lo, self.hi = shard.vocab
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(self.hi - self.lo, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.lo
        outside = (local < 0) | (local >= self.hi - self.lo)
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        h.masked_fill_(outside.unsqueeze(-1), 0.0)
        return h if self.tp is None else self.tp.all_reduce(h)


class ParallelLMHead(nn.Module):
    """LM head over this rank's vocabulary rows; one all-gather gives every rank all logits
    (every rank samples the same tokens, so overlap scheduling's device-side inputs agree)."""

    def __init__(
        self, shard: TPShard, hidden_size: int, vocab_size: int, tp: TPGroup | None
    ) -> None:
        super().__init__()
        self.lo, self.hi = shard.vocab
        self.pad_to = shard.vocab_shard_max
        self.tp = tp
        # Each rank's real width: the gathered chunks are padded to ``pad_to`` and cut back.
        self._widths = [
            b - a
            for a, b in (
                split_range(vocab_size, shard.world_size, r) for r in range(shard.world_size)
            )
        ]
        self.weight = nn.Parameter(torch.empty(self.hi - self.lo, hidden_size))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits = F.linear(h, self.weight)
        if self.tp is None:
            return logits
        if logits.shape[-1] < self.pad_to:  # the gather needs equal chunks
            logits = F.pad(logits, (0, self.pad_to - logits.shape[-1]))
        parts = self.tp.all_gather(logits)
        return torch.cat([p[:, :w] for p, w in zip(parts, self._widths)], dim=-1)
