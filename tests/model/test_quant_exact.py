"""Quantized engines reproduce their weights' reference path bit for bit.

The engine under test serves int8 / int4 (from a checkpoint or a GGUF file) with everything
that changes how a token's rows are grouped: several requests batched, prompts prefilled in
chunks, pages of several tokens, its own prefix reused from the radix cache on a second round.
The reference is the plainest use of the same quantized weights: one sequence at a time,
every step recomputing the whole sequence in one forward (no KV cache reuse, no chunks, no
batch), every linear through the very same packed kernel (``set_dense_min_rows``). The
packed kernels compute each row on its own and the rest of the model is row-wise too, so
the greedy tokens *and* their logprobs must be equal exactly, with no tolerance and no
near-tie allowance. (How close the kernel is to dequantize-then-matmul is
``test_quant_linear``'s tolerance test; the dense prefill path is pinned bit-exactly to
"dequantize to bf16, then the same GEMM" below.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_quant_linear import _logits
from torch import nn

from radixserve.engine.engine import Engine
from radixserve.model.quant import set_dense_min_rows
from radixserve.model.quant.apply import make_quantized_linear, quantize_weight
from radixserve.model.quant.formats import dequantize_int4, dequantize_int8
from radixserve.model.quant.linear import DEQUANT_MIN_ROWS, INT4_DEQUANT_MIN_ROWS
from radixserve.sampling_params import SamplingParams

TOKENS = 8


def plain_greedy(model: nn.Module, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy continuation of one prompt by full recomputation, every linear on its kernel:
    ``n`` tokens and the logprob of each (``log_softmax`` of float32 logits, as the sampler)."""
    saved = {m: m.dense_min_rows for m in model.modules() if hasattr(m, "dense_min_rows")}
    set_dense_min_rows(model, 1 << 30)
    seq, tokens, logprobs = list(prompt), [], []
    try:
        with torch.inference_mode():
            for _ in range(n):
                logits = _logits(model, seq)[-1].float()
                tok = int(logits.argmax())
                tokens.append(tok)
                logprobs.append(torch.log_softmax(logits, dim=-1)[tok].item())
                seq.append(tok)
    finally:
        for m, rows in saved.items():
            m.dense_min_rows = rows
    return tokens, logprobs


def distinct_prompts(vocab: int, seed: int) -> list[list[int]]:
    """Seven random prompts of 1 to 45 tokens.

    No two share a page: the CPU attention kernel reads pages that several sequences of one
    batch share once for the whole group, which sums in another order than one sequence
    alone (as it does unquantized too), so co-batched shared prefixes are not bit-exact
    against any per-sequence reference. Each prompt still reuses its own cached prefix on
    the warm round."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 25, 1, 45, 16, 9, 33)]


def assert_engine_equals_plain(engine: Engine, prompts: list[list[int]], n: int) -> None:
    """Batched, chunked, cold then warm: tokens and logprobs equal the plain reference's."""
    refs = [plain_greedy(engine.model, p, n) for p in prompts]
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=0)
    for round_ in ("cold", "warm"):
        outs = engine.generate(prompts, params)
        engine.check_invariants()
        for i, (out, (tokens, logprobs)) in enumerate(zip(outs, refs)):
            assert out.token_ids == tokens, (round_, i)
            assert [lp.logprob for lp in out.logprobs] == logprobs, (round_, i)
    assert sum(o.usage.cached_tokens for o in outs) > 0  # the warm round reused prefixes


@pytest.mark.parametrize(
    "model,method,page_size",
    [
        ("tiny_llama_dir", "int8", 4),
        ("tiny_llama_dir", "int4", 16),
        ("tiny_qwen2_dir", "int8", 16),  # q/k/v bias, tied embeddings
        ("tiny_qwen2_dir", "int4", 4),
    ],
)
def test_engine_greedy_equals_plain_reference(
    model: str, method: str, page_size: int, request: pytest.FixtureRequest
) -> None:
    # 24 tokens a step: the 25- to 45-token prompts prefill in chunks, beside other
    # requests' decodes, and no forward reaches the dense path.
    engine = Engine(
        str(request.getfixturevalue(model)),
        quantization=method,
        page_size=page_size,
        num_pages=1024 // page_size,
        max_num_tokens=24,
    )
    assert_engine_equals_plain(engine, distinct_prompts(512, seed=7), TOKENS)


def test_gguf_loaded_engine_equals_plain_reference(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Weights read from a Q4_1/Q4_0 GGUF beside the checkpoint (codes mapped directly into int4)."""
    pytest.importorskip("gguf")
    import shutil

    from test_quant_gguf import Q, write_gguf

    model_dir = Path(shutil.copytree(tiny_llama_dir, tmp_path / "model"))
    write_gguf(
        tiny_llama_dir,
        model_dir / "model.gguf",
        {k: Q.Q4_1 for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up")}
        | {"ffn_down": Q.Q4_0},
    )
    engine = Engine(
        str(model_dir), quantization="int4", page_size=16, num_pages=64, max_num_tokens=24
    )
    report = engine.model.quant_report
    assert report.source.startswith("GGUF") and report.direct and not report.requantized
    assert_engine_equals_plain(engine, distinct_prompts(512, seed=8), TOKENS)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_dense_path_is_dequantize_then_the_same_gemm(method: str) -> None:
    """From its ``dense_min_rows`` rows on, a layer's output is exactly the format's own decode
    of the weight (formats.py, not the layer's packed buffers) in bf16 times the activations
    in bf16 through the same GEMM."""
    torch.manual_seed(3)
    w, b = torch.randn(192, 256) * 0.05, torch.randn(192) * 0.1
    q = quantize_weight(method, w, 64 if method == "int4" else None, torch.bfloat16)
    layer = make_quantized_linear(method, q, b, torch.bfloat16)
    decoded = (dequantize_int8 if method == "int8" else dequantize_int4)(q, torch.bfloat16)  # type: ignore[operator]
    assert layer.dense_min_rows == (DEQUANT_MIN_ROWS if method == "int8" else INT4_DEQUANT_MIN_ROWS)
    x = torch.randn(layer.dense_min_rows + 5, 256)
    with torch.inference_mode():
        want = F.linear(x.to(torch.bfloat16), decoded).to(x.dtype) + b
        assert torch.equal(layer(x), want)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_smollm2_engine_equals_plain_reference(smollm2_dir: Path, method: str) -> None:
    """The default model from its Q4_1 GGUF (int4: codes mapped directly; int8: re-quantized),
    batched and chunked, against the plain reference: identical tokens and logprobs."""
    engine = Engine(
        str(smollm2_dir),
        num_pages=256,
        dtype="float32",
        quantization=method,
        max_num_tokens=16,
    )
    assert engine.model.quant_report.source.startswith("GGUF")
    tok = engine.tokenizer
    prompts = [
        tok(text)["input_ids"]
        for text in (
            "The capital of France is",
            "def fibonacci(n):",
            "Once upon a time, in a small village at the edge of a great forest, there lived a "
            "young girl who loved to read books about faraway places",
        )
    ]
    assert max(len(p) for p in prompts) > 16  # one prompt prefills in chunks
    assert_engine_equals_plain(engine, prompts, 8)
