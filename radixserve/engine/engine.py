"""The offline engine: model + KV pool + radix cache + scheduler, in one process.

Two ways to drive it:

- ``generate(prompts, params)``: run a batch to completion and get texts back (stop
  strings handled by the incremental detokenizer).
- ``add_request`` / ``step`` / ``abort``: the streaming interface the serving worker and
  the in-process DSL backend drive; each ``step`` runs one scheduler step and returns a
  :class:`StepOutput` per request that progressed. No text here: callers detokenize with
  :class:`~radixserve.engine.detokenizer.IncrementalDetokenizer`.

Example::

    engine = Engine("default", page_size=16, max_num_tokens=1024)
    out = engine.generate(["The capital of France is"], SamplingParams(max_tokens=16, temperature=0))
    print(out[0].text, out[0].usage)
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import radixserve.engine.kv_profile as kv_profile
from radixserve.engine.config import EngineConfig
from radixserve.engine.detokenizer import IncrementalDetokenizer
from radixserve.engine.devices import bind_device
from radixserve.engine.kv_profile import ProfiledKV
from radixserve.engine.model_runner import ModelRunner, kv_pool_args
from radixserve.engine.outputs import EngineStats, GenerateOutput, StepOutput, TokenLogprob, Usage
from radixserve.engine.pipeline.launch import PipelineLaunch
from radixserve.engine.ranks import RankGroup, rank_threads
from radixserve.engine.sampler import Sampler
from radixserve.engine.startup import StartupClock, describe_startup
from radixserve.engine.step_loop import StepLoop
from radixserve.engine.step_wire import RankInit, rank_settings
from radixserve.memory import NoPrefixCache, PrefixCache, RadixCache
from radixserve.memory.allocator import PageAllocator
from radixserve.memory.pool import KVPool
from radixserve.model.attention.base import AttentionBackend
from radixserve.sampling_params import SamplingInput, SamplingParams, per_prompt
from radixserve.scheduling.request import Request
from radixserve.scheduling.scheduler import RequestOutput, Scheduler, SchedulerConfig

logger = logging.getLogger(__name__)

# Default KV pool on a CPU when neither num_pages nor memory_budget is given.
CPU_DEFAULT_KV_BYTES = 1 << 30

PromptInput = str | Sequence[str] | Sequence[Sequence[int]] | Sequence[int]


def setup_cpu_threads(num_threads: int | None) -> None:
    """CPU start-up: an explicit thread count. (OpenMP's waiting, passive after ~1 ms of
    spinning, is set by importing :mod:`radixserve`, before torch loads the OpenMP runtime,
    which reads it only then.)"""
    if num_threads is not None:
        torch.set_num_threads(num_threads)


def model_identity(model_path: Path) -> str:
    """Names a checkpoint in KV page keys: its path, and the size and mtime of its files, so
    that pages stored for replaced weights are never read back for the new ones."""
    parts = [str(Path(model_path).resolve())]
    try:
        for f in sorted(Path(model_path).iterdir()):
            if f.is_file():
                st = f.stat()
                parts.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    except OSError:
        pass
    return hashlib.blake2b("|".join(parts).encode(), digest_size=16).hexdigest()


class Engine:
    """A prefix-caching LLM engine on one device (see the module docstring).

    ``model``: ``None``/``"default"`` (SmolLM2-135M-Instruct, fetched on first use) or a
    local Hugging Face checkpoint directory. ``config``: :class:`EngineConfig` fields.

    ``tensor_parallel_size=N`` (N > 1): this process is rank 0 and starts ranks 1..N-1 (on
    ``nnodes`` hosts, see :mod:`~radixserve.engine.ranks`); call :meth:`close` to stop them.
    """

    def __init__(self, model: str | Path | None = None, **config: Any) -> None:
        from radixserve.model_store import resolve_model

        clock = StartupClock()
        self.config = cfg = EngineConfig.from_kwargs(**config)
        tp_size = cfg.tensor_parallel_size
        if cfg.node_rank != 0:
            raise ValueError(
                "node_rank > 0 runs only rank loops (engine.ranks.run_node), not an Engine"
            )
        self.model_path = resolve_model(None if model is None else str(model))
        # Tensor parallelism: this process is rank 0; the other ranks start now and load
        # their shards while this one loads its own (engine.ranks).
        self.ranks: RankGroup | None = None
        # Pipeline parallelism (engine.pipeline): likewise, each stage a tensor-parallel group.
        self.pipeline: PipelineLaunch | None = None
        if cfg.pipeline_parallel_size > 1:
            self.pipeline = PipelineLaunch.from_config(cfg, self.model_path, config)
        elif tp_size > 1:
            self.ranks = RankGroup(cfg, self.model_path)
        try:
            self._build(cfg, clock)
        except BaseException:
            self.close()
            raise

    def _build(self, cfg: EngineConfig, clock: StartupClock) -> None:
        from transformers import AutoTokenizer

        from radixserve.model.loader import load_model

        ranks, pipe = self.ranks, self.pipeline
        if torch.device(cfg.device).type == "cpu":
            pc = ranks.pc if ranks is not None else (pipe.pc if pipe is not None else None)
            setup_cpu_threads(cfg.num_threads if pc is None else rank_threads(cfg, pc))
        self.device = (
            ranks.device
            if ranks is not None
            else pipe.device
            if pipe is not None
            else torch.device(cfg.device)
        )
        bind_device(self.device)  # cuda:N: Triton launches and index-less allocations go there
        clock.lap("resolve model")
        # Free device memory before the weights: the most this engine may take (kv_profile).
        # (Tensor parallel: the planner sizes the pool, from rank 0's shard, the largest; a
        # profile run would need every rank in its forward. Likewise every pipeline stage.)
        self._device_memory: kv_profile.DeviceMemory | None = None
        if cfg.num_pages is None and cfg.memory_budget is None and ranks is None and pipe is None:
            self._device_memory = kv_profile.device_memory(self.device)
        self._free_at_start = 0 if self._device_memory is None else self._device_memory.free()
        self.model = load_model(
            self.model_path,
            dtype=cfg.torch_dtype,
            device=self.device,
            quantization=cfg.quant_config(),
            tp=ranks.tp if ranks is not None else (pipe.tp_group if pipe is not None else None),
            stage=None if pipe is None else pipe.stage,
        )
        clock.lap("load weights")
        self.model_config = mc = self.model.config
        if cfg.max_model_len is not None and cfg.max_model_len > mc.max_position_embeddings:
            # RoPE past the trained positions extrapolates silently: refuse, as vLLM does.
            raise ValueError(
                f"max_model_len {cfg.max_model_len} exceeds the model's max_position_embeddings "
                f"({mc.max_position_embeddings})"
            )
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_path))
        clock.lap("tokenizer")

        # This rank's share of the model (the whole model without tensor parallelism).
        self.local_model_config = self.model.local_config
        # The pool's arguments but its size (the profile run builds a small pool of its own).
        self._pool_args: dict[str, Any] = kv_pool_args(self.model, cfg, self.device)
        # How the pool was sized (profile run, planner or given), in words; see kv_profile.
        self.kv_sizing: str = f"KV pool {cfg.num_pages} pages (num_pages given)"
        self.kv_profile: ProfiledKV | None = None
        num_pages = cfg.num_pages if cfg.num_pages is not None else self._size_kv_pool()
        logger.info("%s", self.kv_sizing)
        clock.lap("KV sizing")
        # One page past the allocator's: the scratch page padding rows of static decode steps write to.
        pool = KVPool(num_pages=num_pages + 1, **self._pool_args)
        self.allocator = PageAllocator(num_pages)
        self.cache: PrefixCache = self._make_cache(pool)
        self.cache.pins.budget_pages = int(num_pages * cfg.pin_budget_fraction)
        if cfg.kv_events_endpoint is not None:
            self.enable_kv_events(pool)
        max_model_len = cfg.max_model_len or mc.max_position_embeddings
        self.max_total_len = min(max_model_len, num_pages * cfg.page_size)
        sched_cfg = SchedulerConfig(
            **{
                **cfg.scheduling_fields(),
                # Every running request decodes one token per step out of the budget.
                "max_running_requests": min(cfg.max_running_requests, cfg.max_num_tokens),
                "max_total_len": self.max_total_len,
            }
        )
        self.scheduler = Scheduler(sched_cfg, self.cache, self.allocator, mc.eos_token_ids)
        clock.lap("KV pool")
        if pipe is not None:
            self.runner: ModelRunner = pipe.make_runner(
                self.model,
                pool,
                cfg,
                num_pages=num_pages,
                max_rows=sched_cfg.max_running_requests,
                max_pages=self.scheduler.max_pages_per_request,
            )
        else:
            self.runner = ModelRunner.from_config(
                self.model,
                pool,
                cfg,
                max_rows=sched_cfg.max_running_requests,
                max_pages=self.scheduler.max_pages_per_request,
                scratch_page=num_pages,
            )
        clock.lap("attention backend and CPU kernels")
        if ranks is not None:  # every rank builds the same pool and runner, and warms up with us
            ranks.start(
                RankInit(
                    num_pages + 1,
                    sched_cfg.max_running_requests,
                    self.scheduler.max_pages_per_request,
                    num_pages,
                    self.max_total_len,
                    rank_settings(cfg),
                )
            )
            clock.lap("tensor-parallel ranks ready")
        self.runner.warm_up(self.max_total_len)
        if ranks is not None:
            self.runner.followers = ranks.channel  # from now on each step goes to every rank
        clock.lap("warm-up (graph capture, first forwards)")
        # Where start-up went, in order (seconds); `radixserve serve` prints it.
        self.startup_seconds: dict[str, float] = clock.laps
        self.loop = StepLoop(
            self.scheduler,
            self.runner,
            overlap=cfg.use_overlap,
            on_error=self._rank_error if ranks is not None or pipe is not None else None,
        )
        self._buffered: list[StepOutput] = []  # other requests' outputs seen inside generate()
        logger.info(
            "engine ready in %s: %s, %s, max_total_len=%d; %s",
            describe_startup(self.startup_seconds),
            self.model_path,
            self.pool,
            self.max_total_len,
            self.kv_sizing,
        )

    def _make_cache(self, pool: KVPool) -> PrefixCache:
        """The prefix cache: none, the radix cache, or the radix cache over L2/L3 tiers."""
        cfg = self.config
        if cfg.disable_radix_cache:
            return NoPrefixCache(self.allocator, cfg.page_size)
        if not cfg.hierarchical_cache:
            return RadixCache(self.allocator, cfg.page_size)
        from radixkernels.kv_format import KVFormat
        from radixserve.memory.hi_radix_cache import HiRadixCache
        from radixserve.memory.hierarchy import KVHierarchy
        from radixserve.memory.kv_convert import host_format

        kv_dtype, act_dtype = host_format(pool, cfg.hicache_dtype)
        host_page_bytes = (
            KVFormat.create(kv_dtype, act_dtype, pool.head_dim).bytes_per_token(
                pool.num_layers, pool.kv_heads
            )
            * pool.page_size
        )
        if cfg.hicache_size is not None:
            host_pages = max(1, int(cfg.hicache_size * 2**30) // host_page_bytes)
        else:  # SGLang's default host/device ratio
            host_pages = 2 * self.allocator.num_pages
        hierarchy = KVHierarchy(
            pool,
            host_pages,
            cfg.hicache_storage_dir,
            model_identity(self.model_path),
            host_dtype=cfg.hicache_dtype,
        )
        logger.info(
            "hierarchical cache: L2 %d pages (%.2f GiB, %s), L3 %s",
            host_pages,
            host_pages * host_page_bytes / 2**30,
            hierarchy.host.pool.fmt.kv_dtype.value
            if kv_dtype.is_quantized
            else str(act_dtype).removeprefix("torch."),
            cfg.hicache_storage_dir or "off",
        )
        return HiRadixCache(self.allocator, cfg.page_size, hierarchy)

    def enable_kv_events(self, pool: KVPool | None = None) -> None:
        """Record KV cache events from now on (see :meth:`drain_kv_events`)."""
        pool = pool if pool is not None else self.pool
        from radixserve.memory.kv_events import KVEventRecorder
        from radixserve.memory.page_hash import PrefixHasher

        hierarchy = getattr(self.cache, "hierarchy", None)
        hasher = (
            hierarchy.hasher
            if hierarchy is not None
            else PrefixHasher(f"{model_identity(self.model_path)}|{pool.layout()}", pool.page_size)
        )
        recorder = KVEventRecorder(hasher, "GPU" if self.device.type == "cuda" else "CPU")
        self.cache.listener = recorder
        if hierarchy is not None:  # L2/L3 report their pages too, under their own mediums
            hierarchy.set_listener(recorder)

    def drain_kv_events(self) -> Any | None:
        """The KV events (a vLLM-format ``KVEventBatch``) since the last call, or None."""
        return None if self.cache.listener is None else self.cache.listener.drain()

    def close(self) -> None:
        """Shut down cleanly: with an L3 directory, write the cached KV there (L1 and L2) so
        that a restart, or another worker on this host, starts warm; stop the other
        tensor-parallel ranks or pipeline stages. Idempotent."""
        if self.ranks is not None:
            self.ranks.close()
        if self.pipeline is not None:
            self.pipeline.close(getattr(self, "runner", None))
        persist = getattr(getattr(self, "cache", None), "persist", None)
        if persist is not None:
            n = persist()
            if n:
                logger.info(
                    "hierarchical cache: wrote %d KV pages to %s",
                    n,
                    self.config.hicache_storage_dir,
                )

    def _size_kv_pool(self) -> int:
        """Allocator pages: from a profile run where the device has a memory API and no
        ``memory_budget`` is given (:mod:`~radixserve.engine.kv_profile`), else the planner's."""
        cfg = self.config
        mem = self._device_memory
        if mem is None:
            pages = self._plan_num_pages()
            self.kv_sizing = f"KV pool {pages} pages from the memory planner" + (
                " (--memory-budget)" if cfg.memory_budget is not None else ""
            )
            return pages
        return self._profile_num_pages(mem)

    def _profile_num_pages(self, mem: kv_profile.DeviceMemory) -> int:
        """Pages from a profile run of the largest step on ``mem``'s device; the planner's
        estimate is kept beside the measured figure (``kv_profile``, ``kv_sizing``)."""
        from radixserve.memory.planner import kv_bytes_per_token, kv_fixed_bytes

        cfg, mc = self.config, self.model_config
        used = self._free_at_start - mem.free()
        max_seq_len = min(cfg.max_model_len or mc.max_position_embeddings, cfg.max_num_tokens)
        peak = kv_profile.profile_step_peak(
            self.model,
            mem,
            make_runner=lambda pool, rows, pages: ModelRunner.from_config(
                self.model, pool, cfg, rows, pages
            ),
            pool_args=self._pool_args,
            max_num_tokens=cfg.max_num_tokens,
            max_seq_len=max_seq_len,
        )
        graph_rows = min(cfg.max_running_requests, cfg.max_num_tokens)
        graphs = (
            kv_profile.graph_reserve_bytes(peak, cfg.max_num_tokens, graph_rows)
            if cfg.use_decode_graphs
            else 0
        )
        per_page = kv_bytes_per_token(mc, cfg.kv_cache_dtype, cfg.torch_dtype) * cfg.page_size
        try:
            planner = self._plan_num_pages()
        except ValueError:  # the estimate found no room; the measured figure decides
            planner = 0
        self.kv_profile = kv_profile.ProfiledKV.fit(
            total=mem.total(),
            utilization=cfg.memory_utilization,
            free_at_start=self._free_at_start,
            used=used,
            step_peak=peak,
            graph_reserve=graphs,
            kv_fixed=kv_fixed_bytes(mc, cfg.kv_cache_dtype),
            bytes_per_page=per_page,
            profiled_rows=cfg.max_num_tokens,
            planner_num_pages=planner,
        )
        self.kv_sizing = self.kv_profile.describe()
        return self.kv_profile.num_pages

    def _plan_num_pages(self) -> int:
        """Pages from the memory planner. On a CPU without an explicit budget the planner's
        budget is the machine's RAM (shared with everything else), so the pool is capped at
        ``CPU_DEFAULT_KV_BYTES`` of KV."""
        from radixserve.memory.planner import kv_bytes_per_token, plan_memory

        cfg = self.config
        cap = None
        if self.device.type == "cpu" and cfg.memory_budget is None:
            per_page = (
                kv_bytes_per_token(self.local_model_config, cfg.kv_cache_dtype, cfg.torch_dtype)
                * cfg.page_size
            )
            cap = max(1, CPU_DEFAULT_KV_BYTES // per_page)
        plan_fn = plan_memory if self.pipeline is None else self.pipeline.plan_memory
        plan = plan_fn(
            self.local_model_config if self.pipeline is None else self.model_config,
            kv_dtype=cfg.kv_cache_dtype,
            page_size=cfg.page_size,
            act_dtype=cfg.torch_dtype,
            memory_budget=cfg.memory_budget,
            memory_utilization=cfg.memory_utilization,
            device=self.device,
            max_num_tokens=cfg.max_num_tokens,
            max_num_pages=cap,
            **self._quant_plan_args(),
        )
        if plan.num_pages < 1:
            raise ValueError(f"no room for the KV cache: {plan}")
        return int(plan.num_pages)

    def _quant_plan_args(self) -> dict[str, Any]:
        """The loaded model's quantization, as the planner's weight-size arguments."""
        report = getattr(self.model, "quant_report", None)
        if report is None:
            return {}
        return {
            "quantization": report.method,
            "quant_group_size": report.group_size,
            "quantize_embeddings": not report.full_precision,
            "quant_dense_cache": report.dense_cache_bytes > 0,
        }

    # The runner owns the device state; these name its parts for callers and tests.
    @property
    def pool(self) -> KVPool:
        return self.runner.pool

    @property
    def sampler(self) -> Sampler:
        return self.runner.sampler

    @property
    def attn(self) -> AttentionBackend:
        return self.runner.attn

    @attn.setter
    def attn(self, backend: AttentionBackend) -> None:
        self.runner.set_attention_backend(backend)

    # ------------------------------------------------------------------ streaming API

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        namespace: str | None = None,
    ) -> str:
        """Queue a request; returns its id. Raises ``ValueError`` for invalid parameters,
        an empty or out-of-vocabulary prompt, one too long to ever fit, or a duplicate id."""
        req = self._make_request(prompt_token_ids, params, request_id, namespace)
        self.scheduler.add(req)
        return req.request_id

    def _make_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None,
        request_id: str | None,
        namespace: str | None,
    ) -> Request:
        params = (params or SamplingParams()).validate(self.model_config.vocab_size)
        ids = [int(t) for t in prompt_token_ids]
        if not ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        vocab = self.model_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(ids) >= self.max_total_len:
            raise ValueError(
                f"prompt of {len(ids)} tokens is too long: this engine fits at most {self.max_total_len - 1} "
                "prompt tokens (max_model_len "
                f"{self.config.max_model_len or self.model_config.max_position_embeddings}, "
                f"KV pool {self.allocator.num_pages * self.pool.page_size} tokens)"
            )
        if request_id is not None and request_id in self.scheduler.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        rid = request_id if request_id is not None else uuid.uuid4().hex
        gen = self.sampler.new_generator(params.seed) if params.seed is not None else None
        grammar = self._new_grammar_matcher(params)
        return Request(
            rid,
            ids,
            len(ids),
            params,
            self.max_total_len,
            namespace=namespace,
            generator=gen,
            grammar=grammar,
        )

    def _new_grammar_matcher(self, params: SamplingParams) -> Any | None:
        """Compile (cached per tokenizer and constraint) the request's regex / JSON schema /
        choices and start its matcher; None when unconstrained. ``ValueError`` when invalid."""
        constraint = params.constraint
        if constraint is None:
            return None
        from radixserve.constrained.grammar import compiler_for

        mc = self.model_config
        matcher = compiler_for(self.tokenizer, mc.vocab_size, mc.eos_token_ids).new_matcher(
            constraint
        )
        if matcher.can_only_end:
            raise ValueError(
                f"the constraint matches only the empty string: {constraint.describe()}"
            )
        return matcher

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV; its final StepOutput (finish_reason "abort")
        comes with the next :meth:`step`. Unknown or finished ids are ignored."""
        self.scheduler.abort(request_id, "abort")

    def step(self) -> list[StepOutput]:
        """Run one step (schedule, execute, process); one StepOutput per request that
        progressed or finished."""
        out, self._buffered = self._buffered, []
        out.extend(_to_step_output(o) for o in self.loop.step())
        return out

    def _rank_error(self, exc: Exception) -> None:
        """A step failed under tensor parallelism: the ranks are out of step for good, so the
        engine stops here, saying which rank died or hung (its requests were failed and their
        pages given back first)."""
        group = self.ranks if self.ranks is not None else self.pipeline
        assert group is not None
        raise group.explain(exc) from exc

    def check_health(self) -> None:
        """Raise :class:`~radixserve.engine.ranks.RankFailure` when a tensor-parallel rank has
        died or does not answer (the serving worker calls this while idle); a no-op with one
        rank."""
        if self.pipeline is not None and not self.has_unfinished():
            self.pipeline.check()
        if self.ranks is not None and not self.has_unfinished():
            self.ranks.check()

    def has_unfinished(self) -> bool:
        return bool(self._buffered) or self.loop.in_flight or self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ offline API

    def generate(
        self,
        prompts: PromptInput,
        params: SamplingInput | Sequence[SamplingInput] = None,
    ) -> list[GenerateOutput]:
        """Run prompts (texts, or token id lists) to completion; results in input order.

        ``params``: one :class:`SamplingParams` or dict of its fields for every prompt (as
        SGLang's ``Engine.generate`` takes), or a list of them, one per prompt.
        """
        batch = _normalize_prompts(prompts)
        plist = per_prompt(params, len(batch))
        ids_list = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in batch]
        # Validate everything before queueing anything: a bad prompt rejects the whole call.
        reqs = [self._make_request(ids, p, None, None) for ids, p in zip(ids_list, plist)]
        for req in reqs:
            self.scheduler.add(req)
        rids = [r.request_id for r in reqs]
        state = {
            rid: _Collector(self.tokenizer, p, ids) for rid, p, ids in zip(rids, plist, ids_list)
        }
        remaining = set(rids)
        while remaining:
            for o in self.step():
                col = state.get(o.request_id)
                if col is None:
                    self._buffered.append(o)
                    continue
                if col.add(o):
                    self.scheduler.abort(o.request_id, "stop")
                if o.finished:
                    remaining.discard(o.request_id)
        return [state[rid].result(rid) for rid in rids]

    # ------------------------------------------------------------------ introspection

    def stats(self) -> EngineStats:
        s = self.scheduler
        c = s.counters
        free = self.allocator.num_free
        evictable = self.cache.num_evictable_pages
        return EngineStats(
            running=len(s.running),
            waiting=len(s.waiting),
            num_pages=self.allocator.num_pages,
            page_size=self.pool.page_size,
            pages_free=free,
            pages_evictable=evictable,
            pages_in_use=self.allocator.num_pages - free - evictable,
            cached_tokens=self.cache.total_cached_tokens,
            steps_total=c.steps,
            prompt_tokens_total=c.prompt_tokens,
            cached_prompt_tokens_total=c.cached_prompt_tokens,
            computed_tokens_total=c.computed_tokens,
            generated_tokens_total=c.generated_tokens,
            retractions_total=c.retractions,
            evicted_pages_total=self.cache.stats.evicted_pages,
            finished_total=c.finished,
            aborted_total=c.aborted,
            hit_rate=c.cached_prompt_tokens / c.prompt_tokens if c.prompt_tokens else 0.0,
            **self._hicache_stats(),
        )

    def _hicache_stats(self) -> dict[str, int]:
        hierarchy = getattr(self.cache, "hierarchy", None)
        if hierarchy is None:
            return {}
        h = hierarchy.stats
        return {
            "host_cached_pages": hierarchy.host.num_cached,
            "demoted_pages_total": h.demoted_pages,
            "loaded_host_pages_total": h.loaded_l2_pages,
            "loaded_storage_pages_total": h.loaded_l3_pages,
            "storage_written_pages_total": h.l3_written_pages,
            "storage_corrupt_pages_total": h.l3_corrupt_pages,
        }

    def flush_cache(self) -> bool:
        """Drop every cached prefix. Only when no request is waiting or running (else False)."""
        return self.scheduler.flush_cache()

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if any KV page or request state is inconsistent (with
        tensor parallelism, also if any rank's pool size or page table differs from rank 0's)."""
        self.scheduler.check_invariants()
        if self.ranks is not None:
            self.ranks.audit(self.runner)
        # The device table, with the entries the next plan will send applied, holds every page list.
        pending: dict[int, dict[int, int]] = {}
        for slot, col, page in self.scheduler.rows.pending():
            pending.setdefault(slot, {})[col] = page
        for r in self.scheduler.running:
            row = self.runner.page_table_row(r.slot, len(r.pages))
            for col, page in pending.get(r.slot, {}).items():
                if col < len(row):
                    row[col] = page
            assert row == r.pages, f"page table row out of date: {r}"


class _Collector:
    """Accumulates one request's outputs inside :meth:`Engine.generate`."""

    def __init__(self, tokenizer: Any, params: SamplingParams, prompt_ids: list[int]) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, params, prompt_ids)
        self.prompt_ids = prompt_ids
        self.want_logprobs = params.logprobs is not None
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[float | None] | None = None
        self.text = ""
        self.stopped = False
        self.last: StepOutput | None = None

    def add(self, o: StepOutput) -> bool:
        """Take one output; True when a stop string just matched (the caller stops the request)."""
        self.last = o
        if o.prompt_logprobs is not None:
            self.prompt_logprobs = o.prompt_logprobs
        if self.stopped:
            return False
        self.token_ids += o.new_token_ids
        if o.new_logprobs:
            self.logprobs += o.new_logprobs
        delta = self.detok.add(o.new_token_ids, final=o.finished)
        self.text += delta.text
        if delta.stopped:
            self.stopped = True
            return not o.finished
        return False

    def result(self, rid: str) -> GenerateOutput:
        o = self.last
        assert o is not None and o.finished
        reason = "stop" if self.stopped else o.finish_reason
        usage = o.usage or Usage(len(self.prompt_ids), 0, len(self.token_ids))
        return GenerateOutput(
            request_id=rid,
            text=self.text,
            token_ids=self.token_ids,
            finish_reason=reason,
            usage=Usage(usage.prompt_tokens, usage.cached_tokens, len(self.token_ids)),
            prompt_token_ids=self.prompt_ids,
            logprobs=self.logprobs if self.want_logprobs else None,
            prompt_logprobs=self.prompt_logprobs,
            error=o.error,
        )


def _normalize_prompts(prompts: PromptInput) -> list[str | list[int]]:
    if isinstance(prompts, str):
        return [prompts]
    # The elements' type depends on which of PromptInput's shapes this is, told apart here.
    items: list[Any] = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # one prompt given as token ids
    return [p if isinstance(p, str) else list(p) for p in items]


def _to_step_output(o: RequestOutput) -> StepOutput:
    lps = None
    if o.new_logprobs is not None:
        lps = [TokenLogprob(t, lp, top) for t, (lp, top) in zip(o.new_token_ids, o.new_logprobs)]
    return StepOutput(
        request_id=o.request_id,
        new_token_ids=o.new_token_ids,
        new_logprobs=lps,
        prompt_logprobs=o.prompt_logprobs,
        finished=o.finished,
        finish_reason=o.finish_reason,  # type: ignore[arg-type]
        error=o.error,
        usage=Usage(o.prompt_tokens, o.cached_tokens, o.completion_tokens),
    )
