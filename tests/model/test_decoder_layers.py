"""The one-call decoder stack (``decoder_stack.py``) is the per-layer Python path, bit for bit.

Both run the same kernels in the same order, so an engine generating with the stack and one
generating without it must agree exactly: tokens and logprobs, for plain fp32/bf16 weights,
int8 and int4, q/k/v biases and tied embeddings (Qwen2), per-head q/k norms (Qwen3),
post-norms and whole-projection q/k norms (OLMo 2), sliding windows with and without a
window pool (Mistral), int8 and fp8 KV pages, Gemma 2 and 3's sandwich norms, GELU, soft-cap, interleaved windows
and local RoPE, GQA and MQA, over staggered
requests of which up to four decode together, cold and then warm (prefix reuse). The
stack must also really have served the decode steps, run int8's dense path past its
crossover, and step aside where a layer's kernel changes (reference mode).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixserve.engine.engine import Engine
from radixserve.model import cpu_gemv, native
from radixserve.model.decoder_stack import KIND_DENSE, KIND_INT4_GEMV, KIND_INT8, DecoderStack
from radixserve.model.quant import set_dense_min_rows, set_reference_mode
from radixserve.model.quant.linear import UNLIMITED_ROWS
from radixserve.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(
    not (native.load() and cpu_gemv.available()), reason="needs the CPU kernels (AVX-512 bf16)"
)


@pytest.fixture(scope="module")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3 (q/k RMSNorm per head, weights perturbed from ones)."""
    import tiny_models

    return tiny_models.build_tiny_family(
        tmp_path_factory.mktemp("qwen3"), "qwen3", tokenizer=True, head_dim=16
    )


@pytest.fixture(scope="module")
def tiny_olmo2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random OLMo 2 (post-norms, q/k RMSNorm over the whole projections)."""
    import tiny_models

    return tiny_models.build_tiny_family(
        tmp_path_factory.mktemp("olmo2"), "olmo2", tokenizer=True, head_dim=16
    )


@pytest.fixture(scope="module")
def tiny_mistral_window_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Mistral whose sliding window (6, not a whole number of 4-token pages)
    is far shorter than the prompts and their continuations."""
    import tiny_models

    return tiny_models.build_tiny_family(
        tmp_path_factory.mktemp("mistral"), "mistral", tokenizer=True, sliding_window=6
    )


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(3, vocab, (20,), generator=g).tolist()  # a common prefix for some
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (3, 17, 1, 9)] + [
        shared + [5, 6],
        shared + [7],
    ]


def _generate(engine: Engine, stack: bool, calls: list[int]) -> list[tuple[list[int], list[float]]]:
    engine.model.native_stack = stack
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)
    out = []
    for _ in ("cold", "warm"):
        for o in engine.generate(_prompts(engine.model.config.vocab_size), params):
            out.append((o.token_ids, [lp.logprob for lp in o.logprobs]))
        engine.check_invariants()
    return out


@pytest.mark.parametrize(
    "model,dtype,method",
    [
        ("tiny_llama_dir", "float32", None),
        ("tiny_llama_dir", "bfloat16", None),
        ("tiny_qwen2_dir", "float32", None),  # q/k/v bias, tied embeddings
        ("tiny_mqa_dir", "float32", None),
        ("tiny_llama_dir", "float32", "int8"),
        ("tiny_qwen2_dir", "float32", "int4"),
        ("tiny_qwen3_dir", "float32", None),  # per-head q/k norms, in the stack too
        ("tiny_qwen3_dir", "bfloat16", None),
        ("tiny_olmo2_dir", "float32", None),  # post-norms, whole-projection q/k norms
        ("tiny_olmo2_dir", "bfloat16", None),
    ],
)
def test_stack_equals_per_layer_path(
    model: str,
    dtype: str,
    method: str | None,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _stack_and_per_layer_agree(request.getfixturevalue(model), dtype, method, monkeypatch)


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stack_equals_per_layer_path_over_quantized_kv(
    tiny_llama_dir: Path, dtype: str, kv: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """int8 and fp8 KV pages in the stack: each layer stores its rows quantized (int8 with
    their scales) and attends through the kernel's quantized call, as the per-layer path does,
    so the two generate the same tokens and logprobs and the stack serves the decode steps."""
    engines = _stack_and_per_layer_agree(
        tiny_llama_dir, dtype, None, monkeypatch, kv_cache_dtype=kv
    )
    for engine in engines:
        assert engine.pool.k_scale is not None  # quantized pages, really


@pytest.mark.parametrize(
    "name,dtype,ratio,method",
    [
        ("gemma3", "float32", 0.5, None),
        ("gemma3", "bfloat16", 0.5, None),
        ("gemma3", "float32", 0.0, None),
        ("gemma3", "float32", 0.5, "int8"),  # the GELU product into a quantized down_proj
        ("gemma2", "float32", 0.5, None),
        ("gemma2", "bfloat16", 0.5, None),
    ],
)
def test_stack_equals_per_layer_path_for_gemma(
    name: str,
    dtype: str,
    ratio: float,
    method: str | None,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Gemma in the stack (``families.GEMMAS``): sandwich norms scaling by 1 + weight, GELU
    gates, query_pre_attn_scalar, windowed layers (6) between global ones, with and without
    the window pool; Gemma 3's per-head q/k norms and its sliding layers' own RoPE base,
    Gemma 2's attention soft-cap (the final one is the caller's, after the stack)."""
    import tiny_models
    from families import GEMMAS

    model_type, overrides, _ = GEMMAS[name]
    path = tiny_models.build_tiny_family(
        tmp_path_factory.mktemp(name), model_type, tokenizer=True, **overrides
    )
    engines = _stack_and_per_layer_agree(path, dtype, method, monkeypatch, window_kv_ratio=ratio)
    assert bool(engines[0].pool.window_layers) == (ratio > 0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("ratio", [0.5, 0.0])
def test_stack_equals_per_layer_path_with_window(
    tiny_mistral_window_dir: Path, dtype: str, ratio: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mistral's sliding window (6, prompts up to 22 tokens and 6 more decoded) in the
    stack: each layer attends through its window's plan, over the window pool's pages and
    slots (ratio 0.5, the default) or the global pages (ratio 0: no window pool)."""
    engines = _stack_and_per_layer_agree(
        tiny_mistral_window_dir, dtype, None, monkeypatch, window_kv_ratio=ratio
    )
    for engine in engines:
        assert bool(engine.pool.window_layers) == (ratio > 0)


def _stack_and_per_layer_agree(
    path: Path,
    dtype: str,
    method: str | None,
    monkeypatch: pytest.MonkeyPatch,
    **engine_kw: object,
) -> list[Engine]:
    """Generate with the stack and without it (one fresh engine each): the same tokens and
    logprobs, the stack serving every decode step of the first and none of the second.
    Returns the two engines."""
    calls = [0]
    run = DecoderStack.run

    def counted(self: DecoderStack, *args: object) -> None:
        calls[0] += 1
        run(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(DecoderStack, "run", counted)
    results, engines = [], []
    for stack in (True, False):
        engine = Engine(
            str(path),
            dtype=dtype,
            quantization=method,
            page_size=4,
            num_pages=256,
            max_running_requests=4,
            max_num_tokens=16,
            **engine_kw,
        )
        engines.append(engine)
        before = calls[0]
        results.append(_generate(engine, stack, calls))
        used = calls[0] - before
        assert (used > 0) == stack, used  # the stack served the decode steps, or none
        if stack:  # each layer's own kernel (cpu_gemv's where built: this test needs it)
            want = {None: KIND_DENSE, "int8": KIND_INT8, "int4": KIND_INT4_GEMV}[method]
            assert engine.model._stack is not None and set(engine.model._stack.kinds) == {want}
    assert results[0] == results[1]
    return engines


def test_stack_steps_aside_for_reference_mode(tiny_llama_dir: Path) -> None:
    engine = Engine(str(tiny_llama_dir), quantization="int8", num_pages=64)
    engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0))
    stack = engine.model._stack
    assert stack is not None and stack.max_rows() > 0
    set_reference_mode(engine.model, True)
    assert stack.max_rows() == 0  # the reference path is Python's
    set_reference_mode(engine.model, False)
    assert stack.max_rows() > 0


def test_stack_runs_the_int8_dense_path(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past its crossover an int8 layer decodes its weight and calls the GEMM; the stack does
    the same for those forwards (prefill chunks here), bit for bit."""
    rows: list[int] = []
    run = DecoderStack.run

    def counted(self: DecoderStack, h: torch.Tensor, *args: object) -> None:
        rows.append(h.shape[0])
        run(self, h, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(DecoderStack, "run", counted)
    results = []
    for stack in (True, False):
        engine = Engine(
            str(tiny_llama_dir),
            quantization="int8",
            page_size=4,
            num_pages=256,
            max_running_requests=4,
            max_num_tokens=16,
        )
        set_dense_min_rows(engine.model, 3)  # forwards of 3 rows or more: the dense path
        rows.clear()
        results.append(_generate(engine, stack, []))
        if stack:
            assert engine.model._stack is not None
            assert engine.model._stack.max_rows() == UNLIMITED_ROWS
            assert max(rows) >= 3  # the stack ran forwards past the crossover
        else:
            assert not rows
    assert results[0] == results[1]
