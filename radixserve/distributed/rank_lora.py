"""LoRA adapters loaded and unloaded while tensor-parallel ranks serve, all or none.

Rank 0 decides: its registry says which slot a new adapter takes, and it sends the load
(:class:`~radixserve.distributed.step_wire.LoadLora`) over the step channel, between two
steps, so every rank sees loads, unloads and steps in one order. Each other rank reads its
share of the adapter's files (:mod:`radixserve.model.lora.tp`) and checks it; every rank
votes in one all-gather, and only if all could does each serve it, in rank 0's slot. An
adapter one rank cannot read (its shapes, its files changed since rank 0 read them) is
served by none, and the ranks go on serving what they served. Rank 0 read its own share
before (off the step loop: :mod:`~radixserve.serving.worker.lora_queue`); the others read
theirs while rank 0 waits for their votes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from radixserve.distributed.step_wire import LoadLora, Message, UnloadLora
from radixserve.model.lora import LoraAdapter, LoraRegistry

__all__ = ["follow_lora", "lead_load", "lead_unload"]

log = logging.getLogger(__name__)

Agree = Callable[[bool], bool]  # every rank's vote, one collective


def lead_load(
    registry: LoraRegistry, adapter: LoraAdapter, send: Callable[[Message], None], agree: Agree
) -> LoraAdapter:
    """Rank 0's part of a load: ``ValueError``, nothing sent, where its registry refuses
    ``adapter``; else every rank reads and votes, and all serve it or none does."""
    slot = registry.next_slot(adapter)
    if slot is None:  # served already, from the same files: nothing changes anywhere
        return registry.serve(adapter)
    send(LoadLora(adapter.name, adapter.path, slot, adapter.digest))
    if not agree(True):
        raise ValueError(
            f"LoRA adapter {adapter.name!r}: another tensor-parallel rank could not load it "
            "(its log says why); no rank serves it"
        )
    return registry.serve(adapter, slot)


def lead_unload(registry: LoraRegistry, name: str, send: Callable[[Message], None]) -> None:
    """Rank 0's part of an unload: ``ValueError``, nothing sent, for an unknown name."""
    registry.remove(name)
    send(UnloadLora(name))


def follow_lora(registry: LoraRegistry, msg: LoadLora | UnloadLora, agree: Agree) -> None:
    """Another rank's part of :func:`lead_load` or :func:`lead_unload`."""
    if isinstance(msg, UnloadLora):
        registry.remove(msg.name)  # rank 0 served it: so does this rank
        return
    adapter: LoraAdapter | None = None
    try:
        adapter = registry.read(msg.name, msg.path)
        if adapter.digest != msg.digest:
            raise ValueError(f"its files at {msg.path} changed since rank 0 read them")
    except Exception as exc:  # one rank's refusal is every rank's: it votes, never raises
        log.warning("rank refuses LoRA adapter %r: %s", msg.name, str(exc) or type(exc).__name__)
        adapter = None
    if agree(adapter is not None) and adapter is not None:
        registry.serve(adapter, msg.slot)
