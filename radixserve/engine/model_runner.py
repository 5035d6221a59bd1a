"""The model runner: everything on the device, driven by the scheduler's host-side plans.

The runner owns the device state of one worker: the model's weights, the KV pool tensors,
the attention backend, the persistent device page table, the sampler and the staging
buffers. The scheduler never touches a tensor; each step it hands over one
:class:`~radixserve.scheduling.plan.StepPlan` (plain lists) and gets back a
:class:`~radixserve.scheduling.plan.StepResult` (plain lists)::

    StepPlan (host lists)
      │ pack: ids, positions, slots, lengths, logits rows, page-table changes, sampling inputs
      ▼
    one host->device copy ──> device views ──> page_table[rows, cols] = pages   (patch, never rebuild)
                                                 ForwardBatch ──> attn.init_forward_metadata
                                                 model.forward ──> sampler (device only)
      ┌──────────────────────────────────────────────┘
      ▼
    one device->host read: sampled tokens (+ logprobs, prompt logprobs) ──> StepResult

``transfers`` counts both copies (see :mod:`~radixserve.engine.staging`); nothing else in a
step moves data between host and device or waits for the device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

import radixserve.distributed.step_wire as step_wire
from radixserve.engine.decode_graphs import DecodeGraphs
from radixserve.engine.sampler import (
    SAMPLE_READS,
    Sampler,
    SamplingPlan,
    padded_ids,
    prompt_logprob_count,
    prompt_logprob_reads,
    unpack_prompt_logprobs,
    unpack_samples,
)
from radixserve.engine.staging import (
    PendingRead,
    Staged,
    StagingBuffer,
    StagingLayout,
    TransferCounter,
)
from radixserve.engine.window_view import patch_window_host, window_view
from radixserve.memory.pool import KVPool
from radixserve.model.attention.base import AttentionBackend
from radixserve.model.cpu_linear import RowInvariantLinears
from radixserve.model.forward_batch import ForwardBatch
from radixserve.model.lora import LoraRegistry
from radixserve.sampling_params import SamplingParams
from radixserve.scheduling.plan import StepPlan, StepResult

if TYPE_CHECKING:
    from radixserve.engine.config import EngineConfig
    from radixserve.model.llama import LlamaForCausalLM

__all__ = [
    "WARM_PREFILL_LENGTHS",
    "ModelRunner",
    "PendingStep",
    "PlanSender",
    "kv_pool_args",
    "make_attention_backend",
]


class PlanSender(Protocol):
    """Where rank 0's runner sends each step for the other tensor-parallel ranks."""

    def send(self, msg: step_wire.StepMessage) -> None: ...


# Prompt lengths a warm start prefills once: within one page, over several pages, a long
# prompt's attention and matmul shapes. (On the CPU, once one prefill has run, a new length
# measured no dearer than a repeated one; the GPU's kernels are built per shape class.)
WARM_PREFILL_LENGTHS: tuple[int, ...] = (4, 64, 256)


class PendingStep:
    """A launched step; :meth:`result` waits for its one read back and unpacks it."""

    def __init__(self, read: PendingRead, splan: SamplingPlan | None, plan: StepPlan) -> None:
        self._read = read
        self._splan = splan
        # The prompt logprobs' top-k, None when the step scores no prompt token.
        self._prompt_k = plan.prompt_top_k if plan.prompt_targets else None
        self._prompt_asked = plan.prompt_asked
        self._embeds = len(plan.embed_rows)  # rows of final-norm outputs read back
        self._hidden = len(plan.hidden_rows)

    def result(self) -> StepResult:
        host = self._read.wait()
        tokens: list[int] = []
        logprobs: list = []
        n = 0
        if self._splan is not None:
            sampled = unpack_samples(self._splan, host[:SAMPLE_READS])
            tokens, logprobs = sampled.token_ids, sampled.logprobs
            n = SAMPLE_READS
        embeddings = _rows(host[n], self._embeds) if self._embeds else []
        n += bool(self._embeds)
        hidden = _rows(host[n], self._hidden) if self._hidden else []
        if self._prompt_k is None:
            return StepResult(tokens, logprobs, [], embeddings=embeddings, hidden_states=hidden)
        tail = host[len(host) - prompt_logprob_count(self._prompt_k, bool(self._prompt_asked)) :]
        prompt = unpack_prompt_logprobs(tail, self._prompt_k, self._prompt_asked)
        return StepResult(tokens, logprobs, *prompt, embeddings=embeddings, hidden_states=hidden)


def _rows(flat: list[float], rows: int) -> list[list[float]]:
    """A read-back ``[rows, size]`` tensor's flat values as its rows."""
    size = len(flat) // rows
    return [flat[i : i + size] for i in range(0, len(flat), size)]


def prompt_reads(logits: torch.Tensor, plan: StepPlan, staged: Staged) -> list[torch.Tensor]:
    """What a step reads back for its prompt-logprob rows (``logits``: theirs, after the
    sampled rows'): :func:`prompt_logprob_reads` of the staged targets and asked-for tokens."""
    asked = None
    if plan.prompt_asked:
        asked = staged.i("lp_asked").view(len(plan.prompt_asked), -1)
    return prompt_logprob_reads(logits, staged.i("lp_targets"), plan.prompt_top_k, asked)


def kv_pool_args(model: LlamaForCausalLM, cfg: EngineConfig, device: torch.device) -> dict:
    """A :class:`KVPool`'s arguments but its size, for ``model``'s share of the layers and KV
    heads on this rank (the whole model without tensor or pipeline parallelism). Every rank
    builds its pool from these, so the page layout is the same everywhere."""
    lc = model.local_config
    return {
        "num_layers": getattr(model, "num_local_layers", lc.num_layers),
        "page_size": cfg.page_size,
        "kv_heads": lc.num_kv_heads,
        "head_dim": lc.head_dim,
        "kv_dtype": cfg.kv_cache_dtype,
        "act_dtype": cfg.torch_dtype,
        "device": device,
    }


def make_attention_backend(name: str, pool: KVPool) -> AttentionBackend:
    """``"torch"`` (runs anywhere) or ``"triton"`` (GPU, or the interpreter on CPU)."""
    if name == "torch":
        from radixserve.model.attention.torch_paged import TorchPagedAttentionBackend

        return TorchPagedAttentionBackend(pool)
    try:
        from radixserve.model.attention.triton_paged import TritonPagedAttentionBackend
    except ImportError as e:
        raise ValueError(f"attention_backend 'triton' is not available: {e}") from e
    return TritonPagedAttentionBackend(pool)


def check_backend_serves(model: torch.nn.Module, attn: AttentionBackend) -> None:
    """Refuse, at start-up, a backend that would attend ``model``'s layers wrongly: one
    without attention sinks for a model that has them (gpt-oss on the Triton kernels)."""
    cfg = getattr(model, "config", None)
    if cfg is not None and getattr(cfg, "attn_sinks", False) and not attn.supports_sinks:
        raise ValueError(
            f"{cfg.model_type} has attention sinks, which the {type(attn).__name__} does not "
            "apply; use attention_backend 'torch' (the CPU kernel or torch paths)"
        )


class ModelRunner:
    """Executes step plans on one device (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        pool: KVPool,
        attn: AttentionBackend,
        sampler: Sampler,
        max_rows: int,
        max_pages: int,
        decode_graphs: bool = False,
        scratch_page: int | None = None,
        capture_graphs: bool = True,
    ) -> None:
        """``max_rows``: running requests at most (page-table rows); ``max_pages``: pages of
        the longest context (page-table width). ``decode_graphs``: decode-only steps run from
        static buffers padded to batch-size buckets (:mod:`~radixserve.engine.decode_graphs`),
        their padding rows (and the warm-up) writing to ``scratch_page`` (a pool page no request
        may hold);
        captured as CUDA graphs by :meth:`warm_up` where the device and backend allow and
        ``capture_graphs`` (tensor parallelism: only with ``tp_graph_capture``)."""
        check_backend_serves(model, attn)
        self.model = model
        self.pool = pool
        self.attn = attn
        self.sampler = sampler
        self.device = pool.device
        self.page_size = pool.page_size
        # Row r holds the pages of the request the scheduler gave row r, in order.
        self.page_table = torch.zeros(
            max_rows, max(1, max_pages), dtype=torch.int32, device=self.device
        )
        self.transfers = TransferCounter()
        self.staging = StagingBuffer(self.device, self.transfers)
        self.scratch_page = scratch_page
        # The other tensor-parallel ranks (rank 0 only; set after the warm-up, which every
        # rank runs on its own): each launched plan is sent to them first.
        self.followers: PlanSender | None = None
        self._last_tokens: torch.Tensor | None = (
            None  # the last launched step's sampled tokens (device)
        )
        # Steps whose plan names each row's linear kernel (plan.row_paths: speculative
        # decoding; cpu_linear.RowInvariantLinears); None off the CPU.
        self.row_invariant: RowInvariantLinears | None = None
        if self.device.type == "cpu":
            self.row_invariant = RowInvariantLinears(model)
        # A window pool (memory.window_pool): use_window_pool sets these.
        self.window_map: torch.Tensor | None = None
        self._window_host: list[int] = []
        self._window = 0
        self.decode_graphs: DecodeGraphs | None = None
        if decode_graphs:
            if scratch_page is None:
                raise ValueError("decode_graphs needs a scratch page for the padding rows")
            capture = (
                capture_graphs
                and self.device.type == "cuda"
                and getattr(attn, "supports_graph_capture", False)
            )
            self.decode_graphs = DecodeGraphs(
                model.forward,
                attn,
                self.page_table,
                scratch_page,
                self.page_size,
                max_rows,
                capture,
            )

    def use_window_pool(self, window: int) -> None:
        """The pool keeps its window layers' KV in a window pool: keep the device map from
        global to window pages (patched from each plan's ``window_writes``) and give each
        forward a window view (:mod:`radixserve.engine.window_view`)."""
        assert self.pool.window_layers
        self.decode_graphs = None  # their static buffers hold no window map: eager decode steps
        scratch = self.pool.num_window_pages - 1  # the window pool's scratch page
        n = self.pool.num_pages
        self.window_map = torch.full((n,), scratch, dtype=torch.int64, device=self.device)
        self._window_host = [scratch] * n
        self._window = window

    @staticmethod
    def from_config(
        model: LlamaForCausalLM,
        pool: KVPool,
        cfg: EngineConfig,
        max_rows: int,
        max_pages: int,
        scratch_page: int | None = None,
    ) -> ModelRunner:
        """The engine's runner over ``pool``: the configured attention backend, a sampler
        seeded with ``cfg.seed``, decode graphs as configured when there is a ``scratch_page``
        (every tensor-parallel rank builds the same one; the memory profile's has none)."""
        mc = model.config
        return ModelRunner(
            model,
            pool,
            make_attention_backend(cfg.resolved_attention_backend, pool),
            Sampler(mc.vocab_size, mc.eos_token_ids, pool.device, cfg.seed),
            max_rows=max_rows,
            max_pages=max_pages,
            decode_graphs=cfg.use_decode_graphs and scratch_page is not None,
            scratch_page=scratch_page,
            capture_graphs=cfg.capture_decode_graphs,
        )

    def set_attention_backend(self, attn: AttentionBackend) -> None:
        """Swap the attention backend (tests compare backends on one engine)."""
        check_backend_serves(self.model, attn)
        self.attn = attn
        if self.decode_graphs is not None:
            self.decode_graphs.attn = attn

    def warm_up(
        self,
        max_seq_len: int,
        prefill_lengths: Sequence[int] = WARM_PREFILL_LENGTHS,
        max_step_tokens: int = 0,
    ) -> None:
        """Everything a first request would otherwise pay for, before the worker says it is
        ready: the decode graphs captured (CUDA); prefills of ``prefill_lengths`` tokens (those
        that fit ``max_seq_len``), then one greedy and one sampled decode step, run through the
        whole path (lazy allocations, library initialisations, new matmul shapes, the sampler's
        greedy and filtered paths, the static decode buffers), writing only to the scratch page;
        under an interpreter (Triton's on the CPU: nothing to compile) only the 4-token prefill.
        A backend with kernel variants chosen at run time (Triton: the decode split count by
        batch size) first launches every variant (:func:`~radixserve.model.warmup.warm_up_model`,
        on pool pages no request holds yet). On the CPU, oneDNN's kernel for every padded row
        count of a step of up to ``max_step_tokens`` tokens (the LM head's: of up to one row per
        running request) is built (:func:`~radixserve.model.cpu_linear.warm_onednn`; 0: none;
        ``RADIXSERVE_ONEDNN_WARMUP=0``: none either)."""
        if max_step_tokens and self.pool.device.type == "cpu":
            from radixserve.model import cpu_linear

            if cpu_linear.warm_up_enabled():
                rows = self.page_table.shape[0]
                cpu_linear.warm_onednn(self.model, max_step_tokens, head_rows=rows)
        if hasattr(self.attn, "decode_batch_sizes"):
            from radixserve.model.warmup import warm_up_model

            warm_up_model(self.model, self.attn, self.pool, max_batch_size=self.page_table.shape[0])
        if self.decode_graphs is not None and self.decode_graphs.capture:
            self.decode_graphs.capture_all(max_seq_len)
        if self.scratch_page is None:
            return
        from radixserve.sampling_params import SamplingParams

        width = self.page_table.shape[1] * self.page_size
        if self.attn.interpreted:  # each program runs in numpy: 4 tokens take every path
            prefill_lengths = ()
        lengths = sorted({n for n in prefill_lengths if n < min(max_seq_len, width)} | {4})
        greedy = SamplingParams(max_tokens=2, temperature=0.0)
        sampled = SamplingParams(max_tokens=2, temperature=0.7, top_k=40, top_p=0.9, min_p=0.01)
        for n in lengths:
            self.execute(self._scratch_plan(n, 0, greedy))
        for params in (greedy, sampled):  # a decode over the shortest prefill
            self.execute(self._scratch_plan(1, lengths[0], params))
        self.transfers.h2d = self.transfers.d2h = self.transfers.h2d_bytes = (
            self.transfers.d2h_bytes
        ) = 0

    def _scratch_plan(self, extend: int, prefix: int, params: SamplingParams) -> StepPlan:
        """A one-row step of ``extend`` new tokens after ``prefix`` cached ones whose every
        K/V slot is on the scratch page (slots repeat when the tokens outnumber the page):
        shapes and code paths of a real step, state of no request."""
        from radixserve.scheduling.request import Request

        ps, scratch, total = self.page_size, self.scratch_page, prefix + extend
        assert scratch is not None
        pages = [scratch] * -(-total // ps)
        row = Request("warm-up", [0] * total, total, params, total + 2)
        return StepPlan(
            input_ids=[0] * extend,
            positions=list(range(prefix, total)),
            out_slots=[scratch * ps + p % ps for p in range(prefix, total)],
            table_rows=[0],
            prefix_lens=[prefix],
            extend_lens=[extend],
            seq_lens=[total],
            page_lists=[pages],
            write_rows=[0] * len(pages),
            write_cols=list(range(len(pages))),
            write_pages=pages,
            logits_indices=[extend - 1],
            sample_rows=[row],
            prompt_targets=[],
            future_rows=[],
            future_src=[],
        )

    # ------------------------------------------------------------------ one step

    def execute(self, plan: StepPlan) -> StepResult:
        """Run ``plan``'s forward and sampling: one copy in, one read back."""
        return self.launch(plan).result()

    def launch(self, plan: StepPlan) -> PendingStep:
        """Start ``plan``'s step; its results come with :meth:`PendingStep.result` (on CUDA the
        host is free to plan the next step meanwhile). The next plan may name this step's
        sampled tokens as inputs (``future_rows``): they are read from the device, not the host.

        With tensor-parallel ``followers`` the plan and the sampler's staged inputs go to the
        other ranks first (:mod:`~radixserve.distributed.step_wire`); they run the same device half."""
        layout = self._stage(plan)
        sampling: StagingLayout | None = None
        splan = None
        if plan.sample_rows:
            sampling = StagingLayout()
            splan = self.sampler.prepare(plan.sample_rows, sampling, plan.sample_drafts)
            layout.merge(sampling)
        if self.followers is not None:
            self.followers.send(step_wire.step_message(plan, sampling, splan))
        return self._launch_staged(plan, layout, splan, len(plan.sample_rows))

    def launch_message(self, msg: step_wire.StepMessage) -> PendingStep:
        """Run a step rank 0 planned (a rank other than 0: the same device half as rank 0)."""
        plan = step_wire.plan_of(msg)
        layout = self._stage(plan)
        if msg.sampling is not None:
            layout.merge(StagingLayout.from_fields(msg.sampling))
        return self._launch_staged(plan, layout, msg.sampling_plan, msg.num_sample)

    def _launch_staged(
        self, plan: StepPlan, layout: StagingLayout, splan: SamplingPlan | None, ns: int
    ) -> PendingStep:
        """The device half of a step: one upload, the forward, the sampling, one read back."""
        staged = self.staging.upload(layout)
        graphs = self.decode_graphs
        static = (
            graphs is not None
            and plan.is_decode_only
            and not plan.prompt_targets
            and not plan.embed_rows  # a captured forward keeps no hidden states
            and not plan.hidden_rows
            and plan.lora_slots is None  # a captured forward adds no adapter's deltas
            and graphs.bucket_for(plan.batch_size) is not None
        )
        with torch.inference_mode():
            self._patch_page_table(plan, staged)
            input_ids = staged.i("input_ids")
            if plan.future_rows:
                assert self._last_tokens is not None, (
                    "a plan names tokens of a step that sampled none"
                )
                src = self._last_tokens.index_select(0, staged.i("f_src"))
                input_ids = input_ids.index_copy(0, staged.i("f_rows"), src)
            if static:
                assert graphs is not None and ns == plan.batch_size  # every decode row samples
                logits = graphs.run(plan, staged, input_ids)
            else:
                batch = self._forward_batch(plan, staged, input_ids)
                batch.keep_hidden = bool(plan.embed_rows or plan.hidden_rows)
                self.attn.init_forward_metadata(batch)
                logits = self._forward(batch, plan, staged)
            reads: list[torch.Tensor] = []
            if splan is not None:
                sampled = self.sampler.sample_staged(logits[:ns], splan, staged)
                self._last_tokens = sampled.token_ids
                reads += list(sampled)
            if plan.embed_rows:  # read before the prompt logprobs, which are read from the end
                assert batch.hidden is not None, "the model kept no hidden states"
                reads.append(self._pooled(batch.hidden[plan.embed_rows]).float())
            if plan.hidden_rows:  # indexed by a host list, as the embeddings are
                assert batch.hidden is not None, "the model kept no hidden states"
                reads.append(batch.hidden[plan.hidden_rows].float())
            if plan.prompt_targets:
                lp_rows = logits[ns : ns + len(plan.prompt_targets)]
                reads += prompt_reads(lp_rows, plan, staged)
            pending = self.staging.read_async(reads)
        return PendingStep(pending, splan, plan)

    def _pooled(self, rows: torch.Tensor) -> torch.Tensor:
        """The embeddings of the final norm's ``rows``: the model's pooling (a classifier's
        score head: LlamaForCausalLM.pooled), or the rows as they are for a model without."""
        pooled: Callable[[torch.Tensor], torch.Tensor] | None = getattr(self.model, "pooled", None)
        return rows if pooled is None else pooled(rows)

    def row_invariance_problem(self) -> str | None:
        """Why verify rows' logits could differ from one-row decode steps' here (None: they
        cannot; speculative decoding relies on it)."""
        if self.row_invariant is None:
            return f"the {self.device.type} device (row-invariant paths exist on the CPU only)"
        if not self.row_invariant.complete:
            return "linear layers without the CPU GEMV kernel (not built, quantized, or a oneDNN-only head)"
        if not getattr(self.attn, "row_exact", False):
            return "an attention path whose rows depend on the batch (the native CPU kernel is not in use)"
        return None

    def _forward(self, batch: ForwardBatch, plan: StepPlan, staged: Staged) -> torch.Tensor:
        """The model's forward; where the plan names each row's linear kernel (speculative
        decoding), on those kernels, so that no row's logits depend on the others."""
        inv = self.row_invariant if plan.row_paths is not None else None
        if inv is None:
            return self.model.forward(batch, self.attn)
        assert plan.row_paths is not None
        gemv, onednn = plan.row_paths
        if gemv and onednn:
            inv.on((staged.i("rp_gemv"), staged.i("rp_onednn")))
        else:
            inv.on("gemv" if gemv else "onednn")
        try:
            return self.model.forward(batch, self.attn)
        finally:
            inv.off()

    def _stage(self, plan: StepPlan) -> StagingLayout:
        layout = StagingLayout()
        layout.ints("input_ids", plan.input_ids)
        layout.ints("positions", plan.positions)
        layout.ints("out_slots", plan.out_slots)
        layout.ints("table_rows", plan.table_rows)
        layout.ints("seq_lens", plan.seq_lens)
        layout.ints("extend_lens", plan.extend_lens)
        layout.ints("prefix_lens", plan.prefix_lens)
        starts, t = [], 0
        for n in plan.extend_lens:
            starts.append(t)
            t += n
        layout.ints("extend_start", starts)
        layout.ints("logits_indices", plan.logits_indices)
        if plan.write_rows:
            layout.ints("w_rows", plan.write_rows)
            layout.ints("w_cols", plan.write_cols)
            layout.ints("w_pages", plan.write_pages)
        if plan.prompt_targets:
            layout.ints("lp_targets", plan.prompt_targets)
        if plan.prompt_asked:
            layout.ints("lp_asked", padded_ids(plan.prompt_asked))
        if plan.future_rows:
            layout.ints("f_rows", plan.future_rows)
            layout.ints("f_src", plan.future_src)
        if plan.row_paths is not None and plan.row_paths[0] and plan.row_paths[1]:
            layout.ints("rp_gemv", plan.row_paths[0])
            layout.ints("rp_onednn", plan.row_paths[1])
        if plan.window_writes is not None and plan.window_writes[0]:
            g, w = plan.window_writes
            w = patch_window_host(self._window_host, g, w, self.pool.num_window_pages - 1)
            layout.ints("ww_g", g)
            layout.ints("ww_w", w)
        return layout

    def _patch_page_table(self, plan: StepPlan, staged: Staged) -> None:
        if self.window_map is not None and "ww_g" in staged:
            self.window_map[staged.i("ww_g")] = staged.i("ww_w")
        if plan.write_rows:
            self.page_table[staged.i("w_rows"), staged.i("w_cols")] = staged.i("w_pages").to(
                torch.int32
            )

    def _forward_batch(
        self, plan: StepPlan, staged: Staged, input_ids: torch.Tensor
    ) -> ForwardBatch:
        max_pages = -(-max(plan.seq_lens) // self.page_size)
        i32 = torch.int32
        batch = ForwardBatch(
            input_ids=input_ids,
            positions=staged.i("positions"),
            seq_lens=staged.i("seq_lens").to(i32),
            extend_lens=staged.i("extend_lens").to(i32),
            prefix_lens=staged.i("prefix_lens").to(i32),
            extend_start_loc=staged.i("extend_start").to(i32),
            logits_indices=staged.i("logits_indices"),
            seq_lens_cpu=plan.seq_lens,
            extend_lens_cpu=plan.extend_lens,
            out_cache_loc=staged.i("out_slots"),
            page_table=self.page_table.index_select(0, staged.i("table_rows"))[:, :max_pages],
            page_size=self.page_size,
            page_lists_cpu=plan.page_lists,
        )
        if plan.lora_slots is not None:
            lora: LoraRegistry | None = getattr(self.model, "lora", None)
            assert lora is not None, "a plan names LoRA adapters; none is served"
            batch.lora = lora.rows(plan.lora_slots, plan.extend_lens, self.device)
        if self.window_map is not None:
            batch.window_view = window_view(
                batch, plan, self.window_map, self._window_host, self._window
            )
        return batch

    # ------------------------------------------------------------------ checks

    def page_table_row(self, row: int, n: int) -> list[int]:
        """The first ``n`` entries of a page-table row (invariant checks; reads the device)."""
        return self.page_table[row, :n].tolist()
