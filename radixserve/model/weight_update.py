"""A served model's weights replaced by another checkpoint's, in place (SGLang's
``update_weights_from_disk``): what an RL loop does after each training step, without
restarting the server.

The new checkpoint is loaded as a second model by the same loader with the same arguments
(dtype, device, quantization), so every tensor the served model holds (parameters, buffers,
the oneDNN-packed and quantized copies, decoded caches) has its counterpart built the same
way from the new weights. Each is then copied into the served model's tensor in place, so
whatever holds those tensors (views the CPU kernels keep; captured CUDA graphs too, by
design: untested on a GPU) reads the new values without being built again. oneDNN's packed
copies have no storage to copy into: those are rebound, and the CPU decoder stack that
lists them is described again at its next forward (:meth:`~radixserve.model.llama.LlamaForCausalLM.weights_replaced`).

Everything is checked before anything is written: the two checkpoints' architectures
(every :class:`~radixserve.model.config.ModelConfig` field but the dtype they were saved
in), then every module's tensors, name by name, shape, dtype and layout. A mismatch is a
``ValueError`` naming it, and the served weights are untouched. LoRA adapters stay: their
deltas do not depend on the base weights (the layers they wrap are reached through them).
Tables a module builds on demand from its configuration alone (RoPE's cos and sin, which
it names in ``CONFIG_CACHES``) stay as they are: the two configurations are the same.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from radixserve.model.config import ModelConfig
from radixserve.model.lora import LoraLinear

log = logging.getLogger(__name__)

# ModelConfig fields two checkpoints of one model may differ in.
_FREE_FIELDS = frozenset({"torch_dtype"})


@dataclass(frozen=True)
class Slot:
    """Where a served tensor lives: ``owner[key]`` (a dict or list) or ``owner.key``."""

    owner: Any
    key: str | int

    def rebind(self, value: torch.Tensor) -> None:
        if isinstance(self.owner, (dict, list)):
            self.owner[self.key] = value  # type: ignore[index]
        else:
            setattr(self.owner, str(self.key), value)


def check_same_architecture(served: ModelConfig, fresh: ModelConfig) -> None:
    """``ValueError`` naming the fields in which ``fresh`` is not ``served``'s architecture."""
    differ = [
        f.name
        for f in dataclasses.fields(served)
        if f.name not in _FREE_FIELDS and getattr(served, f.name) != getattr(fresh, f.name)
    ]
    if differ:
        shown = ", ".join(f"{n} {getattr(served, n)!r} -> {getattr(fresh, n)!r}" for n in differ)
        raise ValueError(f"the new weights are not the served model's architecture: {shown}")


class WeightCopy:
    """``fresh``'s tensors (built as ``served`` was, from other weights) paired with
    ``served``'s, every pair checked when it is made (``ValueError`` when a module or
    tensor has no counterpart of the same shape, dtype and layout): :meth:`apply` then
    writes them. Tensor-parallel ranks each make theirs and apply only once all could."""

    def __init__(self, served: nn.Module, fresh: nn.Module) -> None:
        self._served = served
        self._pairs = _pairs(served, fresh)

    def apply(self) -> int:
        """Copy every tensor into its served counterpart, in place; the bytes copied."""
        copied = 0
        with torch.no_grad():
            for slot, old, new in self._pairs:
                if old.layout is torch.strided:
                    old.copy_(new)
                else:  # oneDNN's packed weights: no storage to write into
                    slot.rebind(new)
                copied += new.numel() * new.element_size()
        replaced = getattr(self._served, "weights_replaced", None)
        if replaced is not None:
            replaced()  # what it derived from its weights is derived again
        self._pairs = []
        return copied


def load_weights_for(served: nn.Module, path: str | Path, **load_args: Any) -> WeightCopy:
    """Checkpoint ``path`` loaded as ``served`` was (``load_args``: ``load_model``'s, this
    rank's share included) and checked against it: the copy to apply. ``ValueError`` for
    another architecture or tensors that do not match."""
    from radixserve.model.loader import load_model

    fresh = load_model(path, announce=False, **load_args)
    check_same_architecture(served.config, fresh.config)  # type: ignore[arg-type]
    return WeightCopy(served, fresh)


def _prepared(prepare: Callable[[], WeightCopy]) -> tuple[WeightCopy | None, str | None]:
    """``prepare()``, or why it failed: one rank of several must still vote when its share
    does not load."""
    try:
        return prepare(), None
    except Exception as exc:
        return None, str(exc) or type(exc).__name__


def lead_update(
    prepare: Callable[[], WeightCopy], agree: Callable[[bool], bool], ranks: str
) -> int:
    """Rank 0's part of an update on several ranks, all or none (tensor parallelism, pipeline
    stages): load and check its share (``prepare``), vote with the others (``agree``: every
    rank's vote, one collective), copy only if all could; the bytes copied. ``ValueError``,
    no rank changed, where any could not (``ranks``: which, in the message)."""
    copy, error = _prepared(prepare)
    if not agree(error is None):
        raise ValueError(error or f"another {ranks} rank refused the weights (its log says why)")
    assert copy is not None
    return copy.apply()


def follow_update(
    prepare: Callable[[], WeightCopy], agree: Callable[[bool], bool], refusal: str
) -> None:
    """Another rank's part of :func:`lead_update`: the same vote, its reason logged
    (``refusal``: the log line's start) where its share does not load."""
    copy, error = _prepared(prepare)
    if error is not None:
        log.warning("%s: %s", refusal, error)
    if agree(error is None) and copy is not None:
        copy.apply()


def copy_weights(served: nn.Module, fresh: nn.Module) -> int:
    """Check, then copy every tensor of ``fresh`` into ``served`` (:class:`WeightCopy`)."""
    return WeightCopy(served, fresh).apply()


def served_tensors(served: nn.Module) -> list[tuple[Slot, torch.Tensor]]:
    """Every tensor an update writes, where it lives: each module's parameters, buffers,
    packed and quantized copies (not the tables named in ``CONFIG_CACHES``, nor LoRA
    adapters' deltas, which no module holds), meta tensors left out."""
    return [
        (slot, t)
        for name, module in served.named_modules()
        for slot, t in _tensors(module, name).values()
        if not t.is_meta
    ]


def _pairs(served: nn.Module, fresh: nn.Module) -> list[tuple[Slot, torch.Tensor, torch.Tensor]]:
    """Each served tensor with its fresh counterpart, every pair checked first."""
    out: list[tuple[Slot, torch.Tensor, torch.Tensor]] = []
    for name, new_module in fresh.named_modules():
        old_module = _served_module(served, name)
        if type(old_module) is not type(new_module):
            raise ValueError(
                f"{name or 'the model'} is a {type(new_module).__name__} in the new weights, "
                f"a {type(old_module).__name__} in the served model"
            )
        old_tensors, new_tensors = _tensors(old_module, name), _tensors(new_module, name)
        if old_tensors.keys() != new_tensors.keys():
            missing = sorted(old_tensors.keys() ^ new_tensors.keys())
            raise ValueError(f"the new weights' tensors differ from the served ones: {missing}")
        for key, (slot, old) in old_tensors.items():
            new = new_tensors[key][1]
            if (old.shape, old.dtype, old.layout) != (new.shape, new.dtype, new.layout):
                raise ValueError(
                    f"{key}: {tuple(new.shape)} {new.dtype} in the new weights, "
                    f"{tuple(old.shape)} {old.dtype} served"
                )
            if new.is_meta and not old.is_meta:
                raise ValueError(f"{key} has no weights in the new checkpoint")
            if not old.is_meta:
                out.append((slot, old, new))
    return out


def _served_module(served: nn.Module, name: str) -> nn.Module:
    """The served module at ``name``, the layer itself where a LoRA adapter wraps it."""
    try:
        module = served.get_submodule(name)
    except AttributeError:
        raise ValueError(f"{name} is in the new weights, not in the served model") from None
    return module.base if isinstance(module, LoraLinear) else module


def _tensors(module: nn.Module, prefix: str) -> dict[str, tuple[Slot, torch.Tensor]]:
    """A module's own tensors (not its children's), by name: parameters, buffers, and the
    tensors it keeps as attributes or in lists (packed and quantized copies)."""
    out: dict[str, tuple[Slot, torch.Tensor]] = {}
    keep = getattr(module, "CONFIG_CACHES", ())  # built from the configuration alone
    for attr, value in vars(module).items():
        if attr in keep:
            continue
        if attr in ("_parameters", "_buffers"):
            for key, t in value.items():
                if t is not None:
                    out[f"{prefix}.{key}"] = (Slot(value, key), t)
        elif isinstance(value, torch.Tensor):
            out[f"{prefix}.{attr}"] = (Slot(module, attr), value)
        elif isinstance(value, list):
            for i, t in enumerate(value):
                if isinstance(t, torch.Tensor):
                    out[f"{prefix}.{attr}[{i}]"] = (Slot(value, i), t)
    return out
