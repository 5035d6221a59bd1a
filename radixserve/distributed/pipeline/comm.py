"""The traffic of a pipeline-parallel worker over torch.distributed: plans, activations, logits.

Ranks are laid out stage-major, each stage a tensor-parallel group::

    rank = stage * tp + tp_rank          (tp 2 x pp 2:  stage 0 = ranks 0, 1;  stage 1 = ranks 2, 3)

    rank 0 ── plan (broadcast, every step) ──> every rank
    rank (s, r) ── hidden [T, H] (send/recv) ──> rank (s + 1, r)     each TP rank its own replica
    rank (pp - 1, 0) ── logits [N, V] float32 (send/recv) ──> rank 0 (which samples)

Rank 0 runs the scheduler, stage 0 and the sampler; the last stage sends the logits of the
rows that sample (and of prompt-logprob rows) back to it. Sending logits instead of sampled
tokens keeps every piece of sampling state (seeds, penalties, grammar masks) in one process,
at ``N × V × 4`` bytes a step.

The plan travels on a CPU (gloo) group even when the activations use NCCL: it is a msgpack
byte string, broadcast as its length then its bytes.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["PipelineComm", "CommStats"]

_TAG_HIDDEN = 1
_TAG_LOGITS = 2
_TAG_STATS = 3
# Plan-broadcast sizes below zero are control messages, not plans.
STOP = -1
REPORT_STATS = -2
UPDATE_WEIGHTS = -3  # then the checkpoint's path, then every rank's vote (PipelineComm.agree)


def wait_for_transfer(work: Any, device: torch.device, timeout: datetime.timedelta | None) -> None:
    """Order what follows after a point-to-point transfer.

    NCCL (CUDA): ``Work.wait()`` without a timeout makes the current stream wait for the
    transfer and returns at once; with a timeout it blocks the host thread, polling until the
    transfer is done, which would stall every pipeline hop on the host. So on CUDA the stream
    waits and a hung peer is left to the process group's own timeout (its watchdog). gloo
    (the CPU): the host waits, bounded by ``timeout``.
    """
    if device.type == "cuda" or timeout is None:
        work.wait()
    else:
        work.wait(timeout)


class CommStats:
    """Where one rank's time went (the benchmark's send/recv time and bubble): waiting for plans,
    sending, waiting for activations or logits, and computing (its stage's forward, and on
    rank 0 the sampling)."""

    FIELDS = (
        "plan_seconds",
        "send_seconds",
        "recv_seconds",
        "compute_seconds",
        "bytes_sent",
        "steps",
    )

    def __init__(self) -> None:
        self.plan_seconds = 0.0
        self.send_seconds = 0.0
        self.recv_seconds = 0.0  # waiting for the previous stage's activations / the logits
        self.compute_seconds = 0.0
        self.bytes_sent = 0
        self.steps = 0

    def as_dict(self) -> dict[str, float]:
        return {f: getattr(self, f) for f in self.FIELDS}

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor([float(getattr(self, f)) for f in self.FIELDS], dtype=torch.float64)

    @staticmethod
    def from_tensor(t: torch.Tensor) -> dict[str, float]:
        return dict(zip(CommStats.FIELDS, t.tolist(), strict=True))

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]


class PipelineComm:
    """One rank's view of a ``tp × pp`` worker's groups and neighbours.

    ``cpu_group`` carries the plans (and everything on a CPU device); ``device_group`` the
    activations and logits (NCCL on CUDA; the same gloo group on the CPU).
    """

    def __init__(
        self,
        rank: int,
        tp: int,
        pp: int,
        cpu_group: Any,
        device_group: Any | None = None,
        device: torch.device | str = "cpu",
        step_timeout: datetime.timedelta | None = None,
    ) -> None:
        """``step_timeout``: how long a receive inside a step may wait (a hung peer)."""
        self.rank, self.tp, self.pp = rank, tp, pp
        self.world_size = tp * pp
        self.stage, self.tp_rank = divmod(rank, tp)
        self.cpu_group = cpu_group
        self.device_group = device_group if device_group is not None else cpu_group
        self.device = torch.device(device)
        self.step_timeout = step_timeout
        self.stats = CommStats()
        self._sends: list[Any] = []  # works of async sends not yet known to be done

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.pp - 1

    @property
    def prev_rank(self) -> int:
        return self.rank - self.tp

    @property
    def next_rank(self) -> int:
        return self.rank + self.tp

    @property
    def logits_src(self) -> int:
        """The rank that sends the logits to rank 0: the last stage's first TP rank."""
        return (self.pp - 1) * self.tp

    # -- plans (rank 0 -> all) ----------------------------------------------------------

    def broadcast_bytes(self, payload: bytes | int) -> bytes | int:
        """Rank 0 passes the payload (or a negative control code: :data:`STOP`,
        :data:`REPORT_STATS`, :data:`UPDATE_WEIGHTS`); every rank gets it back."""
        t0 = time.perf_counter()
        code = payload if isinstance(payload, int) else len(payload)
        size = torch.tensor([code], dtype=torch.int64)
        opts = dist.BroadcastOptions()
        if self.rank == 0 and self.step_timeout is not None:
            # Rank 0 waits for every rank to take the plan (a hung one fails it); the others
            # wait through the engine's idle time (the group's own timeout).
            opts.timeout = self.step_timeout
        self.cpu_group.broadcast([size], opts).wait()
        n = int(size.item())
        if n < 0:
            return n
        if self.rank == 0:
            assert isinstance(payload, bytes)
            buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        else:
            buf = torch.empty(n, dtype=torch.uint8)
        if n:
            self.cpu_group.broadcast([buf], opts).wait()
        self.stats.plan_seconds += time.perf_counter() - t0
        return payload if self.rank == 0 else buf.numpy().tobytes()

    def agree(self, ok: bool) -> bool:
        """Whether every rank of the world says ``ok`` (one all-reduce of the votes' minimum
        over the plans' group, which every rank is in)."""
        vote = torch.tensor([1 if ok else 0], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN  # type: ignore[assignment]
        self.cpu_group.allreduce([vote], opts).wait()
        return int(vote.item()) == 1

    # -- activations (stage s -> s + 1) and logits (last -> rank 0) ------------------------

    def send_hidden(self, hidden: torch.Tensor) -> None:
        """Start sending this stage's output to the same TP rank of the next stage."""
        self._send(hidden, self.next_rank, _TAG_HIDDEN)

    def recv_hidden(self, rows: int, hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
        """The previous stage's output for a step of ``rows`` rows (waits for it)."""
        return self._recv((rows, hidden_size), dtype, self.prev_rank, _TAG_HIDDEN)

    def send_logits(self, logits: torch.Tensor) -> None:
        self._send(logits, 0, _TAG_LOGITS)

    def recv_logits(self, rows: int, vocab_size: int) -> torch.Tensor:
        return self._recv((rows, vocab_size), torch.float32, self.logits_src, _TAG_LOGITS)

    def _send(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        if not tensor.numel():
            return  # the receiver skips empty tensors too (a micro-batch that samples nothing)
        t0 = time.perf_counter()
        tensor = tensor.contiguous()
        # The tensor must outlive the send: keep it with its work until the next wait.
        self._sends.append((self.device_group.send([tensor], dst, tag), tensor))
        self.stats.bytes_sent += tensor.numel() * tensor.element_size()
        self.flush(wait=False)
        self.stats.send_seconds += time.perf_counter() - t0

    def _recv(self, shape: tuple[int, int], dtype: torch.dtype, src: int, tag: int) -> torch.Tensor:
        t0 = time.perf_counter()
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        if buf.numel():
            wait_for_transfer(
                self.device_group.recv([buf], src, tag), self.device, self.step_timeout
            )
        self.stats.recv_seconds += time.perf_counter() - t0  # on CUDA: the host's part only
        return buf

    def report_stats(self) -> None:
        """A non-zero rank's answer to :data:`REPORT_STATS`: its stats to rank 0, then zeroed."""
        self.cpu_group.send([self.stats.as_tensor()], 0, _TAG_STATS).wait()
        self.stats.reset()

    def gather_stats(self) -> list[dict[str, float]]:
        """Rank 0: every rank's stats since the last gather (rank order), all zeroed after."""
        plan_seconds = self.stats.plan_seconds
        self.broadcast_bytes(REPORT_STATS)
        self.stats.plan_seconds = plan_seconds  # the request itself is no step's
        out = [self.stats.as_dict()]
        for rank in range(1, self.world_size):
            buf = torch.zeros(len(CommStats.FIELDS), dtype=torch.float64)
            self.cpu_group.recv([buf], rank, _TAG_STATS).wait()
            out.append(CommStats.from_tensor(buf))
        self.stats.reset()
        return out

    def flush(self, wait: bool = True) -> None:
        """Drop the sends that completed (``wait``: wait for all of them first)."""
        if wait:
            for work, _ in self._sends:
                work.wait()
            self._sends.clear()
        else:
            self._sends = [(w, t) for w, t in self._sends if not w.is_completed()]
