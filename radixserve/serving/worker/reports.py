"""What a worker tells the router about its engine: its hello, its load, its stats.

Read off a :class:`~radixserve.serving.worker.engine_api.ServingEngine`; the real engine's extras
(its config, KV pool, device, tokenizer) are read where present, so the tests' fake engines
report too.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec

from radixserve.serving.wire import protocol as p
from radixserve.serving.worker.engine_api import ServingEngine


def describe_engine(
    engine: ServingEngine, worker_id: int, model_name: str, join: int = 0
) -> p.WorkerHello:
    """The hello message: what this worker serves, read off the engine; ``join``: the
    worker's hellos before this one."""
    cfg = engine.model_config
    econf = getattr(engine, "config", None)
    # The engine's own limit (model context, capped by its KV pool) when it has one.
    ctx = (
        getattr(engine, "max_total_len", None)
        or getattr(econf, "max_model_len", None)
        or cfg.max_position_embeddings
    )
    tok = getattr(engine, "tokenizer", None)
    return p.WorkerHello(
        worker_id=worker_id,
        pid=os.getpid(),
        model=model_name,
        context_length=int(ctx),
        vocab_size=int(cfg.vocab_size),
        eos_token_ids=[int(t) for t in cfg.eos_token_ids],
        bos_token_id=getattr(tok, "bos_token_id", None),
        page_size=int(getattr(econf, "page_size", 1)),
        load=engine_load(engine),
        model_path=str(getattr(engine, "model_path", "") or ""),
        disaggregation_mode=str(getattr(econf, "disaggregation_mode", None) or ""),
        join=join,
        lora_adapters=dict(getattr(engine, "lora_adapters", {})),
        weight_version=str(getattr(engine, "weight_version", "default")),
        hidden_size=int(getattr(cfg, "hidden_size", 0) or 0),
        labels=_labels(cfg),
        problem_type=str(getattr(getattr(cfg, "classifier", None), "problem_type", None) or ""),
    )


def _labels(cfg: Any) -> list[str]:
    """A sequence classifier's label names (none for any other model, or a test's config)."""
    head = getattr(cfg, "classifier", None)
    return list(head.labels) if head is not None else []


def engine_load(engine: ServingEngine) -> p.WorkerLoad:
    """The engine's load gauges as the router's :class:`WorkerLoad`."""
    s = engine.stats()
    return p.WorkerLoad(
        running=s.running,
        waiting=s.waiting,
        num_pages=s.num_pages,
        free_pages=s.pages_free,
        evictable_pages=s.pages_evictable,
        in_use_pages=s.pages_in_use,
    )


def engine_memory(engine: ServingEngine) -> dict[str, Any] | None:
    """The device memory snapshot (planner's ``memory_snapshot``) of the engine's device, with
    its KV pool's bytes, as a plain map; ``None`` for an engine without a pool (test fakes)."""
    pool, device = getattr(engine, "pool", None), getattr(engine, "device", None)
    if pool is None or device is None:
        return None
    from radixserve.memory.planner import memory_snapshot

    return msgspec.to_builtins(memory_snapshot(device, int(getattr(pool, "nbytes", 0))))


def debug_invariants() -> bool:
    """``RADIXSERVE_DEBUG_INVARIANTS=1``: every stats request also runs the full KV invariant check."""
    return os.environ.get("RADIXSERVE_DEBUG_INVARIANTS", "0") not in ("", "0")


def worker_stats(engine: ServingEngine, check: bool) -> dict[str, Any]:
    """The engine's stats for a stats request: O(1) gauges and counters (a Prometheus scrape
    must not stall decodes). ``check`` adds the full invariant check, O(pool) Python work,
    as ``"invariants"``: ``"ok"``, ``"violated: ..."``, or ``"unchecked"``."""
    stats = msgspec.to_builtins(engine.stats())
    stats["memory"] = engine_memory(engine)  # for the HTTP gateway's server info, metrics, log
    stats["invariants"] = "unchecked"
    role = getattr(engine, "disagg", None)  # prefill/decode disaggregation's counters
    if role is not None:
        d = role.stats()
        mode = getattr(getattr(engine, "config", None), "disaggregation_mode", None)
        stats["disaggregation"] = {**d._asdict(), "transfer": d.transfer._asdict(), "mode": mode}
    if check:
        try:
            engine.check_invariants()
            stats["invariants"] = "ok"
        except Exception as exc:  # report, don't die: the stats are how tests see it
            stats["invariants"] = f"violated: {exc}"
    return stats
