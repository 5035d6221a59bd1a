"""The offline engine: model + KV pool + radix cache + scheduler, in one process.

Two ways to drive it:

- ``generate(prompts, params)``: run a batch to completion and get texts back (stop
  strings handled by the incremental detokenizer).
- ``add_request`` / ``step`` / ``abort``: the streaming interface the serving worker and
  the in-process DSL backend drive; each ``step`` runs one scheduler step and returns a
  :class:`StepOutput` per request that progressed. No text here: callers detokenize with
  :class:`~radixserve.engine.detokenizer.IncrementalDetokenizer`.

This module assembles the parts and holds the API; each part answers one question in its own
module: ``kv_sizing`` (how many KV pages), ``prefix_cache`` (which cache, its tiers and KV
events), ``intake`` (is a request valid), ``step_loop`` (one step, overlapped or not),
``offline`` (``generate``'s prompt shapes and per-request collector).

Example::

    engine = Engine("default", page_size=16, max_num_tokens=1024)
    out = engine.generate(["The capital of France is"], SamplingParams(max_tokens=16, temperature=0))
    print(out[0].text, out[0].usage)
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from radixserve.distributed.disagg.roles import DecodeRole, PrefillRole, make_role
from radixserve.distributed.topology import RunnerShape, Topology, make_topology
from radixserve.engine.config import EngineConfig
from radixserve.engine.cpu_kernels import build_cpu_kernels
from radixserve.engine.devices import bind_device
from radixserve.engine.intake import RequestIntake
from radixserve.engine.kv_profile import ProfiledKV
from radixserve.engine.kv_sizing import KVSizer
from radixserve.engine.memory_occupation import MemoryOccupation
from radixserve.engine.model_runner import ModelRunner, kv_pool_args
from radixserve.engine.offline import GenerateCollector, PromptInput, normalize_prompts
from radixserve.engine.outputs import EngineStats, GenerateOutput, StepOutput, to_step_output
from radixserve.engine.prefix_cache import (
    attach_kv_events,
    hicache_stats,
    lease_config,
    lease_stats,
    make_prefix_cache,
    miss_stats,
    persist_prefix_cache,
    rename_cached_model,
)
from radixserve.engine.sampler import Sampler
from radixserve.engine.startup import StartupClock, describe_startup
from radixserve.engine.step_loop import StepLoop
from radixserve.engine.window_setup import plan_window_pool
from radixserve.engine.window_view import check_window_map
from radixserve.memory import PrefixCache
from radixserve.memory.allocator import PageAllocator
from radixserve.memory.pool import KVPool
from radixserve.memory.window_pool import WindowedPageAllocator, WindowPages
from radixserve.model.attention.base import AttentionBackend
from radixserve.model.classifier import Classification, classify
from radixserve.model.lora import LoraAdapter, LoraRegistry
from radixserve.prefix import lora_namespace
from radixserve.sampling_params import SamplingInput, SamplingParams, per_prompt
from radixserve.scheduling.scheduler import Scheduler, SchedulerConfig

logger = logging.getLogger(__name__)


def setup_cpu_threads(num_threads: int | None) -> None:
    """CPU start-up: an explicit thread count. (OpenMP's waiting, passive after ~1 ms of
    spinning, is set by importing :mod:`radixserve`, before torch loads the OpenMP runtime,
    which reads it only then.)"""
    if num_threads is not None:
        torch.set_num_threads(num_threads)


class Engine:
    """A prefix-caching LLM engine on one device (see the module docstring).

    ``model``: ``None``/``"default"`` (SmolLM2-135M-Instruct, fetched on first use) or a
    local Hugging Face checkpoint directory. ``config``: :class:`EngineConfig` fields.

    ``tensor_parallel_size=N`` (N > 1): this process is rank 0 and starts ranks 1..N-1 (on
    ``nnodes`` hosts, see :mod:`~radixserve.distributed.ranks`); call :meth:`close` to stop them.
    """

    def __init__(self, model: str | Path | None = None, **config: Any) -> None:
        from radixserve.model_store import resolve_model

        clock = StartupClock()
        self.config = cfg = EngineConfig.from_kwargs(**config)
        self.model_path = resolve_model(None if model is None else str(model))
        # One process, or rank 0 of tensor-parallel ranks or pipeline stages: the other ranks
        # start now and load their shards while this one loads its own (distributed.topology).
        self.topology: Topology = make_topology(cfg, self.model_path, config)
        try:
            self._build(cfg, clock)
        except BaseException:
            self.close()
            raise

    def _build(self, cfg: EngineConfig, clock: StartupClock) -> None:
        """Start-up, in its steps; ``clock`` times each (``startup_seconds``)."""
        topo = self.topology
        if torch.device(cfg.device).type == "cpu":
            setup_cpu_threads(topo.threads())
        self.device = topo.device
        bind_device(self.device)  # cuda:N: Triton launches and index-less allocations go there
        clock.lap("resolve model")
        if self.device.type == "cpu":  # its own phase: a first build is not "load weights"
            clock.lap(build_cpu_kernels().phase)
        # Before the weights: a profile run budgets only the memory free now (kv_sizing).
        sizer = KVSizer(cfg, self.device, parallel=topo.parallel)
        self._load_model(cfg, clock)
        num_pages, pool_args = self._size_kv(cfg, sizer)
        clock.lap("KV sizing")
        pool = self._build_cache(cfg, num_pages, pool_args)
        clock.lap("KV pool")
        self._build_runner(cfg, pool, num_pages, clock)
        # Where start-up went, in order (seconds); `radixserve serve` prints it.
        self.startup_seconds: dict[str, float] = clock.laps
        self._build_serving(cfg, pool, num_pages)
        logger.info(
            "engine ready in %s: %s, %s, max_total_len=%d; %s",
            describe_startup(self.startup_seconds),
            self.model_path,
            self.pool,
            self.max_total_len,
            self.kv_sizing,
        )

    def _size_kv(self, cfg: EngineConfig, sizer: KVSizer) -> tuple[int, dict[str, Any]]:
        """The KV pool's pages and its arguments: sized (profile run, planner or given), then
        split for a sliding-window pool where the model has one."""
        pool_args = kv_pool_args(self.model, cfg, self.device)
        sizing = sizer.size(self.model, pool_args, self.topology.plan_memory)
        num_pages = sizing.num_pages
        # How the pool was sized (profile run, planner or given), in words; see kv_sizing.
        self.kv_sizing: str = sizing.description
        self.kv_profile: ProfiledKV | None = sizing.profile
        logger.info("%s", self.kv_sizing)
        self.window_pool = plan_window_pool(
            cfg, self.model_config, num_pages, self.topology.carries_window_map
        )
        if self.window_pool is not None:
            num_pages = self.window_pool.num_pages
            pool_args["window_layers"] = self.window_pool.layers
            pool_args["num_window_pages"] = self.window_pool.num_window_pages + 1  # + scratch
        return num_pages, pool_args

    def _build_runner(
        self, cfg: EngineConfig, pool: KVPool, num_pages: int, clock: StartupClock
    ) -> None:
        """The model runner over the pool, on every rank, warmed up."""
        topo = self.topology
        shape = RunnerShape(
            num_pages,
            self.scheduler.config.max_running_requests,
            self.scheduler.max_pages_per_request,
            self.max_total_len,
            self.window_pool,
        )
        self.runner: ModelRunner = topo.make_runner(self.model, pool, shape)
        if self.window_pool is not None:
            self.runner.use_window_pool(self.window_pool.window)
        problem = self.runner.row_invariance_problem()
        if problem is not None:
            if cfg.speculative_algorithm is not None:
                raise ValueError(
                    f"speculative decoding needs row-invariant logits; not with {problem}"
                )
            self.scheduler.drop_speculation(
                f"verify rows need row-invariant logits; not with {problem}"
            )
        clock.lap("attention backend and CPU kernels")
        topo.start(shape, clock)  # every rank builds the same pool and runner, and warms up with us
        self.runner.warm_up(self.max_total_len, max_step_tokens=cfg.max_num_tokens)
        topo.warmed_up(self.runner)  # from now on each step goes to every rank
        clock.lap("warm-up (graph capture, first forwards)")

    def _build_serving(self, cfg: EngineConfig, pool: KVPool, num_pages: int) -> None:
        """What requests go through: the step loop, the intake, the disaggregation role."""
        self.loop = StepLoop(
            self.scheduler,
            self.runner,
            overlap=cfg.use_overlap,
            on_error=self.topology.on_step_error,
        )
        self._buffered: list[StepOutput] = []  # other requests' outputs seen inside generate()
        self.intake = RequestIntake(
            self.model_config,
            self.tokenizer,
            self.runner.sampler,
            max_total_len=self.max_total_len,
            max_model_len=self.max_model_len,
            pool_tokens=num_pages * pool.page_size,
            lora=getattr(self.model, "lora", None),  # a pipeline stage serves none
            no_embeddings=_no_embeddings(cfg, self.topology),
            embeddings_only=bool(getattr(self.model, "embeddings_only", False)),
        )
        # Which weights it serves (SGLang's weight_version): update_weights_from_disk sets it.
        self.weight_version = "default"
        # Memory given back to the OS between uses (release_memory_occupation).
        self.memory = MemoryOccupation(self)
        # Prefill/decode disaggregation (distributed.disagg): None unless disaggregation_mode.
        self.disagg: PrefillRole | DecodeRole | None = make_role(
            cfg, self.scheduler, self.intake, pool, self.model, self.topology.rank_link()
        )

    def _load_model(self, cfg: EngineConfig, clock: StartupClock) -> None:
        """This rank's share of the weights, and the tokenizer."""
        from transformers import AutoTokenizer

        from radixserve.model.loader import load_model

        self.model = load_model(self.model_path, **self._load_args(), **self.topology.load_args())
        if cfg.lora_enabled:
            self.model.serve_lora(cfg.lora_paths, cfg.max_lora_rank, cfg.max_loaded_loras)
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

    def _load_args(self) -> dict[str, Any]:
        """How this engine's weights are loaded (``load_model``'s arguments but this rank's
        share): at start-up and for every update alike."""
        cfg = self.config
        return {"dtype": cfg.torch_dtype, "device": self.device, "quantization": cfg.quant_config()}

    def _build_cache(self, cfg: EngineConfig, num_pages: int, pool_args: dict[str, Any]) -> KVPool:
        """The KV pool, its allocator and prefix cache, and the scheduler over them."""
        # One page past the allocator's: the scratch page padding rows of static decode steps write to.
        pool = KVPool(num_pages=num_pages + 1, **pool_args)
        wp = self.window_pool
        self.allocator = (
            PageAllocator(num_pages)
            if wp is None
            else WindowedPageAllocator(
                num_pages, WindowPages(num_pages, wp.num_window_pages, wp.window, cfg.page_size)
            )
        )
        self.cache: PrefixCache = make_prefix_cache(cfg, self.allocator, pool, self.model_path)
        self.cache.pins.budget_pages = int(num_pages * cfg.pin_budget_fraction)
        self.cache.leases.config = lease_config(cfg)
        self.cache.eviction.set_policy(cfg.eviction_policy)
        if self.cache.misses is not None:
            self.cache.misses.report_all = cfg.cache_report
        if cfg.kv_events_endpoint is not None:
            self.enable_kv_events(pool)
        self.max_model_len = cfg.max_model_len or self.model_config.max_position_embeddings
        self.max_total_len = min(self.max_model_len, num_pages * cfg.page_size)
        sched_cfg = SchedulerConfig(
            **{
                **cfg.scheduling_fields(),
                # Every running request decodes one token per step out of the budget.
                "max_running_requests": min(cfg.max_running_requests, cfg.max_num_tokens),
                "max_total_len": self.max_total_len,
                "predicted_outputs": cfg.predicted_outputs == "on" and not cfg.speculation_limits(),
            }
        )
        drafter = None
        if cfg.speculative_algorithm == "draft":  # a draft model, on KV of its own
            from radixserve.engine.draft_setup import make_draft_drafter

            drafter = make_draft_drafter(
                cfg, self.model_config, self.tokenizer, num_pages, self.max_model_len, self.device
            )
        self.scheduler = Scheduler(
            sched_cfg, self.cache, self.allocator, self.model_config.eos_token_ids, drafter
        )
        return pool

    def enable_kv_events(self, pool: KVPool | None = None) -> None:
        """Record KV cache events from now on (see :meth:`drain_kv_events`)."""
        pool = pool if pool is not None else self.pool
        attach_kv_events(self.cache, pool, self.model_path, self.device)

    def drain_kv_events(self) -> Any | None:
        """The KV events (a vLLM-format ``KVEventBatch``) since the last call, or None."""
        return None if self.cache.listener is None else self.cache.listener.drain()

    def close(self) -> None:
        """Shut down cleanly: with an L3 directory, write the cached KV there (L1 and L2) so
        that a restart, or another worker on this host, starts warm; stop the other
        tensor-parallel ranks or pipeline stages. Idempotent."""
        role = getattr(self, "disagg", None)
        if role is not None:
            role.close()
            self.disagg = None
        if hasattr(self, "topology"):
            self.topology.close(getattr(self, "runner", None))
        persist_prefix_cache(getattr(self, "cache", None), self.config.hicache_storage_dir)

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

    @property
    def lora_adapters(self) -> dict[str, str]:
        """The LoRA adapters this engine serves (``lora_paths`` and those loaded since):
        name -> the key their requests' cache namespace is split by (name and digest:
        LoraAdapter.cache_key)."""
        lora = getattr(self.model, "lora", None)
        return {} if lora is None else lora.cache_keys

    def load_lora_adapter(self, name: str, path: str) -> str:
        """Serve the PEFT adapter at ``path`` as ``name`` from the next request on, without a
        restart (SGLang's and vLLM's ``/load_lora_adapter``); its cache key. The same files
        under the same name again are a no-op. ``ValueError``: LoRA is not enabled
        (``enable_lora``), ``name`` is served with other files, ``max_loaded_loras`` are
        loaded, or the adapter does not fit the model."""
        return self.add_lora_adapter(self.read_lora_adapter(name, path))

    def read_lora_adapter(self, name: str, path: str) -> LoraAdapter:
        """:meth:`load_lora_adapter`'s first half: the adapter at ``path`` read for this
        model, not served yet. It changes no engine state, so a worker runs it on a thread
        of its own while steps go on; ``ValueError`` as there."""
        return self._lora_registry().read(name, path)

    def add_lora_adapter(self, adapter: LoraAdapter) -> str:
        """:meth:`load_lora_adapter`'s second half, between steps: serve ``adapter`` (from
        :meth:`read_lora_adapter`) from the next request on; its cache key."""
        return self.topology.serve_lora(self._lora_registry(), adapter).cache_key

    def unload_lora_adapter(self, name: str) -> None:
        """Stop serving ``name``: new requests naming it are refused at once; those running
        finish with it, and its weights are freed after the last (``ValueError``: not
        served). Its cached prefixes stay until evicted, under a key no other weights
        share."""
        self.topology.unload_lora(self._lora_registry(), name)
        self._release_loras()

    def _lora_registry(self) -> LoraRegistry:
        lora: LoraRegistry | None = getattr(self.model, "lora", None)
        if lora is None:
            raise ValueError(
                "this engine serves no LoRA adapters: start it with enable_lora "
                "(--enable-lora) or lora_paths to load them while serving"
            )
        return lora

    def _release_loras(self) -> None:
        """Free the unloaded adapters no live request holds."""
        lora: LoraRegistry | None = getattr(self.model, "lora", None)
        if lora is not None and lora.draining:
            lora.release({r.lora_slot for r in self.scheduler.requests.values()})

    def update_weights_from_disk(self, path: str, weight_version: str | None = None) -> None:
        """Serve the weights of checkpoint ``path`` from the next request on, without a
        restart (SGLang's ``update_weights_from_disk``: an RL loop's new policy). Loaded as
        at start-up (dtype, quantization), checked against the served architecture, then
        copied into the served tensors in place (:mod:`~radixserve.model.weight_update`);
        every cached prefix is dropped, and the hierarchical cache's keys name the new
        files, so no KV of the old weights answers a request. Only between requests: a
        ``ValueError`` while any runs or waits, and for a checkpoint that does not fit
        (nothing changed then). ``weight_version``: what :attr:`weight_version` says next."""
        from radixserve.model_store import resolve_model

        if self.disagg is not None:
            raise ValueError("weights cannot be updated with prefill/decode disaggregation")
        if self.has_running():
            raise ValueError("requests are running: weights change between requests")
        if "weights" in self.memory.released:
            raise ValueError("the weights are released: resume them first")
        new_path = resolve_model(path)
        copied = self.topology.replace_weights(self.model, new_path, self._load_args())
        flushed = self.scheduler.flush_cache(waiting_ok=True)
        assert flushed, "with nothing running the cache flushes"
        rename_cached_model(self.cache, self.pool, new_path)
        self.model_path = new_path
        if weight_version is not None:
            self.weight_version = weight_version
        logger.info(
            "weights updated from %s (%s, %.0f MiB copied in place)",
            new_path,
            self.weight_version,
            copied / 2**20,
        )

    # ------------------------------------------------------------------ streaming API

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        namespace: str | None = None,
        session_id: str | None = None,
        priority: int = 0,
        lora: str | None = None,
    ) -> str:
        """Queue a request; returns its id. Raises ``ValueError`` for invalid parameters,
        an empty or out-of-vocabulary prompt, one too long to ever fit, a LoRA adapter not
        served, or a duplicate id. ``session_id``: the session it is a turn of (its path is
        leased when it ends); ``lora``: the served adapter it runs with (None: the base)."""
        req = self.intake.make_request(
            prompt_token_ids,
            params,
            request_id,
            namespace,
            self.scheduler.requests,
            session_id=session_id,
            priority=priority,
            lora=lora,
        )
        self.scheduler.add(req)
        return req.request_id

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV; its final StepOutput (finish_reason "abort")
        comes with the next :meth:`step`. Unknown or finished ids are ignored."""
        self.scheduler.abort(request_id, "abort")

    def step(self) -> list[StepOutput]:
        """Run one step (schedule, execute, process); one StepOutput per request that
        progressed or finished. ``RuntimeError`` while the weights are released."""
        refused = self.memory.step_refusal()
        if refused is not None:
            raise RuntimeError(refused)
        out, self._buffered = self._buffered, []
        out.extend(to_step_output(o) for o in self.loop.step())
        self._release_loras()
        return out

    # ------------------------------------------------------------------ pausing

    def settle(self) -> None:
        """Read the step in flight (overlap scheduling), launching none: a pause's first
        move, so that every token computed for the requests it stops is reported (its
        outputs wait for :meth:`take_outputs` or the next :meth:`step`)."""
        self._buffered.extend(to_step_output(o) for o in self.loop.settle())

    def retract_running(self) -> int:
        """Send every running request back to the queue (SGLang's ``pause_generation``
        with mode ``retract``): its KV so far is cached in the tree and its pages are
        unlocked, so nothing holds KV and weights may change (:meth:`update_weights_from_disk`);
        when it runs again it is recomputed over its prompt and output, from whatever the
        tree still holds. Returns how many were running."""
        if self.disagg is not None:
            raise ValueError("requests cannot be retracted with prefill/decode disaggregation")
        self.settle()
        return self.scheduler.retract_all()

    def take_outputs(self) -> list[StepOutput]:
        """The outputs ready without a step (aborted requests', a settled step's): what a
        paused worker, which runs no step, still reports."""
        out, self._buffered = self._buffered, []
        out.extend(to_step_output(o) for o in self.scheduler.take_outputs())
        self._release_loras()
        return out

    def has_running(self) -> bool:
        """Whether a request holds KV (running) or a step is in flight."""
        return bool(self.scheduler.running) or self.loop.in_flight

    # ------------------------------------------------------------------ memory release

    def release_memory_occupation(self, tags: Sequence[str] | None = None) -> int:
        """Give the memory of ``tags`` (``"kv_cache"``, ``"weights"``; None: both) back to
        the OS (SGLang's ``release_memory_occupation``, vLLM's ``sleep``): the cache is
        flushed; released weights are undefined until :meth:`update_weights_from_disk`.
        Only while no request runs (``ValueError`` otherwise, and on more than one rank,
        off the CPU or with disaggregation); returns the bytes given back
        (:mod:`~radixserve.engine.memory_occupation`)."""
        return self.memory.release(tags)

    def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """Take the memory of ``tags`` (None: both) again: nothing is reallocated (released
        pages fault in as they are written); resumed weights still need
        :meth:`update_weights_from_disk` before a step."""
        self.memory.resume(tags)

    def check_health(self) -> None:
        """Raise :class:`~radixserve.distributed.ranks.RankFailure` when a tensor-parallel rank has
        died or does not answer (the serving worker calls this while idle); a no-op with one
        rank."""
        if not self.has_unfinished():
            self.topology.check()

    def has_unfinished(self) -> bool:
        return bool(self._buffered) or self.loop.in_flight or self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ offline API

    def generate(
        self,
        prompts: PromptInput,
        params: SamplingInput | Sequence[SamplingInput] = None,
        lora: str | Sequence[str | None] | None = None,
    ) -> list[GenerateOutput]:
        """Run prompts (texts, or token id lists) to completion; results in input order.

        ``params``: one :class:`SamplingParams` or dict of its fields for every prompt (as
        SGLang's ``Engine.generate`` takes), or a list of them, one per prompt. ``lora``:
        the served LoRA adapter of every prompt, or one per prompt (None: the base model;
        SGLang's ``lora_path``).
        """
        batch = normalize_prompts(prompts)
        plist = per_prompt(params, len(batch))
        loras = [lora] * len(batch) if lora is None or isinstance(lora, str) else list(lora)
        if len(loras) != len(batch):
            raise ValueError(f"{len(loras)} LoRA adapters named for {len(batch)} prompts")
        ids_list = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in batch]
        # Validate everything before queueing anything: a bad prompt rejects the whole call.
        reqs = [
            self.intake.make_request(ids, p, None, None, lora=a)
            for ids, p, a in zip(ids_list, plist, loras)
        ]
        for req in reqs:
            self.scheduler.add(req)
        rids = [r.request_id for r in reqs]
        state = {  # each request's prompt as the intake kept it (truncate_prompt_tokens)
            r.request_id: GenerateCollector(self.tokenizer, p, r.token_ids[: r.prompt_len])
            for r, p in zip(reqs, plist)
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

    def encode(
        self, prompts: PromptInput, lora: str | Sequence[str | None] | None = None
    ) -> list[list[float]]:
        """Each prompt's embedding, in input order (SGLang's ``Engine.encode``, vLLM's
        ``LLM.embed``): the final norm's output at its last token, unnormalized
        (``return_embedding``); prefixes come from the cache as for any prompt."""
        embed = SamplingParams(max_tokens=1, temperature=0.0, return_embedding=True)
        outs = self.generate(prompts, embed, lora)
        failed = next((o for o in outs if o.embedding is None), None)
        if failed is not None:
            raise RuntimeError(f"request {failed.request_id} ended without an embedding")
        return [o.embedding for o in outs if o.embedding is not None]

    def classify(
        self, prompts: PromptInput, lora: str | Sequence[str | None] | None = None
    ) -> list[Classification]:
        """Each prompt's classification by a sequence-classification checkpoint, in input order
        (vLLM's ``LLM.classify``): the score head's logits at the prompt's last non-pad token
        (transformers' ``logits``), their probabilities (``classifier.class_probs``) and label;
        the logits are the engine's embedding of the prompt (:meth:`encode`)."""
        head = self.model_config.classifier
        if head is None:
            raise ValueError(
                f"this model ({self.model_config.architecture}) is not a sequence classifier"
            )
        return [classify(head, logits) for logits in self.encode(prompts, lora)]

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
            spec_verifies_total=c.spec_verifies,
            spec_drafted_tokens_total=c.spec_drafted_tokens,
            spec_accepted_tokens_total=c.spec_accepted_tokens,
            **(s.speculation.drafter.pool_stats() if s.speculation is not None else {}),
            **hicache_stats(self.cache),
            **lease_stats(self.cache),
            **miss_stats(self.cache),
            **self.cache.eviction.stats(),
        )

    def close_session(self, session_id: str, namespace: str | None = None) -> bool:
        """The session ended: release its lease (its path becomes ordinary cache) and forget
        its learned pauses, in the tenant's ``namespace`` and in each served LoRA adapter's
        split of it (a session's turns may run with an adapter: their path is leased there,
        and a client closing the session names its tenant only). Returns whether it held a
        lease."""
        keys = self.lora_adapters.values()
        namespaces = [namespace] + [lora_namespace(namespace, key) for key in keys]
        released = [self.cache.leases.release(session_id, ns) for ns in namespaces]
        return any(released)

    def flush_cache(self, waiting_ok: bool = False) -> bool:
        """Drop every cached prefix. Only when no request is waiting or running (else False);
        ``waiting_ok``: waiting requests do not count (a pause's retracted ones, which are
        then recomputed from the prompt, as SGLang's retract mode allows)."""
        return self.scheduler.flush_cache(waiting_ok=waiting_ok)

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if any KV page or request state is inconsistent (with
        tensor parallelism, also if any rank's pool size or page table differs from rank 0's)."""
        self.scheduler.check_invariants()
        self.topology.audit(self.runner)
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
        if isinstance(self.allocator, WindowedPageAllocator):
            runner = self.runner
            scratch = runner.pool.num_window_pages - 1
            check_window_map(runner.window_map, runner._window_host, scratch, self.allocator.window)


def _no_embeddings(cfg: EngineConfig, topology: Topology) -> str | None:
    """Why an engine of ``cfg`` on ``topology`` cannot return a prompt's embedding (None: it
    can): rank 0 holds the final norm's output only where it runs the last layer and the
    prompt's last row itself."""
    if not topology.holds_final_norm:
        return "with pipeline parallelism (the last stage holds the final norm's output)"
    if cfg.disaggregation_mode is not None:
        return "with prefill/decode disaggregation"
    return None
