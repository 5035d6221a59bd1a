"""After warm-up, serving launches no Triton kernel variant that warm-up did not launch.

Every launch is keyed by Triton's own specialization (``radixkernels.variants``: the binder
and cache key Triton's launcher computes for a CUDA sm_90 backend), so on the CPU, where the
interpreter compiles nothing, this still proves that each serving launch would hit a binary
compiled during warm-up on a GPU. The backend is given a GPU's split policy (``num_sms``) so
that decode batches of different sizes pick different split counts, as they would on a GPU.
Under gpu_check.sh (compiled kernels on a GPU) the test also reads Triton's real caches.
"""

from __future__ import annotations

from pathlib import Path

import kvcases
import pytest
import torch

import radixkernels.decode
from radixkernels.decode import SPLIT_BUCKETS
from radixkernels.variants import LaunchLog, compiled_variants
from radixserve.engine.engine import Engine
from radixserve.model import gpu_ops
from radixserve.model.warmup import warm_up_model
from radixserve.sampling_params import SamplingParams


@pytest.mark.parametrize("cuda_layers", [False, True], ids=["torch-layers", "cuda-layers"])
def test_nothing_compiles_after_warmup(
    tiny_llama_dir: Path, cuda_layers: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``cuda-layers``: the layer path CUDA takes (fused RMSNorm, SiLU * up, RoPE + store:
    ``rope_store_kv`` replaces ``store_kv`` on this unquantized pool), forced on the CPU."""
    # The split policy is set before the engine exists: its warm-up (and, on CUDA, the graph
    # capture) already runs with it. 16 programs wanted over 2 KV heads: batch 1 -> 8 splits,
    # 2 -> 4, 3..7 -> 2, 8 -> 1.
    monkeypatch.setattr(radixkernels.decode, "device_num_sms", lambda device: 4)
    with gpu_ops.forced(cuda_layers):
        _check_warmup_covers_serving(tiny_llama_dir, cuda_layers)


def _check_warmup_covers_serving(tiny_llama_dir: Path, cuda_layers: bool) -> None:
    engine = Engine(
        str(tiny_llama_dir),
        num_pages=64,
        page_size=4,
        attention_backend="triton",
        max_num_tokens=8,
        max_running_requests=8,
        device=str(kvcases.DEVICE),
    )
    attn = engine.attn
    assert attn.num_sms == 4
    assert attn.decode_batch_sizes(8) == [1, 2, 3, 8]
    assert {attn.decode_splits(b) for b in range(1, 65)} <= set(SPLIT_BUCKETS)

    warm = LaunchLog()
    with warm.recording():
        report = warm_up_model(engine.model, attn, engine.pool, max_batch_size=8)
    assert report.num_forwards == 7
    pages = torch.tensor(report.scratch_pages)
    assert all(not t[pages].any() for t in engine.pool.k_data + engine.pool.v_data), (
        "scratch pages not zeroed"
    )
    compiled_after_warmup = compiled_variants()

    serve = LaunchLog()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (13, 5, 1, 9, 3, 7)]
    with serve.recording():
        outs = engine.generate(
            prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        )
    assert all(len(o.token_ids) == 4 for o in outs)
    engine.check_invariants()

    counts = serve.counts()
    # The workload exercised every kernel: stores, extends (chunked prompts), split decodes
    # (on CUDA decode-only steps replay graphs; the mixed steps still launch them).
    store = "_rope_store_kv_kernel" if cuda_layers else "_store_kv_kernel"
    assert counts[store] and counts["_extend_kernel"] and counts["_decode_reduce_kernel"]
    if cuda_layers:
        assert counts["_rms_norm_kernel"] and counts["_silu_mul_kernel"]
        assert not counts["_store_kv_kernel"]
    new = serve.variants - warm.variants
    assert not new, f"serving launched variants warm-up did not: {sorted(v.kernel for v in new)}"
    assert compiled_variants() == compiled_after_warmup

    # The check can fail: a warm-up that covers only batch size 1 misses the other split counts.
    narrow = LaunchLog()
    with narrow.recording():
        warm_up_model(engine.model, attn, engine.pool, max_batch_size=1)
    missed = {v.kernel for v in serve.variants - narrow.variants}
    assert missed == {"_decode_split_kernel", "_decode_reduce_kernel"}
