"""The engine on the Triton backend (interpreted on CPU) produces the torch backend's greedy tokens.

Covers what the kernel tests cannot: the backend's dispatch (decode-only batches to the
decode kernel, prefill chunks and mixed batches to the extend kernel), the pool's real
layout and scales, and prefix reuse (a warm round reads cached pages written by an
earlier request). The interpreter is slow, so prompts and outputs are short. Under
gpu_check.sh (TRITON_INTERPRET=0) both engines run on cuda.
"""

from __future__ import annotations

from pathlib import Path

import kvcases
import pytest
import torch

from radixkernels.variants import LaunchLog
from radixserve.engine.engine import Engine
from radixserve.sampling_params import SamplingParams


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]


def _greedy_tokens(
    model_dir: Path, prompts: list[list[int]], n: int, rounds: int, **config: object
) -> list[list[list[int]]]:
    # float32 on every device: the two backends must agree token for token (bf16 is the CUDA default).
    engine = Engine(
        str(model_dir),
        num_pages=128,
        page_size=4,
        device=str(kvcases.DEVICE),
        dtype="float32",
        **config,
    )
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    out = []
    for _ in range(rounds):
        out.append([o.token_ids for o in engine.generate(prompts, params)])
        engine.check_invariants()
    return out


def test_triton_engine_matches_torch(tiny_llama_dir: Path) -> None:
    # 8-token steps: the 13-token prompt prefills in chunks beside running decodes.
    prompts = _prompts([13, 5, 1], seed=0)
    kw = dict(max_num_tokens=8)
    want = _greedy_tokens(tiny_llama_dir, prompts, 5, 2, attention_backend="torch", **kw)
    got = _greedy_tokens(tiny_llama_dir, prompts, 5, 2, attention_backend="triton", **kw)
    assert got == want
    assert want[0] == want[1]  # the warm round (cached prefixes) agrees with the cold one


@pytest.mark.parametrize("kv_dtype", ["int8", "int4", "fp8_e4m3"])
def test_triton_engine_quantized_kv_matches_torch(tiny_mqa_dir: Path, kv_dtype: str) -> None:
    """Both backends quantize identically, so greedy tokens agree on a quantized pool too."""
    prompts = _prompts([9, 3], seed=1)
    kw = dict(max_num_tokens=16, kv_cache_dtype=kv_dtype)
    want = _greedy_tokens(tiny_mqa_dir, prompts, 4, 1, attention_backend="torch", **kw)
    got = _greedy_tokens(tiny_mqa_dir, prompts, 4, 1, attention_backend="triton", **kw)
    assert got == want


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_fused_gpu_layers_match_torch(tiny_llama_dir: Path, kv_dtype: str) -> None:
    """The CUDA layer path (Triton RMSNorm + residual, SiLU * up, and RoPE fused with the KV store
    on an unquantized pool), forced on the CPU under the interpreter, keeps the greedy tokens."""
    from radixserve.model import gpu_ops

    prompts = _prompts([11, 4], seed=2)
    kw = dict(max_num_tokens=8, kv_cache_dtype=kv_dtype)
    want = _greedy_tokens(tiny_llama_dir, prompts, 4, 1, attention_backend="torch", **kw)
    log = LaunchLog()
    with gpu_ops.forced(True), log.recording():
        got = _greedy_tokens(tiny_llama_dir, prompts, 4, 1, attention_backend="triton", **kw)
    assert got == want
    counts = log.counts()
    assert counts["_rms_norm_kernel"] and counts["_silu_mul_kernel"]
    # RoPE fuses into the store on an unquantized pool; a quantized one keeps the store kernel.
    assert (
        bool(counts["_rope_store_kv_kernel"])
        == (kv_dtype == "auto")
        != bool(counts["_store_kv_kernel"])
    )
