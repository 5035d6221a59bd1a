"""Model runners of a pipeline-parallel worker: rank 0's (scheduler side) and every other rank's.

Every rank holds one stage (:class:`~radixserve.model.pipeline_stage.LlamaPipelineStage`), a KV
pool of that stage's layers with the same page count and layout on every rank, and the same
persistent page table, patched from each plan. One step::

    rank 0      launch(plan): broadcast the plan ─> stage 0 forward ─> send hidden ─┐
    rank (s,r)  plan ─> recv hidden ─> stage s forward ─> send hidden ──────────────┤
    last stage  plan ─> recv hidden ─> layers, norm, LM head ─> send logits ─> rank 0 samples

Only the forward part of a plan goes over the wire (the tensor-parallel ranks' ``StepMessage``
without sampling inputs); requests and their
sampling parameters stay on rank 0, which samples from the logits the last stage returns.
Tokens that the plan takes from the step before (overlap's ``future_rows``) are filled in on
rank 0's host before the broadcast, so every stage-0 TP rank embeds the same ids.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

import radixserve.distributed.step_wire as step_wire
from radixserve.distributed.pipeline.comm import REPORT_STATS, STOP, UPDATE_WEIGHTS, PipelineComm
from radixserve.distributed.pipeline.micro import MicroBatch, split_micro_batches, sub_batch
from radixserve.engine.model_runner import ModelRunner, PendingStep, prompt_reads
from radixserve.engine.sampler import Sampler
from radixserve.engine.staging import Staged, StagingLayout
from radixserve.memory.pool import KVPool
from radixserve.model.attention.base import AttentionBackend
from radixserve.model.pipeline_stage import LlamaPipelineStage
from radixserve.scheduling.plan import StepPlan, StepResult

if TYPE_CHECKING:
    from radixserve.model.weight_update import WeightCopy


__all__ = ["PipelineRunner", "StageRunner", "decode_plan", "encode_plan"]


def encode_plan(plan: StepPlan) -> bytes:
    """The forward part of ``plan`` on the wire: the tensor-parallel ranks' message
    (:mod:`~radixserve.distributed.step_wire`) without the sampler's inputs."""
    return step_wire.encode(step_wire.step_message(plan, None, None))


def decode_plan(payload: bytes) -> StepPlan:
    """A :class:`StepPlan` with the forward fields of ``payload`` and no sampling."""
    msg = step_wire.decode(payload)
    assert isinstance(msg, step_wire.StepMessage)
    return step_wire.plan_of(msg)


class _Done(PendingStep):
    """A step whose results are already on the host (the pipeline waited for its logits)."""

    def __init__(self, result: StepResult) -> None:
        self._result = result

    def result(self) -> StepResult:
        return self._result


class StageRunner(ModelRunner):
    """A stage's runner on any rank: stages the plan, patches its page table, runs its layers."""

    model: LlamaPipelineStage

    def __init__(
        self,
        model: LlamaPipelineStage,
        pool: KVPool,
        attn: AttentionBackend,
        comm: PipelineComm,
        max_rows: int,
        max_pages: int,
        sampler: Sampler | None = None,
        scratch_page: int | None = None,
        micro_batches: int | None = None,
    ) -> None:
        # No decode graphs: a stage's forward ends in a send, which a graph cannot capture.
        super().__init__(
            model,
            pool,
            attn,
            sampler,  # type: ignore[arg-type]
            max_rows,
            max_pages,
            scratch_page=scratch_page,
        )
        self.comm = comm
        self.hidden_size = model.full_config.hidden_size
        self.vocab_size = model.full_config.vocab_size
        # Micro-batches per step: by default as many as stages, so that every stage has work
        # while the others do.
        self.micro_batches = comm.pp if micro_batches is None else micro_batches
        self._micro: list[MicroBatch] = []

    def run_stage(self, plan: StepPlan, staged: Staged | None = None) -> list[torch.Tensor]:
        """This stage's forward of ``plan``, micro-batch after micro-batch
        (:mod:`~radixserve.distributed.pipeline.micro`): each receives its input from the previous
        stage (unless first) and sends its output on (unless last); returns the outputs.
        ``staged``: the plan already uploaded (rank 0 adds its sampling inputs to the copy)."""
        t0, recv0 = time.perf_counter(), self.comm.stats.recv_seconds
        if staged is None:
            staged = self.staging.upload(self._stage(plan))
        outs = []
        with torch.inference_mode():
            self._patch_page_table(plan, staged)
            full = self._forward_batch(plan, staged, staged.i("input_ids"))
            for k, mb in enumerate(self._micro):
                batch = full
                if len(self._micro) > 1:
                    batch = sub_batch(full, mb, staged.i(f"mb{k}_logits"))
                hidden = None
                if not self.comm.is_first_stage:
                    hidden = self.comm.recv_hidden(mb.num_rows, self.hidden_size, self.model.dtype)
                self.attn.init_forward_metadata(batch)
                out = self.model.forward(batch, self.attn, hidden)
                if not self.comm.is_last_stage:
                    self.comm.send_hidden(out)
                elif self.comm.rank == self.comm.logits_src and self.comm.rank != 0:
                    self.comm.send_logits(out)
                outs.append(out)
        waited = self.comm.stats.recv_seconds - recv0
        self.comm.stats.compute_seconds += time.perf_counter() - t0 - waited
        return outs

    def _stage(self, plan: StepPlan) -> StagingLayout:
        """The plan's inputs, and per micro-batch the logits rows it computes (relative to its
        first row) and where they go in the step's logits (rank 0 reassembles them)."""
        layout = super()._stage(plan)
        self._micro = split_micro_batches(plan, self.micro_batches)
        if len(self._micro) > 1:
            for k, mb in enumerate(self._micro):
                layout.ints(
                    f"mb{k}_logits", [plan.logits_indices[i] - mb.row_lo for i in mb.logits]
                )
                layout.ints(f"mb{k}_select", mb.logits)
        return layout

    def serve(self, load_weights: Callable[[str], WeightCopy] | None = None) -> None:
        """A non-zero rank's loop: run every plan rank 0 broadcasts until it says stop.
        ``load_weights(path)``: this stage's share of a checkpoint, loaded and checked
        (:data:`UPDATE_WEIGHTS`; without it every update is refused)."""
        while True:
            payload = self.comm.broadcast_bytes(b"")  # the payload is rank 0's
            if payload == STOP:
                break
            if payload == REPORT_STATS:
                self.comm.report_stats()
                continue
            if payload == UPDATE_WEIGHTS:
                self._take_weights(load_weights)
                continue
            assert isinstance(payload, bytes)
            self.run_stage(decode_plan(payload))
            self.comm.stats.steps += 1
        self.comm.flush()

    def _take_weights(self, load_weights: Callable[[str], WeightCopy] | None) -> None:
        """This rank's part of :meth:`PipelineRunner.replace_weights`: load and check its
        share, vote, copy only if every rank could."""
        from radixserve.model.weight_update import follow_update

        payload = self.comm.broadcast_bytes(b"")
        assert isinstance(payload, bytes)
        path = payload.decode()

        def prepare() -> WeightCopy:
            if load_weights is None:
                raise ValueError("this rank cannot load weights")
            return load_weights(path)

        follow_update(prepare, self.comm.agree, f"pipeline rank refuses the weights at {path}")


class PipelineRunner(StageRunner):
    """Rank 0's runner: the engine's :class:`ModelRunner` for a pipeline of stages.

    :meth:`launch` broadcasts the plan, runs stage 0 micro-batch by micro-batch, waits for the
    last stage's logits and samples them. One step is in the pipe at a time (its micro-batches
    overlap across the stages): the step's result is complete when ``launch`` returns.
    """

    def __init__(
        self,
        model: LlamaPipelineStage,
        pool: KVPool,
        attn: AttentionBackend,
        sampler: Sampler,
        comm: PipelineComm,
        max_rows: int,
        max_pages: int,
        scratch_page: int,
        micro_batches: int | None = None,
        check_ranks: Callable[[], None] | None = None,
    ) -> None:
        """``scratch_page``: the page the warm-up writes (every rank's pool has it);
        ``check_ranks``: raises when a rank process has exited (the launcher's), called before
        each step's plan goes out. A rank that died between steps then fails the next step at
        once: a broadcast to it can wait the whole step timeout when the transport does not
        notice the closed connection first (seen on a loaded host)."""
        super().__init__(
            model, pool, attn, comm, max_rows, max_pages, sampler, scratch_page, micro_batches
        )
        self._last_host_tokens: list[int] = []
        self._check_ranks = check_ranks

    def launch(self, plan: StepPlan) -> PendingStep:
        """Run ``plan`` through every stage and sample on rank 0 (see the class docstring)."""
        input_ids = plan.input_ids
        if plan.future_rows:  # tokens of the step before, which rank 0 has on the host
            input_ids = list(input_ids)
            for row, src in zip(plan.future_rows, plan.future_src, strict=True):
                input_ids[row] = self._last_host_tokens[src]
        fwd = plan if input_ids is plan.input_ids else _with_inputs(plan, input_ids)
        if self._check_ranks is not None:
            self._check_ranks()
        self.comm.broadcast_bytes(encode_plan(fwd))
        self.comm.stats.steps += 1
        layout = self._stage(fwd)
        splan = self.sampler.prepare(plan.sample_rows, layout) if plan.sample_rows else None
        staged = self.staging.upload(layout)  # one copy: the forward's and the sampler's inputs
        self.run_stage(fwd, staged)
        parts = [self.comm.recv_logits(len(mb.logits), self.vocab_size) for mb in self._micro]
        t_sample = time.perf_counter()
        ns = len(plan.sample_rows)
        reads: list[torch.Tensor] = []
        with torch.inference_mode():
            if len(parts) == 1:
                logits = parts[0].to(self.device)
            else:  # back in the plan's order: sample rows first, then prompt-logprob rows
                logits = torch.empty(len(plan.logits_indices), self.vocab_size, device=self.device)
                for k, part in enumerate(parts):
                    logits.index_copy_(0, staged.i(f"mb{k}_select"), part.to(self.device))
            if splan is not None:
                sampled = self.sampler.sample_staged(logits[:ns], splan, staged)
                reads += list(sampled)
            if plan.prompt_targets:
                reads += prompt_reads(logits[ns:], plan, staged)
        pending = PendingStep(self.staging.read_async(reads), splan, plan)
        result = pending.result()
        self.comm.stats.compute_seconds += time.perf_counter() - t_sample
        self._last_host_tokens = list(result.token_ids)
        return _Done(result)

    def replace_weights(self, path: str, prepare: Callable[[], WeightCopy]) -> int:
        """New weights on every stage, all or none: every rank loads and checks its share
        (``prepare``, rank 0's), all vote, then each copies; rank 0's bytes copied.
        ``ValueError`` (no rank changed) where any rank could not. Between steps only."""
        from radixserve.model.weight_update import lead_update

        self.comm.broadcast_bytes(UPDATE_WEIGHTS)
        self.comm.broadcast_bytes(path.encode())
        return lead_update(prepare, self.comm.agree, "pipeline")

    def shutdown(self) -> None:
        """Tell every other rank to leave its loop."""
        self.comm.broadcast_bytes(STOP)
        self.comm.flush()


def _with_inputs(plan: StepPlan, input_ids: list[int]) -> StepPlan:
    return dataclasses.replace(plan, input_ids=input_ids, future_rows=[], future_src=[])
