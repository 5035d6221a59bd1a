"""A CPU model's weights discarded and their memory given back to the OS (SGLang's
``release_memory_occupation`` with tag ``weights`` and no CPU backup, vLLM's ``sleep``
level 2): what an RL loop does while the trainer needs the machine's memory, before it
loads the next policy with ``update_weights_from_disk``.

What is discarded is exactly what an update writes
(:func:`~radixserve.model.weight_update.served_tensors`): every parameter, buffer and
quantized copy is given back with ``MADV_DONTNEED`` (:func:`~radixserve.memory.release.discard`;
it reads as zeros afterwards), and oneDNN's packed copies, which have no storage to advise,
are dropped. Tables built from the configuration alone (RoPE's) and LoRA adapters stay: an
update leaves them as they are too. :meth:`ReleasedWeights.restore` makes the model whole
again without its values: each packed copy is rebuilt from zeros, so a forward runs (on
meaningless weights) and an update finds every tensor it writes. The contents are
undefined until the next update, as SGLang and vLLM say of theirs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from radixserve.memory.release import discard
from radixserve.model.cpu_linear import pack_onednn
from radixserve.model.weight_update import Slot, served_tensors


@dataclass
class ReleasedWeights:
    """A model whose weights were released: the bytes given back, and where each dropped
    packed copy goes back (its slot, shape and dtype)."""

    model: nn.Module
    freed: int = 0
    dropped: list[tuple[Slot, torch.Size, torch.dtype]] = field(default_factory=list)

    def restore(self) -> None:
        """Every dropped packed copy rebuilt (from zeros): the model runs again, on
        undefined weights until an update."""
        for slot, shape, dtype in self.dropped:
            slot.rebind(pack_onednn(torch.zeros(shape, dtype=dtype)))
        self.dropped = []
        _derived_again(self.model)


def release_weights(model: nn.Module) -> ReleasedWeights:
    """Give ``model``'s weight memory back to the OS (see the module docstring).
    ``ValueError``, with nothing released, for a tensor off the CPU or in a layout
    neither advised nor rebuilt."""
    tensors = served_tensors(model)
    for _, t in tensors:
        if t.device.type != "cpu" or not (t.layout is torch.strided or t.is_mkldnn):
            raise ValueError(
                f"weights on {t.device} in layout {t.layout} cannot be released "
                "(only CPU tensors and oneDNN's packed copies)"
            )
    released = ReleasedWeights(model)
    seen: set[tuple[int, int]] = set()  # views of one memory (a weight and its gemv view)
    for slot, t in tensors:
        nbytes = t.numel() * t.element_size()
        if t.is_mkldnn:
            released.dropped.append((slot, t.shape, t.dtype))
            slot.rebind(torch.empty(0, dtype=t.dtype))  # the copy's last holder lets go
            released.freed += nbytes
        elif (t.data_ptr(), nbytes) not in seen:
            seen.add((t.data_ptr(), nbytes))
            released.freed += discard(t)
    _derived_again(model)
    return released


def _derived_again(model: nn.Module) -> None:
    """What the model derived from its tensors (the CPU decoder stack, which holds the
    packed copies) is built again at its next forward."""
    replaced = getattr(model, "weights_replaced", None)
    if replaced is not None:
        replaced()
