"""Quantize a loaded :class:`LlamaForCausalLM` in place: swap its decoder linears (and, where
the config asks, the embedding) for quantized ones and report what was done.

It stands above the model, beside the loader that calls it: it walks one model's modules.
The formats, the layers and the tools it uses are :mod:`radixserve.model.quant`'s, under the
model, so the decoder layers can use them without an arrow running upward.
"""

from __future__ import annotations

import torch
from torch import nn

from radixserve.model.llama import LlamaForCausalLM
from radixserve.model.quant.apply import (
    QuantReport,
    install,
    linear_targets,
    make_quantized_linear,
    module_weight_bytes,
    quantize_weight,
)
from radixserve.model.quant.config import QuantConfig, check_device
from radixserve.model.quant.formats import quantize_int8
from radixserve.model.quant.linear import Int8Embedding, compute_dtype_for


def _linear(model: nn.Module, name: str) -> nn.Linear:
    lin = model.get_submodule(name)
    if not isinstance(lin, nn.Linear):
        raise TypeError(f"{name} is a {type(lin).__name__}, not a linear layer to quantize")
    return lin


def quantize_model(model: LlamaForCausalLM, qcfg: QuantConfig) -> QuantReport:
    """Quantize ``model`` (a loaded :class:`~radixserve.model.llama.LlamaForCausalLM`) in place."""
    cfg = model.config
    device = model.model.norm.weight.device
    act_dtype = model.model.norm.weight.dtype
    check_device(qcfg.method, device)
    cdt = compute_dtype_for(device, act_dtype)
    # A tensor-parallel shard keeps its vocab-parallel embedding and LM head in full precision.
    with_vocab = qcfg.embeddings_quantized(cfg.num_params) and model.shard is None
    names = linear_targets(model, with_vocab)
    group = None
    if qcfg.method == "int4":
        group = qcfg.resolve_group_size([_linear(model, n).in_features for n in names])
    report = QuantReport(qcfg.method, group)
    with torch.no_grad():
        for name in names:
            lin = _linear(model, name)
            q = quantize_weight(qcfg.method, lin.weight, group, cdt)
            install(model, name, make_quantized_linear(qcfg.method, q, lin.bias, cdt))
            report.layers.append(name)
        if with_vocab:
            emb = model.model.embed_tokens
            install(
                model, "model.embed_tokens", Int8Embedding(quantize_int8(emb.weight), act_dtype)
            )
            report.layers.append("model.embed_tokens")
        else:
            report.full_precision = [
                "model.embed_tokens",
                "lm_head" + (" (tied)" if cfg.tie_word_embeddings else ""),
            ]
    report.weight_bytes = module_weight_bytes(model)
    return report
