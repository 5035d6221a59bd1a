"""The served adapters: their slots, the wrapped layers, and each forward's rows.

Slot 0 is the base model; adapters take the lowest free slots from 1 on, in the order they
were loaded (at start-up, or while serving: :meth:`LoraRegistry.add`). A step plan
carries one slot per sequence (``StepPlan.lora_slots``); the runner turns it into
:class:`LoraRows` (which rows each adapter owns) for the forward, and every
:class:`LoraLinear` adds its adapters' deltas to those rows. Rows of the base model get
nothing added, so a batch without adapted rows computes exactly what the model does
without adapters. A forward whose every row is one adapter's may run the CPU's one-call
decoder stack, which adds that adapter's deltas itself (``LlamaForCausalLM._stack_lora``);
one mixing adapters takes the per-layer path; no captured decode graph runs adapted rows.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence, Set
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar, cast

import torch
from torch import nn

from radixserve.model.lora.adapter import LoraAdapter, read_adapter
from radixserve.prefix import check_adapter_name, lora_namespace

__all__ = [
    "LoraLinear",
    "LoraRegistry",
    "LoraRows",
    "check_adapter_name",
    "lora_namespace",
    "parse_lora_spec",
    "unwrap",
]

T = TypeVar("T")


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
    """The adapters a model serves (see the module docstring), loaded at start-up or while
    serving (:meth:`add`, :meth:`remove`).

    A slot is never reused while a request holds it: an adapter removed while its requests
    run stops taking new ones at once, but keeps its slot and weights ("draining") until
    :meth:`release` is told none of its requests is left."""

    def __init__(self, model: nn.Module, max_rank: int, max_loaded: int | None = None) -> None:
        self._model, self.max_rank, self.max_loaded = model, max_rank, max_loaded
        self._by_slot: dict[int, LoraAdapter] = {}
        self._slots: dict[str, int] = {}  # the served adapters' names (draining ones: not)
        self._draining: set[int] = set()
        self._memo: dict[tuple[str, str], object] = {}
        self._active = _Active()

    @classmethod
    def load(
        cls, model: nn.Module, specs: Sequence[str], max_rank: int, max_loaded: int | None = None
    ) -> LoraRegistry:
        """Read every adapter of ``specs`` (``name=path``) for ``model`` and wrap the layers
        they target."""
        parsed = [parse_lora_spec(s) for s in specs]
        names = [name for name, _ in parsed]
        if len(set(names)) != len(names):
            raise ValueError(f"two LoRA adapters share a name: {sorted(names)}")
        registry = cls(model, max_rank, max_loaded)
        for name, path in parsed:
            registry.add(name, path)
        return registry

    @property
    def adapters(self) -> list[LoraAdapter]:
        """The served adapters, in slot order."""
        return [self._by_slot[s] for s in sorted(self._slots.values())]

    @property
    def names(self) -> list[str]:
        return [a.name for a in self.adapters]

    @property
    def cache_keys(self) -> dict[str, str]:
        """Each served adapter's :attr:`~LoraAdapter.cache_key`, by name."""
        return {a.name: a.cache_key for a in self.adapters}

    @property
    def draining(self) -> bool:
        """Whether a removed adapter still holds its slot (:meth:`release` frees it)."""
        return bool(self._draining)

    def slot(self, name: str | None) -> int:
        """The slot of adapter ``name`` (0: None, the base model); ``ValueError`` if unknown."""
        return self.lookup(name)[0]

    def lookup(self, name: str | None) -> tuple[int, str | None]:
        """``(slot, cache key)`` of the served adapter ``name`` (``(0, None)``: None, the base
        model); ``ValueError`` if it is not served."""
        if name is None:
            return 0, None
        slot = self._slots.get(name)
        if slot is None:
            served = ", ".join(self.names) or "none"
            raise ValueError(f"unknown LoRA adapter {name!r} (served: {served})")
        return slot, self._by_slot[slot].cache_key

    def add(self, name: str, path: str) -> LoraAdapter:
        """Read the adapter at ``path`` and serve it as ``name`` (:meth:`read`, then
        :meth:`serve`)."""
        return self.serve(self.read(name, path))

    def read(self, name: str, path: str) -> LoraAdapter:
        """The adapter at ``path``, read for this model as ``name`` but not served yet.
        Changes nothing here, so it may run on another thread while steps run (a worker
        reads the files there: :mod:`~radixserve.serving.worker.lora_queue`); ``ValueError``
        for a bad name, no room (checked again by :meth:`serve`), or an adapter that does not
        fit the model."""
        check_adapter_name(name)
        self._check_room(name)
        return read_adapter(name, path, self._model, self.max_rank)

    def serve(self, adapter: LoraAdapter, slot: int | None = None) -> LoraAdapter:
        """Serve ``adapter`` (from :meth:`read`) under its name from the next request on:
        idempotent for the same files under the same name; ``ValueError`` for a name served
        with other files (remove it first) or past ``max_loaded`` adapters. ``slot``: the
        one rank 0 chose (:meth:`next_slot`), on another tensor-parallel rank; an adapter
        draining there is freed first (rank 0 freed it: no request holds it)."""
        free = self.next_slot(adapter)
        if free is None:
            return self._by_slot[self._slots[adapter.name]]
        if slot is not None:
            self.release(self._draining - {slot})
            assert slot not in self._by_slot, f"LoRA slot {slot} is rank 0's free one, not here"
            free = slot
        self._by_slot[free], self._slots[adapter.name] = adapter, free
        self._wrap(adapter)
        return adapter

    def next_slot(self, adapter: LoraAdapter) -> int | None:
        """The slot :meth:`serve` would give ``adapter`` (None: it is served already, from
        the same files); ``ValueError`` where :meth:`serve` would refuse it."""
        name = adapter.name
        self._check_room(name)
        if name in self._slots:
            served = self._by_slot[self._slots[name]]
            if served.cache_key != adapter.cache_key:
                raise ValueError(
                    f"a LoRA adapter named {name!r} is already loaded from {served.path} with "
                    "other weights: unload it first"
                )
            return None
        return next(s for s in itertools.count(1) if s not in self._by_slot)

    def _check_room(self, name: str) -> None:
        """``ValueError`` if serving ``name`` would pass ``max_loaded`` adapters."""
        if name not in self._slots and self.max_loaded is not None:
            if len(self._slots) >= self.max_loaded:
                raise ValueError(
                    f"{len(self._slots)} LoRA adapters are loaded, the most this server "
                    f"serves (--max-loaded-loras): unload one first"
                )

    def remove(self, name: str) -> None:
        """Stop serving ``name`` to new requests (``ValueError`` if it is not served); its slot
        drains until :meth:`release`."""
        if name not in self._slots:
            served = ", ".join(self.names) or "none"
            raise ValueError(f"unknown LoRA adapter {name!r} (served: {served})")
        self._draining.add(self._slots.pop(name))

    def release(self, in_use: Set[int]) -> list[LoraAdapter]:
        """Free the removed adapters whose slots no request holds (``in_use``: the slots
        live requests hold); the adapters freed."""
        freed = [self._by_slot.pop(s) for s in sorted(self._draining - in_use)]
        self._draining &= set(in_use)
        for adapter in freed:
            for key in [k for k in self._memo if k[0] == adapter.cache_key]:
                del self._memo[key]
        return freed

    def memo(self, adapter: LoraAdapter, kind: str, make: Callable[[], T]) -> T:
        """``make()``'s result for ``adapter``, made once while it is loaded (a form of it a
        kernel takes; freed with the adapter)."""
        key = (adapter.cache_key, kind)
        if key not in self._memo:
            self._memo[key] = make()
        return cast("T", self._memo[key])

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
            groups.append((self._by_slot[slot], rows))
        return LoraRows(tuple(groups))

    @contextmanager
    def applied(self, rows: LoraRows | None) -> Iterator[None]:
        """Within it, the wrapped layers add ``rows``' deltas (None: none)."""
        self._active.rows = rows
        try:
            yield
        finally:
            self._active.rows = None

    def _wrap(self, adapter: LoraAdapter) -> None:
        """Wrap the layers ``adapter`` targets that no adapter before it did."""
        for name in sorted(adapter.deltas):
            parent_name, _, attr = name.rpartition(".")
            parent = self._model.get_submodule(parent_name)
            layer = getattr(parent, attr)
            if not isinstance(layer, LoraLinear):
                setattr(parent, attr, LoraLinear(layer, name, self._active))
