"""What to quantize and how: ``--quantization`` and its options, validated against the device."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.model.quant.formats import INT4_GROUP_SIZES, check_group_size

QUANT_METHODS = ("int8", "int4", "fp8")
# Models below this many parameters keep embeddings and the LM head in full precision by
# default: there the vocabulary matrices are a large share of all weights (SmolLM2-135M:
# 21 %) and the logits are the most quantization-sensitive layer.
SMALL_MODEL_PARAMS = 1_000_000_000


@dataclass(frozen=True)
class QuantConfig:
    """``method``: int8 | int4 | fp8. ``group_size``: int4's group (None: the largest of
    128/64/32 dividing every layer's input). ``quantize_embeddings``: also the token embedding
    (int8 rows) and the LM head (None: only for models of 1 B parameters or more).
    ``dense_cache``: int8/int4 linears also keep their weight decoded to bf16 for batches of
    several rows (faster there, 2 more bytes per quantized weight; see quant/linear.py)."""

    method: str
    group_size: int | None = None
    quantize_embeddings: bool | None = None
    dense_cache: bool = False

    def __post_init__(self) -> None:
        if self.method not in QUANT_METHODS:
            raise ValueError(
                f"unknown quantization {self.method!r}; choose one of {', '.join(QUANT_METHODS)}"
            )
        if self.group_size is not None:
            if self.method != "int4":
                raise ValueError(f"a group size applies to int4 only, not {self.method}")
            if self.group_size not in INT4_GROUP_SIZES:
                raise ValueError(
                    f"int4 group size must be one of {INT4_GROUP_SIZES}, got {self.group_size}"
                )
        if self.dense_cache and self.method == "fp8":
            raise ValueError(
                "the dense cache applies to int8 and int4 (fp8's _scaled_mm is a GEMM)"
            )

    def embeddings_quantized(self, num_params: int) -> bool:
        """Whether the embedding and LM head are quantized for a model of ``num_params``."""
        if self.quantize_embeddings is not None:
            return self.quantize_embeddings
        return num_params >= SMALL_MODEL_PARAMS

    def resolve_group_size(self, in_features: list[int]) -> int:
        """int4's group size for layers with these input sizes (``ValueError`` if none fits)."""
        if self.group_size is not None:
            for k in sorted(set(in_features)):
                check_group_size(k, self.group_size)
            return self.group_size
        for g in (128, 64, 32):
            if all(k % g == 0 for k in in_features):
                return g
        raise ValueError(
            f"no int4 group size in (128, 64, 32) divides every layer input size {sorted(set(in_features))}"
        )


def check_device(method: str, device: torch.device | str) -> None:
    """Raise a clear ``ValueError`` when ``method`` cannot run on ``device``."""
    device = torch.device(device)
    if method == "fp8":
        if device.type != "cuda":
            raise ValueError(
                f"--quantization fp8 needs a CUDA GPU with fp8 tensor cores (compute capability >= 8.9, "
                f"torch._scaled_mm); it does not run on {device}. Use --quantization int8 or int4 there."
            )
        if torch.cuda.get_device_capability(device) < (8, 9):
            cap = ".".join(map(str, torch.cuda.get_device_capability(device)))
            raise ValueError(
                f"--quantization fp8 needs compute capability >= 8.9 (Ada/Hopper); {device} has {cap}. "
                "Use --quantization int8 or int4."
            )
    if (
        method == "int4"
        and device.type == "cuda"
        and torch.cuda.get_device_capability(device) < (8, 0)
    ):
        raise ValueError(
            "--quantization int4 on CUDA needs compute capability >= 8.0 (torch's tinygemm kernel)"
        )
