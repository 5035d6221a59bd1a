"""A real worker of two tensor-parallel ranks, through the ZeroMQ client: LoRA adapters
loaded and unloaded while it serves go through the worker's queue (its files read off the
step loop on rank 0) to both ranks, whose answers are PEFT's; one the ranks cannot load is
refused, and the worker serves on."""

from __future__ import annotations

from pathlib import Path

import pytest
import tiny_models
from engine_helpers import hf_greedy, peft_greedy, random_prompts

from radixserve.sampling_params import SamplingParams
from radixserve.serving.client import Client
from radixserve.serving.router.launcher import LocalServer
from radixserve.serving.router.router import RouterConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

N = 6
ENGINE = dict(num_pages=128, page_size=4, enable_lora=True, tensor_parallel_size=2)


def test_a_tp_worker_loads_and_unloads_adapters_on_both_ranks(
    tiny_llama_dir: Path, tiny_lora_dir: Path, tiny_attn_lora_dir: Path, tmp_path: Path
) -> None:
    prompt = random_prompts([10], seed=62)[0]
    greedy = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
    wide = tiny_models.build_lora_adapter(
        tiny_models.build_tiny_llama(tmp_path / "wide", hidden_size=96), tmp_path / "wide_lora"
    )
    cfg = RouterConfig(endpoint=f"ipc://{tmp_path}/clients.sock")
    with LocalServer(tiny_llama_dir, num_workers=1, config=cfg, engine_config=ENGINE) as srv:
        with Client(srv.endpoint, timeout=120) as c:

            def answer(lora: str | None = None) -> list[int]:
                return c.generate(input_ids=prompt, params=greedy, lora=lora).token_ids

            assert c.load_lora_adapter("all", str(tiny_lora_dir)).ok
            assert c.load_lora_adapter("attn", str(tiny_attn_lora_dir)).ok
            refused = c.load_lora_adapter("wide", str(wide))
            assert not refused.ok and "LoRA matrices are" in (refused.error or "")
            assert answer("all") == peft_greedy(tiny_llama_dir, tiny_lora_dir, prompt, N)
            assert answer("attn") == peft_greedy(tiny_llama_dir, tiny_attn_lora_dir, prompt, N)
            assert answer() == hf_greedy(tiny_llama_dir, prompt, N)
            # "all" unloaded, then loaded again into its freed slot on both ranks.
            reply = c.unload_lora_adapter("all")
            assert reply.ok and list(reply.adapters) == ["attn"], reply
            assert c.load_lora_adapter("all", str(tiny_lora_dir)).ok
            assert answer("all") == peft_greedy(tiny_llama_dir, tiny_lora_dir, prompt, N)
            assert answer("attn") == peft_greedy(tiny_llama_dir, tiny_attn_lora_dir, prompt, N)
