"""Quantized linears against dequantize-then-matmul, engines against their reference path,
and the bad combinations that must fail clearly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from radixserve.engine.config import EngineConfig
from radixserve.model import cpu_gemv
from radixserve.model.loader import load_model
from radixserve.model.quant import QuantConfig, set_reference_mode
from radixserve.model.quant.apply import make_quantized_linear, quantize_weight
from radixserve.model.quant.formats import (
    dequantize_int4,
    dequantize_int8,
    quantize_int4,
    quantize_int8,
)
from radixserve.model.quant.linear import (
    DEQUANT_MIN_ROWS,
    INT4_DEQUANT_MIN_ROWS,
    Int4Linear,
    Int8Embedding,
    QuantizedLinear,
    unpack_cpu_int4,
)


def _reference(layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    """Independent of the layer's own reference: float32 matmul with the decoded weight."""
    xa = x.to(layer.compute_dtype).float() if layer.method != "fp8" else x.float()
    y = xa @ layer.dequantize(torch.float32).t()
    return y if layer.bias is None else y + layer.bias.float()


@pytest.mark.parametrize(
    "method,group", [("int8", None), ("int4", 32), ("int4", 64), ("int4", 128), ("fp8", None)]
)
@pytest.mark.parametrize("rows", [1, 5, DEQUANT_MIN_ROWS + 3, INT4_DEQUANT_MIN_ROWS + 3])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_dequantized_matmul(
    method: str, group: int | None, rows: int, bias: bool
) -> None:
    torch.manual_seed(0)
    n, k = 192, 256
    w = torch.randn(n, k) * 0.05
    b = torch.randn(n) * 0.1 if bias else None
    layer = make_quantized_linear(
        method, quantize_weight(method, w, group, torch.bfloat16), b, torch.bfloat16
    )
    x = torch.randn(rows, k)
    with torch.inference_mode():
        got = layer(x)
        want = _reference(layer, x)
        if method == "fp8":  # the activations are quantized per token too: compare with that
            from radixserve.model.quant.formats import fp8_quantize_rows

            xq, xs = fp8_quantize_rows(x)
            want = (xq.float() * xs) @ layer.dequantize().t() + (0 if b is None else b)
        assert got.shape == (rows, n) and got.dtype == x.dtype
        # bf16 output rounding (and bf16 weights on the dense prefill path): ~1 % of the scale.
        torch.testing.assert_close(got, want, atol=2e-2 * want.abs().max().item(), rtol=2e-2)
        torch.testing.assert_close(
            layer.forward_reference(x), want, atol=2e-2 * want.abs().max().item(), rtol=2e-2
        )
        # The quantized weight is close to the original (the format's own error bound).
        err = (layer.dequantize() - w).abs().max().item()
        assert err < {"int8": 0.05 * 4 / 127, "int4": 0.05 * 8 / 15, "fp8": 0.05 * 4 / 16}[method]


def test_int8_and_int4_rounding_bounds() -> None:
    torch.manual_seed(1)
    w = torch.randn(64, 128)
    q8 = quantize_int8(w)
    assert (dequantize_int8(q8) - w).abs().le(q8.scale[:, None] / 2 + 1e-6).all()
    q4 = quantize_int4(w, 32)
    step = q4.scale.repeat_interleave(32, dim=1)
    assert (dequantize_int4(q4) - w).abs().le(step / 2 + 1e-5).all()
    assert int(q4.codes.max()) == 15 and int(q4.codes.min()) == 0


@pytest.mark.parametrize("n", [16, 48, 64, 80, 192])
def test_int4_cpu_layout_round_trip(n: int) -> None:
    codes = torch.randint(0, 16, (n, 64), dtype=torch.uint8)
    packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    assert torch.equal(unpack_cpu_int4(packed, n, 64), codes)


@pytest.mark.parametrize("gemv", [False, True])
def test_int4_layout_agnostic_decode_matches(gemv: bool) -> None:
    """The identity-matmul decode (used when the packed layout is unknown) gives the same weight,
    in tinygemm's layout and in cpu_gemv's (where it is built)."""
    torch.manual_seed(2)
    q = quantize_int4(torch.randn(96, 128), 32, scale_dtype=torch.bfloat16)
    layer = Int4Linear(q, None, gemv=gemv)
    assert layer.gemv == (gemv and cpu_gemv.available())
    known = layer.int4_weight()
    layer.cpu_layout_known = False
    agnostic = layer.int4_weight()
    assert torch.equal(known.codes, agnostic.codes) and torch.equal(known.codes, q.codes)
    torch.testing.assert_close(layer.dequantize(), dequantize_int4(q))


def _logits(model: nn.Module, seq: list[int]) -> torch.Tensor:
    """Every position's logits of ``seq`` as one prefill through the paged torch backend."""
    from radixserve.memory.pool import KVPool
    from radixserve.model.attention.torch_paged import TorchPagedAttentionBackend
    from radixserve.model.forward_batch import ForwardBatch

    cfg, page = model.config, 16
    pages = list(range(-(-len(seq) // page)))
    pool = KVPool(
        cfg.num_layers, len(pages), page, cfg.num_kv_heads, cfg.head_dim, act_dtype=torch.float32
    )
    batch = ForwardBatch.from_pages([pages], [0], [len(seq)], page)
    batch.input_ids = torch.tensor(seq)
    batch.logits_indices = torch.arange(len(seq))
    attn = TorchPagedAttentionBackend(pool)
    attn.init_forward_metadata(batch)
    return model.forward(batch, attn)


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("model", ["tiny_llama_dir", "tiny_qwen2_dir"])
@pytest.mark.parametrize("rows", [6, 40, 330])
def test_model_logits_equal_reference_path(
    method: str, model: str, rows: int, request: pytest.FixtureRequest
) -> None:
    """Same quantized weights, kernels (6 rows) or the dense prefill path (int8: 40 rows,
    int4: 330) vs the dequantize-then-matmul reference: the same logits up to bf16 output
    rounding. (The exact greedy comparison is tests/model/test_quant_exact.py.)"""
    qmodel = load_model(request.getfixturevalue(model), quantization=method, announce=False)
    seq = list(range(3, 3 + rows))
    fast = _logits(qmodel, seq)
    set_reference_mode(qmodel, True)
    ref = _logits(qmodel, seq)
    full = _logits(load_model(request.getfixturevalue(model), announce=False), seq)
    diff, quant_err = (fast - ref).abs().max().item(), (ref - full).abs().max().item()
    assert diff <= 0.05 * quant_err + 2e-3 * ref.abs().max().item(), (diff, quant_err)
    assert (fast.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_quantized_embeddings_and_head(tiny_qwen2_dir: Path) -> None:
    """Tied model with the vocabulary quantized: int8 embedding rows, a quantized LM head,
    logits close to full precision, and the kernels still match the reference path."""
    full = load_model(tiny_qwen2_dir, announce=False)
    model = load_model(
        tiny_qwen2_dir, quantization=QuantConfig("int8", quantize_embeddings=True), announce=False
    )
    assert isinstance(model.model.embed_tokens, Int8Embedding)
    assert isinstance(model.lm_head, QuantizedLinear)
    assert "lm_head" in model.quant_report.layers and not model.quant_report.full_precision
    ids = torch.tensor([1, 5, 9, 20, 33])
    emb_err = (model.model.embed_tokens(ids) - full.model.embed_tokens(ids)).abs().max()
    assert emb_err <= full.model.embed_tokens.weight.abs().max() / 127
    small = load_model(tiny_qwen2_dir, quantization="int8", announce=False)
    assert type(small.model.embed_tokens) is nn.Embedding  # small model: vocabulary kept by default
    assert small.quant_report.full_precision == ["model.embed_tokens", "lm_head (tied)"]
    assert small.quant_report.weight_bytes < full_weight_bytes(full)


def full_weight_bytes(model: nn.Module) -> int:
    from radixserve.model.quant.apply import module_weight_bytes

    return module_weight_bytes(model)


def test_bad_combinations_are_clear_errors(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="fp8 needs a CUDA GPU"):
        EngineConfig(quantization="fp8", device="cpu")
    with pytest.raises(ValueError, match="does not divide the input dimension 64"):
        load_model(tiny_llama_dir, quantization=QuantConfig("int4", group_size=256), announce=False)
    with pytest.raises(ValueError, match="group size must be one of"):
        QuantConfig("int4", group_size=48)
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        EngineConfig(quantization="int3")
    with pytest.raises(ValueError, match="applies to int4 only"):
        EngineConfig(quantization="int8", quant_group_size=32)
    with pytest.raises(ValueError, match="needs quantization='int4'"):
        EngineConfig(quant_group_size=32)
    with pytest.raises(ValueError, match="fp8 needs a CUDA GPU"):
        load_model(tiny_llama_dir, quantization="fp8", announce=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)")
@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_cuda_linear_matches_reference_and_graph_replay(method: str) -> None:
    """CUDA kernels (tinygemm int4, int8pack, _scaled_mm) against the reference, eager and
    replayed from a captured CUDA graph (decode steps run that way)."""
    from radixserve.model.quant.config import check_device

    dev = torch.device("cuda")
    try:
        check_device(method, dev)
    except ValueError as e:
        pytest.skip(str(e))
    torch.manual_seed(0)
    w = (torch.randn(256, 512) * 0.05).to(dev)
    layer = make_quantized_linear(
        method,
        quantize_weight(method, w, 128 if method == "int4" else None, torch.bfloat16),
        None,
        torch.bfloat16,
    )
    x = torch.randn(8, 512, device=dev, dtype=torch.bfloat16)
    with torch.inference_mode():
        eager = layer(x)
        ref = layer.forward_reference(x)
        torch.testing.assert_close(
            eager.float(), ref.float(), atol=2e-2 * ref.abs().max().item(), rtol=2e-2
        )
        graph = torch.cuda.CUDAGraph()
        static_x = x.clone()
        layer(static_x)  # warm-up outside capture
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            static_y = layer(static_x)
        static_x.copy_(x * 0.5)
        graph.replay()
        torch.testing.assert_close(static_y, layer(x * 0.5))


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_dense_cache_layer(method: str) -> None:
    """``cache_dense_weight``: batches of the method's ``cached_dense_min_rows`` rows or more
    multiply with the kept bf16 copy (close to dequantize-then-matmul), fewer rows stay on the
    packed kernel bit for bit, and the copy's 2 bytes per weight are counted."""
    from radixserve.model.quant.linear import (
        CACHED_DENSE_MIN_ROWS,
        INT8_CACHED_DENSE_MIN_ROWS,
        Int8Linear,
    )

    assert Int8Linear.cached_dense_min_rows == INT8_CACHED_DENSE_MIN_ROWS
    torch.manual_seed(4)
    w = torch.randn(192, 256) * 0.05
    q = quantize_weight(method, w, 64 if method == "int4" else None, torch.bfloat16)
    plain = make_quantized_linear(method, q, None, torch.bfloat16)
    cached = make_quantized_linear(method, q, None, torch.bfloat16)
    assert cached.cache_dense_weight() == 2 * 192 * 256
    assert cached.weight_bytes() == plain.weight_bytes() + 2 * 192 * 256
    with torch.inference_mode():
        min_rows = cached.cached_dense_min_rows
        assert min_rows == (
            INT8_CACHED_DENSE_MIN_ROWS if method == "int8" else CACHED_DENSE_MIN_ROWS
        )
        assert cached.dense_min_rows == min_rows
        few = torch.randn(min_rows - 1, 256)
        assert torch.equal(cached(few), plain(few))
        many = torch.randn(min_rows + 9, 256)
        want = _reference(plain, many)
        torch.testing.assert_close(
            cached(many), want, atol=2e-2 * want.abs().max().item(), rtol=2e-2
        )


def test_dense_cache_engine_and_planner(tiny_llama_dir: Path) -> None:
    """``quant_dense_cache``: the report and the planner count the bf16 copies; decoding at a
    batch of several rows gives the tokens of the same engine without them (a random model's
    near-ties aside, the copies hold the very weights the kernels decode). int4, whose copies
    serve batches from 4 rows (int8's from 128)."""
    from radixserve.engine.engine import Engine
    from radixserve.memory.planner import weight_bytes
    from radixserve.model.config import ModelConfig
    from radixserve.sampling_params import SamplingParams

    cfg = ModelConfig.from_pretrained(tiny_llama_dir)
    engines = {
        cache: Engine(
            str(tiny_llama_dir), quantization="int4", num_pages=64, quant_dense_cache=cache
        )
        for cache in (False, True)
    }
    plain, cached = (engines[c].model.quant_report for c in (False, True))
    linears = sum(
        m.in_features * m.out_features
        for m in engines[True].model.modules()
        if isinstance(m, QuantizedLinear)
    )
    assert cached.dense_cache_bytes == 2 * linears and "bf16 copies" in cached.summary()
    assert cached.weight_bytes == plain.weight_bytes + 2 * linears
    f32 = torch.float32
    assert (
        weight_bytes(cfg, f32, "int4", quant_dense_cache=True)
        == weight_bytes(cfg, f32, "int4") + 2 * linears
    )
    prompts = [[5, 9, 33, 7], [100, 4], [8] * 11, [77, 78, 79], [3, 4, 5, 6, 7]]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)
    outs = {c: e.generate(prompts, params) for c, e in engines.items()}
    for a, b in zip(outs[False], outs[True]):
        diffs = [abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)]
        assert a.token_ids[:1] == b.token_ids[:1] and max(diffs[:1]) < 0.05
    engines[True].check_invariants()
    with pytest.raises(ValueError, match="quant_dense_cache needs quantization"):
        EngineConfig(quant_dense_cache=True)
    with pytest.raises(ValueError, match="applies to int8 and int4"):
        QuantConfig("fp8", dense_cache=True)
