"""Build a :class:`LlamaForCausalLM` straight from a GGUF file, quantized or not.

With a quantization method, each decoder linear is assembled from its GGUF tensors in the
target format (q/k/v and gate/up shards concatenated row-wise, which is exact for per-row
formats): 4-bit blocks go to int4 group 32 bit-exactly, other blocks are dequantized and
re-quantized (:mod:`radixserve.model.quant.gguf_weights`). Norms stay float; the embedding
and LM head follow :class:`QuantConfig`. Without a method every tensor is dequantized into
the run dtype (what the HF conversion of the default model does, without writing a file).
"""

from __future__ import annotations

import torch
from torch import nn

from radixserve.model.config import ModelConfig
from radixserve.model.llama import LlamaForCausalLM
from radixserve.model.quant.apply import (
    QuantReport,
    install,
    make_quantized_linear,
    module_weight_bytes,
    quantize_weight,
)
from radixserve.model.quant.config import QuantConfig, check_device
from radixserve.model.quant.formats import (
    INT4_GROUP_SIZES,
    Int8Weight,
    check_group_size,
    quantize_int8,
)
from radixserve.model.quant.gguf_weights import (
    INT4_DIRECT_TYPES,
    GGUFFile,
    GGUFTensor,
    dequantize,
    int4_from_blocks,
    permute_int4_rows,
)
from radixserve.model.quant.linear import Int8Embedding, compute_dtype_for

_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
# fused module -> its checkpoint shards, in the fused row order (see llama._STACKED).
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.down_proj": ("mlp.down_proj",),
}


def _float(gg: GGUFFile, t: GGUFTensor) -> torch.Tensor:
    """A tensor dequantized to float32, llama.cpp's q/k row permutation undone."""
    w = dequantize(t)
    rows = gg.unpermute_rows(t.name, w.shape[0])
    return w if rows is None else w[rows]


def _concat(parts: list):
    """Row-wise concatenation of quantized weights of one format (per-row formats: exact)."""
    first = parts[0]
    fields = []
    for i, value in enumerate(first):
        fields.append(
            torch.cat([p[i] for p in parts], dim=0) if isinstance(value, torch.Tensor) else value
        )
    return type(first)(*fields)


def _to(weight, device: torch.device):
    return type(weight)(*(v.to(device) if isinstance(v, torch.Tensor) else v for v in weight))


def load_gguf_model(
    gguf: str | GGUFFile,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    qcfg: QuantConfig | None,
) -> tuple[LlamaForCausalLM, QuantReport | None]:
    """The model of ``cfg`` with the weights of ``gguf`` (see the module docstring): a path,
    or the file already read, since reading its metadata (a vocabulary's strings) is slow."""
    gg = gguf if isinstance(gguf, GGUFFile) else GGUFFile(gguf)
    tensors = {t.name: t for t in gg.tensors()}
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    if qcfg is None:
        model.load_weights(
            ((n, _float(gg, t)) for n, t in tensors.items()), dtype=dtype, device=device
        )
        return model, None

    check_device(qcfg.method, device)
    cdt = compute_dtype_for(device, dtype)
    method = qcfg.method
    with_vocab = qcfg.embeddings_quantized(cfg.num_params)
    group = _group_size(qcfg, model, tensors)
    report = QuantReport(method, group, source=f"GGUF {gg.path.name}")

    def quantized(name: str, *, allow_direct: bool = True):
        t = tensors[name]
        if allow_direct and method == "int4" and group == 32 and t.type_name in INT4_DIRECT_TYPES:
            w = int4_from_blocks(t, cdt)
            rows = gg.unpermute_rows(name, t.shape[0])
            report.direct.append(f"{name} {t.type_name}")
            return w if rows is None else permute_int4_rows(w, rows)
        if t.type_name not in _FLOAT_TYPES:
            report.requantized.append(f"{name} {t.type_name}->{method}")
        return quantize_weight(method, _float(gg, t), group, cdt)

    with torch.no_grad():
        for i in range(cfg.num_layers):
            for fused, shards in _FUSED.items():
                prefix = f"model.layers.{i}."
                weight = _concat([quantized(f"{prefix}{s}.weight") for s in shards])
                biases = [f"{prefix}{s}.bias" for s in shards]
                bias = None
                if any(b in tensors for b in biases):
                    bias = torch.cat([_float(gg, tensors[b]) for b in biases]).to(
                        device=device, dtype=dtype
                    )
                install(
                    model,
                    prefix + fused,
                    make_quantized_linear(method, _to(weight, device), bias, cdt),
                )
                report.layers.append(prefix + fused)
        head_name = "lm_head.weight" if "lm_head.weight" in tensors else "model.embed_tokens.weight"
        for name, t in tensors.items():
            if ".layers." in name and name.rsplit(".", 2)[-2] in (
                "input_layernorm",
                "post_attention_layernorm",
            ):
                model._set_param(name, _float(gg, t).to(device=device, dtype=dtype))
            elif name == "model.norm.weight":
                model._set_param(name, _float(gg, t).to(device=device, dtype=dtype))
        emb = tensors["model.embed_tokens.weight"]
        if with_vocab:
            head = quantized(head_name)
            install(model, "lm_head", make_quantized_linear(method, _to(head, device), None, cdt))
            if emb.type_name not in _FLOAT_TYPES:
                report.requantized.append(f"model.embed_tokens.weight {emb.type_name}->int8")
            q = quantize_int8(_float(gg, emb))
            install(
                model,
                "model.embed_tokens",
                Int8Embedding(Int8Weight(q.qweight.to(device), q.scale.to(device)), dtype),
            )
            report.layers += ["lm_head", "model.embed_tokens"]
        else:
            model._set_param(
                "model.embed_tokens.weight", _float(gg, emb).to(device=device, dtype=dtype)
            )
            if head_name == "lm_head.weight" and not cfg.tie_word_embeddings:
                model._set_param(
                    "lm_head.weight", _float(gg, tensors[head_name]).to(device=device, dtype=dtype)
                )
            else:
                model.lm_head.weight = model.model.embed_tokens.weight
            report.full_precision = [
                "model.embed_tokens",
                "lm_head" + (" (tied)" if cfg.tie_word_embeddings else ""),
            ]
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise KeyError(f"{gg.path.name} is missing weights for {missing[:5]}")
    report.weight_bytes = module_weight_bytes(model)
    return model, report


def _group_size(qcfg: QuantConfig, model: nn.Module, tensors: dict[str, GGUFTensor]) -> int | None:
    """int4's group: as asked, else 32 when the file's 4-bit blocks can map onto it directly."""
    if qcfg.method != "int4":
        return None
    in_features = [
        m.in_features
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and ".layers." in n
    ]
    if qcfg.group_size is not None:
        for k in set(in_features):
            check_group_size(k, qcfg.group_size)
        return qcfg.group_size
    if any(t.type_name in INT4_DIRECT_TYPES for t in tensors.values()) and all(
        k % 32 == 0 for k in in_features
    ):
        return 32
    assert 32 in INT4_GROUP_SIZES
    return qcfg.resolve_group_size(in_features)
