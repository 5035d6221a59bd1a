"""MXFP4 checkpoints for the tests: gpt-oss experts quantized as the released checkpoints
store them (``radixserve/model/quant/mxfp4.py`` says the format), written from a tiny bf16/fp32
checkpoint of ``tiny_models.build_tiny_family("gpt_oss")``.

The quantizer is the tests' own (nearest e2m1 value under the smallest power-of-two scale
that keeps the group's largest value within 6); the decoding the tests compare against is
transformers' (``transformers.integrations.mxfp4.convert_moe_packed_tensors``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` ``[..., K]`` (K a multiple of 32) -> ``(blocks [..., K/32, 16], scales [..., K/32])``
    uint8: per group of 32, exponent ``ceil(log2(amax / 6))``, each value the nearest e2m1
    code (sign in bit 3), two codes a byte, the low nibble first."""
    x = w.float().reshape(*w.shape[:-1], -1, 32)
    amax = x.abs().amax(-1, keepdim=True)
    exp = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.full_like(amax, -127.0))
    exp = exp.clamp(-127, 127)
    y = x / torch.exp2(exp)
    code = (y.abs()[..., None] - _MAGNITUDES).abs().argmin(-1)
    code = code | ((y < 0).long() << 3)
    blocks = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exp[..., 0] + 127).to(torch.uint8)


def write_mxfp4_twins(src: Path, mxfp4_dir: Path, twin_dir: Path) -> tuple[Path, Path]:
    """From the gpt-oss checkpoint ``src``: ``mxfp4_dir`` with every expert weight as MXFP4
    blocks and scales (as the released checkpoints, with their ``quantization_config``), and
    ``twin_dir`` with the same weights decoded by transformers, in its plain layout. Both
    hold the same model; the tests load each."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    tensors = load_file(str(src / "model.safetensors"))
    packed: dict[str, torch.Tensor] = {}
    plain: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            blocks, scales = quantize_mxfp4(t.transpose(1, 2).contiguous())  # rows: outputs
            packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
            plain[name] = convert_moe_packed_tensors(blocks, scales, dtype=t.dtype).contiguous()
        else:
            packed[name] = plain[name] = t
    config = json.loads((src / "config.json").read_text())
    for out, weights in ((mxfp4_dir, packed), (twin_dir, plain)):
        out.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.is_file() and f.suffix != ".safetensors":
                shutil.copy(f, out / f.name)
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router"],
    }
    (mxfp4_dir / "config.json").write_text(json.dumps(config, indent=2))
    return mxfp4_dir, twin_dir
