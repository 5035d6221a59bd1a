"""gpt-oss's expert tensors as its checkpoints store them -> the per-expert names the MoE
block loads (``layers/moe.py``: ``experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``, each
with its bias; the router as ``gate``).

The checkpoint holds each layer's experts stacked and transposed, gate and up interleaved::

    mlp.router.weight [E, H], .bias [E]             -> mlp.gate.weight, mlp.gate.bias
    mlp.experts.gate_up_proj      [E, H, 2I]        -> experts.{e}.gate_proj.weight = W_e.T[0::2]
                                                       experts.{e}.up_proj.weight   = W_e.T[1::2]
    mlp.experts.gate_up_proj_bias [E, 2I]           -> gate_proj.bias = b_e[0::2], up_proj.bias = b_e[1::2]
    mlp.experts.down_proj         [E, I, H]         -> experts.{e}.down_proj.weight = W_e.T
    mlp.experts.down_proj_bias    [E, H]            -> experts.{e}.down_proj.bias

and in the released checkpoints the two weights as MXFP4 (``model/quant/mxfp4.py``):
``gate_up_proj_blocks`` ``[E, 2I, H / 32, 16]`` with ``gate_up_proj_scales`` ``[E, 2I, H / 32]``
(rows already the output features, not transposed), ``down_proj_blocks`` / ``_scales`` the
same for ``[E, H, I]``. A layer's blocks and scales are paired as they come (both mapped from
the file, not read) and decoded one expert at a time, to the load dtype, as they are yielded:
the loader copies each into the model before the next is decoded.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from radixserve.model.quant.mxfp4 import dequantize_mxfp4

_EXPERTS = ".mlp.experts."


def gpt_oss_expert_tensors(
    weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` with gpt-oss's router and expert tensors renamed and cut per expert
    (module docstring; MXFP4 weights decoded to ``dtype``); every other tensor as it is."""
    pending: dict[str, torch.Tensor] = {}  # a blocks or scales tensor waiting for its twin
    for name, tensor in weights:
        if ".mlp.router." in name:
            yield name.replace(".mlp.router.", ".mlp.gate."), tensor
            continue
        prefix, sep, what = name.partition(_EXPERTS)
        if not sep:
            yield name, tensor
            continue
        if what.endswith(("_blocks", "_scales")):
            stem, _, part = what.rpartition("_")
            twin = f"{prefix}{_EXPERTS}{stem}_{'scales' if part == 'blocks' else 'blocks'}"
            if twin not in pending:
                pending[name] = tensor
                continue
            other = pending.pop(twin)
            blocks, scales = (tensor, other) if part == "blocks" else (other, tensor)
            for e in range(blocks.shape[0]):
                weight = dequantize_mxfp4(blocks[e], scales[e], dtype)  # [out, in]
                yield from _expert(prefix, e, stem, weight, "weight")
            continue
        stem, _, kind = what.partition("_proj")
        stem += "_proj"
        if kind not in ("", "_bias"):
            raise KeyError(f"unexpected gpt-oss expert tensor {name!r}")
        for e in range(tensor.shape[0]):
            if kind == "_bias":
                yield from _expert(prefix, e, stem, tensor[e], "bias")
            else:  # stored [in, out]: the linear's [out, in] is its transpose
                yield from _expert(prefix, e, stem, tensor[e].t(), "weight")
    if pending:
        raise KeyError(f"MXFP4 tensors without their blocks or scales: {sorted(pending)[:4]}")


def _expert(
    prefix: str, e: int, stem: str, value: torch.Tensor, kind: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """Expert ``e``'s tensors of ``stem`` (``gate_up_proj``: the interleaved rows split into
    gate and up; ``down_proj``: as it is, contiguous) under the per-expert names."""
    base = f"{prefix}{_EXPERTS}{e}."
    if stem == "gate_up_proj":
        yield f"{base}gate_proj.{kind}", value[0::2]
        yield f"{base}up_proj.{kind}", value[1::2]
    elif stem == "down_proj":
        yield f"{base}down_proj.{kind}", value.contiguous()
    else:
        raise KeyError(f"unexpected gpt-oss expert tensor {prefix}{_EXPERTS}{stem}")
