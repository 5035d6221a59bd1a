"""Load a Hugging Face checkpoint directory (safetensors) into :class:`LlamaForCausalLM`.

The model is built on the ``meta`` device (no allocation), then each tensor goes straight
from the safetensors memory map into its parameter: zero copies when the checkpoint dtype
and device already match (the parameter *is* the mmapped tensor), one conversion copy
otherwise, and one copy into a slice for the fused q/k/v and gate/up weights. No state dict
is ever materialised beside the model.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from radixserve.memory import hugepages
from radixserve.memory.sharding import DeviceShard
from radixserve.model import cpu_linear
from radixserve.model.config import ModelConfig
from radixserve.model.llama import LlamaForCausalLM
from radixserve.model.parallel import (
    TensorSlice,
    TPGroup,
    TPShard,
    checkpoint_slice,
    local_tensor_name,
)
from radixserve.model.quant import QuantConfig, QuantReport

logger = logging.getLogger(__name__)

_DTYPE_NAMES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """``torch.float32`` / ``"float32"`` / ``"bf16"`` ... -> a supported activation dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"unsupported model dtype {dtype}")
        return dtype
    try:
        return _DTYPE_NAMES[dtype.lower().replace("torch.", "")]
    except KeyError:
        raise ValueError(
            f"unsupported model dtype {dtype!r}; use float32, bfloat16 or float16"
        ) from None


_SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
}


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's safetensors files (sharded via ``model.safetensors.index.json`` or not)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return files


def iter_safetensors(
    path: Path,
    shard: TPShard | None = None,
    head_dim: int = 0,
    keep: Callable[[str], bool] | None = None,
    rename: Callable[[str], str | None] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of the checkpoint, backed by the file's mmap.

    With a tensor-parallel ``shard`` each tensor is only the rank's part of it, read with
    ``get_slice`` (only those bytes of the mapped file are touched; no rank copies a whole
    tensor it does not keep; under expert parallelism the other ranks' experts are skipped
    unread and the rank's own renamed to its local index, ``tp_shard.local_tensor_name``).
    With ``keep``, only the names it accepts (the others are never read: a pipeline stage).
    ``rename`` maps each checkpoint name first (a multimodal checkpoint's text model,
    ``Family.weight_name``; None: a tensor that is never read)."""
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for stored in f.keys():
                name = stored if rename is None else rename(stored)
                if name is None or (keep is not None and not keep(name)):
                    continue
                local = name if shard is None else local_tensor_name(name, shard)
                if local is None:
                    continue
                cut = None if shard is None else checkpoint_slice(name, shard, head_dim)
                if cut is None:
                    yield local, f.get_tensor(stored)
                    continue
                part = f.get_slice(stored)
                if cut.zero:
                    dtype = _SAFETENSORS_DTYPES[part.get_dtype()]
                    yield local, torch.zeros(part.get_shape(), dtype=dtype)
                else:
                    yield local, _read_ranges(part, cut)


def _read_ranges(part: Any, cut: TensorSlice) -> torch.Tensor:
    """The ranges of ``cut`` read from a safetensors slice, concatenated along ``cut.dim``."""
    lead = (slice(None),) * cut.dim
    pieces = [part[(*lead, slice(lo, hi))] for lo, hi in cut.ranges]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=cut.dim)


# The transformer's own tensors, as a base model's checkpoint names them (Qwen3Model,
# LlamaModel: embedding models such as Qwen3-Embedding are saved without the causal LM).
_BASE_MODEL_ROOTS = ("layers.", "embed_tokens.", "norm.")


def base_model_name(name: str) -> str:
    """A base model checkpoint's tensor under the causal LM's name (``model.`` before it)."""
    return "model." + name if name.startswith(_BASE_MODEL_ROOTS) else name


def checkpoint_names(cfg: ModelConfig) -> Callable[[str], str | None]:
    """How ``cfg``'s checkpoint names its tensors, where it differs from the model's names:
    a base model's checkpoint (:func:`base_model_name`), a multimodal checkpoint served as
    its text model (the family's ``weight_name``); None for a tensor never read (a layer past
    the model's: :func:`_beyond_layers`)."""
    from radixserve.model.families import family_of

    family = family_of(cfg.model_type)
    own = None if family is None else family.weight_name
    n = cfg.num_layers

    def name_of(stored: str) -> str | None:
        name = base_model_name(stored) if own is None else own(base_model_name(stored))
        return None if name is None or _beyond_layers(name, n) else name

    return name_of


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _beyond_layers(name: str, num_layers: int) -> bool:
    """Whether ``name`` belongs to a layer past the model's (GLM-4.5's and DeepSeek-V3's
    multi-token-prediction layers, stored after the decoder's: never read, as vLLM and
    SGLang leave them without speculative decoding)."""
    found = _LAYER.match(name)
    return found is not None and int(found.group(1)) >= num_layers


def as_quant_config(quantization: QuantConfig | str | None) -> QuantConfig | None:
    """``None`` / ``"none"`` / ``"int8"`` / a :class:`QuantConfig` -> a QuantConfig or None."""
    if quantization is None or isinstance(quantization, QuantConfig):
        return quantization
    return None if quantization.lower() in ("", "none") else QuantConfig(quantization.lower())


def load_model(
    path: str | Path,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    pack_linears: bool = True,
    quantization: QuantConfig | str | None = None,
    announce: bool = True,
    tp: TPGroup | None = None,
    stage: DeviceShard | None = None,
    expert_parallel: bool = False,
) -> LlamaForCausalLM:
    """Build the model of the checkpoint directory ``path`` and load its weights.

    ``dtype`` is the run dtype (float32, bfloat16, float16); weights saved in another dtype
    are converted while loading. ``model.config`` is the :class:`ModelConfig`. On CPU,
    ``pack_linears`` runs the linear layers through oneDNN with pre-packed weights
    (:mod:`radixserve.model.cpu_linear`) where the build supports the dtype.

    ``quantization`` (``int8`` | ``int4`` | ``fp8`` or a :class:`QuantConfig`) swaps the
    linear layers for quantized ones (:mod:`radixserve.model.quant`). Weights come from the
    directory's GGUF file when it has one and a method is asked (4-bit blocks load without
    the float32 detour), or when it has no safetensors at all (``--model file.gguf``; then the
    method defaults to the file's nearest one). ``model.quant_report`` says what was done;
    ``announce`` prints it to stderr.

    ``tp`` (two or more ranks): build and load only this rank's tensor-parallel shard, from
    the same safetensors files every rank maps (GGUF checkpoints are not sharded);
    ``expert_parallel``: a MoE model's experts spread whole over the ranks instead of each
    cut on its width (refused with ``stage``).

    ``stage`` (a pipeline stage, :mod:`radixserve.memory.sharding`) builds and loads only that
    stage's layers (:class:`~radixserve.model.pipeline_stage.LlamaPipelineStage`, with ``tp``
    its stage's tensor-parallel share), reading none of the other stages' tensors.
    """
    path = Path(path)
    dtype = parse_dtype(dtype)
    device = torch.device(device)
    qcfg = as_quant_config(quantization)
    cfg = _read_config(path, dtype, device)
    gguf = _gguf_source(path, qcfg, tp, stage)
    model: LlamaForCausalLM
    report: QuantReport | None = None
    if stage is not None and stage.pp_size > 1:
        if cfg.classifier is not None:  # its head and pooled row are on the last stage only
            raise ValueError("pipeline parallelism is not supported for sequence classifiers")
        if expert_parallel:
            raise ValueError("expert parallelism is not supported with pipeline parallelism")
        model = _load_stage(path, cfg, stage, tp, dtype, device)
    elif gguf is not None:
        model, report, qcfg = _load_gguf(gguf, cfg, dtype, device, qcfg)
    else:
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg, tp, expert_parallel=expert_parallel)
        model.load_weights(
            iter_safetensors(path, model.shard, cfg.head_dim, rename=checkpoint_names(cfg)),
            dtype=dtype,
            device=device,
        )
        if qcfg is not None:
            from radixserve.model.quantize import quantize_model

            report = quantize_model(model, qcfg)
    _place_weights(model, report, qcfg, device, pack_linears)
    model.quant_report = report
    if report is not None:
        logger.info("%s", report.summary())
        if announce:
            print(f"[radixserve] {report.summary()}", file=sys.stderr, flush=True)
    return model.eval()


def _read_config(path: Path, dtype: torch.dtype, device: torch.device) -> ModelConfig:
    """The checkpoint's config, with a warning for the combinations that run poorly."""
    if dtype is torch.float16 and device.type == "cpu":
        logger.warning(
            "float16 on CPU is slow and poorly supported by some ops; prefer bfloat16 or float32"
        )
    return ModelConfig.from_pretrained(path)


def _gguf_source(
    path: Path, qcfg: QuantConfig | None, tp: TPGroup | None, stage: DeviceShard | None
) -> Path | None:
    """The GGUF file to load the weights from, or None for the safetensors; refuses the
    parallel layouts a GGUF file cannot feed."""
    from radixserve.model_store import model_gguf

    has_safetensors = (path / "model.safetensors.index.json").is_file() or any(
        path.glob("*.safetensors")
    )
    # Tensor parallelism shards the safetensors (quantized after loading, when asked).
    wants_gguf = qcfg is not None and tp is None
    gguf = model_gguf(path) if (wants_gguf or not has_safetensors) else None
    if gguf is not None and has_safetensors and importlib.util.find_spec("gguf") is None:
        logger.warning(
            "the `gguf` package is not installed: quantizing %s's float weights instead of its GGUF",
            path,
        )
        gguf = None
    if gguf is not None and tp is not None:
        raise ValueError(
            f"tensor parallelism loads safetensors shards; {path} has only a GGUF file "
            "(convert it, or run with --tensor-parallel-size 1)"
        )
    if stage is not None and stage.pp_size > 1 and (qcfg is not None or gguf is not None):
        raise ValueError(
            "pipeline parallelism loads safetensors checkpoints without weight quantization"
        )
    return gguf


def _load_stage(
    path: Path,
    cfg: ModelConfig,
    stage: DeviceShard,
    tp: TPGroup | None,
    dtype: torch.dtype,
    device: torch.device,
) -> LlamaForCausalLM:
    """One pipeline stage's layers, reading none of the other stages' tensors."""
    from radixserve.model.pipeline_stage import LlamaPipelineStage

    with torch.device("meta"):
        model = LlamaPipelineStage(cfg, stage, tp)
    model.load_weights(
        iter_safetensors(
            path, model.shard, cfg.head_dim, keep=model.keeps, rename=checkpoint_names(cfg)
        ),
        dtype=dtype,
        device=device,
    )
    return model


def _load_gguf(
    gguf: Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    qcfg: QuantConfig | None,
) -> tuple[LlamaForCausalLM, QuantReport | None, QuantConfig | None]:
    """The model built from a GGUF file; without a method asked, in the file's nearest one."""
    from radixserve.model.gguf_loader import load_gguf_model
    from radixserve.model.quant.gguf_weights import GGUFFile

    gg = GGUFFile(gguf)  # read once: its metadata (a vocabulary's strings) is slow to read
    if qcfg is None:
        method = gg.nearest_method()
        qcfg = QuantConfig(method) if method else None
    model, report = load_gguf_model(gg, cfg, dtype, device, qcfg)
    return model, report, qcfg


def _place_weights(
    model: LlamaForCausalLM,
    report: QuantReport | None,
    qcfg: QuantConfig | None,
    device: torch.device,
    pack_linears: bool,
) -> None:
    """The loaded weights' last form: decoded copies (--quant-dense-cache), huge pages and
    oneDNN-packed linears on the CPU."""
    if report is not None and qcfg is not None and qcfg.dense_cache:
        from radixserve.model.quant.apply import cache_dense_weights, module_weight_bytes

        report.dense_cache_bytes = cache_dense_weights(model)
        report.weight_bytes = module_weight_bytes(model)
    if device.type == "cpu":
        # Before packing: the packed layers keep views of the weights they are given.
        hugepages.move_to_hugepages(model)
    if pack_linears and device.type == "cpu":
        # Quantized models keep every token's logits independent of its batch.
        cpu_linear.pack_linears(model, batch_invariant_head=report is not None)
