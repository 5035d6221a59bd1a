"""The served adapters: their slots, the wrapped layers, and each forward's rows.

Slot 0 is the base model; adapters take slots 1..N in the order they were named. A step
plan carries one slot per sequence (``StepPlan.lora_slots``); the runner turns it into
:class:`LoraRows` (which rows each adapter owns) for the forward, and every
:class:`LoraLinear` adds its adapters' deltas to those rows. Rows of the base model get
nothing added, so a batch without adapted rows computes exactly what the model does
without adapters. A forward whose every row is one adapter's may run the CPU's one-call
decoder stack, which adds that adapter's deltas itself (``LlamaForCausalLM._stack_lora``);
one mixing adapters takes the per-layer path; no captured decode graph runs adapted rows.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from torch import nn

from radixserve.model.lora.adapter import LoraAdapter, read_adapter
from radixserve.prefix import lora_namespace

__all__ = ["LoraLinear", "LoraRegistry", "LoraRows", "lora_namespace", "parse_lora_spec", "unwrap"]


def parse_lora_spec(spec: str) -> tuple[str, str]:
    """``name=path`` (SGLang's and vLLM's form), or a bare path named by its directory."""
    name, sep, path = spec.partition("=")
    if not sep:
        path = spec
        name = Path(spec.rstrip("/")).name
    if not name or not path:
        raise ValueError(f"a LoRA adapter is named as name=path, got {spec!r}")
    return name, path


@dataclass(frozen=True)
class LoraRows:
    """One forward's adapted rows: per adapter in the batch, the rows that are its (None:
    every row of the forward)."""

    groups: tuple[tuple[LoraAdapter, torch.Tensor | None], ...]


class _Active:
    """The rows of the forward running now (None outside a forward with adapted rows)."""

    rows: LoraRows | None = None


class LoraLinear(nn.Module):
    """A linear layer with the deltas of the adapters that target it. ``base`` stays the
    module it wraps (the CPU's one-call stack runs it directly, adding an adapter's deltas
    itself: :func:`unwrap`)."""

    def __init__(self, base: nn.Module, name: str, active: _Active) -> None:
        super().__init__()
        self.base = base
        self.name = name
        self._active = active
        linear = cast("nn.Linear", base)  # any linear layer: they all say their widths
        self.in_features: int = linear.in_features
        self.out_features: int = linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base.forward(x)
        rows = self._active.rows
        if rows is None:
            return out
        x2, out2 = x.reshape(-1, self.in_features), out.view(-1, self.out_features)
        for adapter, idx in rows.groups:
            delta = adapter.deltas.get(self.name)
            if delta is not None:
                delta.apply(x2 if idx is None else x2.index_select(0, idx), out2, idx)
        return out


def unwrap(module: nn.Module) -> nn.Module:
    """The layer a :class:`LoraLinear` wraps (any other module: itself)."""
    return module.base if isinstance(module, LoraLinear) else module


class LoraRegistry:
    """The adapters a model serves (see the module docstring)."""

    def __init__(self, adapters: Sequence[LoraAdapter]) -> None:
        self.adapters = list(adapters)
        self._slots = {a.name: i + 1 for i, a in enumerate(self.adapters)}
        if len(self._slots) != len(self.adapters):
            raise ValueError("two LoRA adapters share a name")
        self._active = _Active()

    @classmethod
    def load(cls, model: nn.Module, specs: Sequence[str], max_rank: int) -> LoraRegistry:
        """Read every adapter of ``specs`` (``name=path``) for ``model`` and wrap the layers
        they target."""
        adapters = [read_adapter(*parse_lora_spec(s), model, max_rank) for s in specs]
        registry = cls(adapters)
        registry._wrap(model)
        return registry

    @property
    def names(self) -> list[str]:
        return [a.name for a in self.adapters]

    @property
    def cache_keys(self) -> dict[str, str]:
        """Each adapter's :attr:`~LoraAdapter.cache_key`, by name."""
        return {a.name: a.cache_key for a in self.adapters}

    def slot(self, name: str | None) -> int:
        """The slot of adapter ``name`` (0: None, the base model); ``ValueError`` if unknown."""
        if name is None:
            return 0
        slot = self._slots.get(name)
        if slot is None:
            served = ", ".join(self.names) or "none"
            raise ValueError(f"unknown LoRA adapter {name!r} (served: {served})")
        return slot

    def rows(
        self, slots: Sequence[int], extend_lens: Sequence[int], device: torch.device
    ) -> LoraRows:
        """Which of a forward's rows each adapter owns: sequence ``b`` (slot ``slots[b]``)
        owns the next ``extend_lens[b]`` rows."""
        by_slot: dict[int, list[int]] = {}
        t = 0
        for slot, n in zip(slots, extend_lens):
            if slot:
                by_slot.setdefault(slot, []).extend(range(t, t + n))
            t += n
        groups = []
        for slot, idx in sorted(by_slot.items()):
            whole = len(idx) == t
            rows = None if whole else torch.tensor(idx, dtype=torch.int64, device=device)
            groups.append((self.adapters[slot - 1], rows))
        return LoraRows(tuple(groups))

    @contextmanager
    def applied(self, rows: LoraRows | None) -> Iterator[None]:
        """Within it, the wrapped layers add ``rows``' deltas (None: none)."""
        self._active.rows = rows
        try:
            yield
        finally:
            self._active.rows = None

    def _wrap(self, model: nn.Module) -> None:
        for name in sorted({m for a in self.adapters for m in a.deltas}):
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            setattr(parent, attr, LoraLinear(getattr(parent, attr), name, self._active))
