"""GGUF weights: block decoders against gguf's reference, a written GGUF file against the
checkpoint it came from, and the default model's Q4_1 file against its float conversion."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from radixserve.model.config import ModelConfig  # noqa: E402
from radixserve.model.gguf_loader import load_gguf_model  # noqa: E402
from radixserve.model.loader import iter_safetensors, load_model  # noqa: E402
from radixserve.model.quant import QuantConfig  # noqa: E402
from radixserve.model.quant.formats import dequantize_int4, quantize_int4  # noqa: E402
from radixserve.model.quant.gguf_weights import GGUFFile, dequantize, int4_from_blocks  # noqa: E402
from radixserve.model.quant.linear import Int4Linear, Int8Linear  # noqa: E402

Q = gguf.GGMLQuantizationType
_HF_TO_GGUF = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}  # fmt: skip


@pytest.mark.parametrize("kind,block_bytes", [("Q4_0", 18), ("Q4_1", 20), ("Q4_K", 144)])
def test_int4_blocks_decode_like_gguf(kind: str, block_bytes: int) -> None:
    """Random block bytes (any bytes are a valid block once the f16 scales are finite)."""
    rng = np.random.default_rng(0)
    n, k = 16, 512
    block = 256 if kind == "Q4_K" else 32
    raw = rng.integers(0, 256, size=(n, k // block, block_bytes), dtype=np.uint8)
    halves = 2 if kind == "Q4_0" else 4  # the f16 d (and m / dmin) at the start of each block
    raw[..., :halves] = np.frombuffer(
        rng.uniform(-0.1, 0.1, size=n * k // block * halves // 2).astype(np.float16).tobytes(),
        dtype=np.uint8,
    ).reshape(n, k // block, halves)
    raw = raw.reshape(n, -1)
    from radixserve.model.quant.gguf_weights import GGUFTensor

    t = GGUFTensor("w", kind, (n, k), raw, getattr(Q, kind))
    q = int4_from_blocks(t, scale_dtype=torch.float32)
    assert q.group_size == 32 and q.codes.max() <= 15
    want = dequantize(t)
    torch.testing.assert_close(
        dequantize_int4(q), want, atol=1e-6 * want.abs().max().item(), rtol=1e-5
    )


def _llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf q/k permutation (what the loader must undo)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_gguf(ckpt: Path, out: Path, types: dict[str, int]) -> Path:
    """A llama GGUF of the checkpoint; ``types`` maps a GGUF name suffix (``attn_q``...) to a type."""
    cfg = ModelConfig.from_pretrained(ckpt)
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_head_count(cfg.num_q_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    for name, tensor in iter_safetensors(ckpt):
        arr = tensor.float().numpy()
        if name.startswith("model.layers."):
            _, _, idx, rest = name.split(".", 3)
            mod, _, suffix = rest.rpartition(".")
            kind = _HF_TO_GGUF[mod]
            gname = f"blk.{idx}.{kind}.{suffix}"
            if kind in ("attn_q", "attn_k"):
                arr = _llama_permute(arr, cfg.num_q_heads if kind == "attn_q" else cfg.num_kv_heads)
        else:
            kind = {
                "model.embed_tokens.weight": "token_embd",
                "model.norm.weight": "output_norm",
                "lm_head.weight": "output",
            }[name]
            gname = f"{kind}.weight"
        ty = types.get(kind, Q.F32) if arr.ndim == 2 else Q.F32
        if ty == Q.F32:
            w.add_tensor(gname, np.ascontiguousarray(arr))
        else:
            w.add_tensor(gname, gguf.quants.quantize(np.ascontiguousarray(arr), ty), raw_dtype=ty)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_float_gguf_loads_like_the_checkpoint(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Names, q/k un-permutation and fusion: an F32 GGUF gives the checkpoint's exact model."""
    from test_quant_linear import _logits

    path = write_gguf(tiny_llama_dir, tmp_path / "f32.gguf", {})
    cfg = ModelConfig.from_pretrained(tiny_llama_dir)
    model, report = load_gguf_model(str(path), cfg, torch.float32, torch.device("cpu"), None)
    assert report is None
    seq = list(range(3, 20))
    torch.testing.assert_close(
        _logits(model, seq), _logits(load_model(tiny_llama_dir, announce=False), seq)
    )


def test_quantized_gguf_equals_quantizing_its_dequantized_weights(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """4-bit blocks load bit-exactly as int4 group 32. Q4_1 (min/max blocks, like int4's own
    quantizer): the same codes, scales and zeros as int4-quantizing the dequantized tensor.
    Q4_0 (symmetric blocks): decodes to the file's values (scales rounded to bf16). Q8_0 is
    re-quantized, and the report says so."""
    types = {
        "attn_q": Q.Q4_1,
        "attn_k": Q.Q4_1,
        "attn_v": Q.Q4_1,
        "attn_output": Q.Q8_0,
        "ffn_gate": Q.Q4_1,
        "ffn_up": Q.Q4_1,
        "ffn_down": Q.Q4_0,
        "output": Q.Q8_0,
        "token_embd": Q.Q8_0,
    }
    path = write_gguf(tiny_llama_dir, tmp_path / "mix.gguf", types)
    gg = GGUFFile(path)
    assert gg.nearest_method() == "int4"
    cfg = ModelConfig.from_pretrained(tiny_llama_dir)
    model, report = load_gguf_model(
        str(path), cfg, torch.float32, torch.device("cpu"), QuantConfig("int4")
    )
    assert report is not None and report.group_size == 32
    assert len(report.direct) == 6 * cfg.num_layers
    assert sorted(report.requantized) == sorted(
        [f"model.layers.{i}.self_attn.o_proj.weight Q8_0->int4" for i in range(cfg.num_layers)]
    )
    tensors = {t.name: t for t in gg.tensors()}
    for i in range(cfg.num_layers):
        for fused, shards in (
            ("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")),
            ("mlp.gate_up_proj", ("gate_proj", "up_proj")),
        ):
            layer = model.get_submodule(f"model.layers.{i}.{fused}")
            assert isinstance(layer, Int4Linear)
            sub = fused.split(".")[0]
            full = torch.cat(
                [gg_float(gg, tensors[f"model.layers.{i}.{sub}.{s}.weight"]) for s in shards]
            )
            want = quantize_int4(full, 32, scale_dtype=torch.bfloat16)
            got = layer.int4_weight()
            assert torch.equal(got.codes, want.codes)
            assert torch.equal(got.scale, want.scale) and torch.equal(got.zero, want.zero)
        down = model.get_submodule(f"model.layers.{i}.mlp.down_proj")
        file_w = gg_float(gg, tensors[f"model.layers.{i}.mlp.down_proj.weight"])
        torch.testing.assert_close(
            down.dequantize(), file_w, atol=file_w.abs().max().item() * 2**-8, rtol=2**-7
        )
    # Full-precision vocabulary by default (small model); the F32 norms as they were.
    assert report.full_precision == ["model.embed_tokens", "lm_head"]
    # int8 from the same file: everything quantized goes through float (and says so).
    model8, report8 = load_gguf_model(
        str(path), cfg, torch.float32, torch.device("cpu"), QuantConfig("int8")
    )
    assert isinstance(model8.model.layers[0].mlp.down_proj, Int8Linear)
    assert not report8.direct and len(report8.requantized) == 7 * cfg.num_layers


def gg_float(gg: GGUFFile, t) -> torch.Tensor:
    w = dequantize(t)
    rows = gg.unpermute_rows(t.name, w.shape[0])
    return w if rows is None else w[rows]


@pytest.mark.slow
def test_default_model_gguf_int4_is_its_own_q4_1(smollm2_dir: Path) -> None:
    """The default model's Q4_1 file loads as int4 without loss: every layer equals int4-quantizing
    the float32 conversion (which transformers dequantized from the same file)."""
    q = load_model(
        smollm2_dir, dtype=torch.bfloat16, quantization="int4", pack_linears=False, announce=False
    )
    report = q.quant_report
    assert report.source.startswith("GGUF") and len(report.direct) == 210 and not report.requantized
    full = dict(iter_safetensors(smollm2_dir))
    for i in (0, 17, 29):
        layer = q.get_submodule(f"model.layers.{i}.mlp.gate_up_proj")
        w = torch.cat(
            [
                full[f"model.layers.{i}.mlp.gate_proj.weight"],
                full[f"model.layers.{i}.mlp.up_proj.weight"],
            ]
        )
        want = quantize_int4(w, 32, scale_dtype=torch.bfloat16)
        got = layer.int4_weight()
        assert torch.equal(got.codes, want.codes) and torch.equal(got.scale, want.scale)
        assert torch.equal(got.zero, want.zero)


@pytest.mark.slow
def test_gguf_file_as_model(
    smollm2_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--model file.gguf``: config and tokenizer from the file's metadata, weights from its
    blocks in the nearest format (int4 for Q4_1), the same tokens as the default model's
    directory quantized to int4 from the same file."""
    from radixserve.engine.engine import Engine
    from radixserve.model_store import model_gguf
    from radixserve.sampling_params import SamplingParams

    gguf_file = model_gguf(smollm2_dir)
    assert gguf_file is not None and gguf_file.suffix == ".gguf"
    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path))
    params = SamplingParams(max_tokens=8, temperature=0)
    from_file = Engine(str(gguf_file), num_pages=64, dtype="bfloat16")
    report = from_file.model.quant_report
    assert report.method == "int4" and len(report.direct) == 210
    from_dir = Engine(str(smollm2_dir), num_pages=64, dtype="bfloat16", quantization="int4")
    prompt = "The capital of France is"
    assert from_file.tokenizer(prompt)["input_ids"] == from_dir.tokenizer(prompt)["input_ids"]
    assert (
        from_file.generate([prompt], params)[0].token_ids
        == from_dir.generate([prompt], params)[0].token_ids
    )
