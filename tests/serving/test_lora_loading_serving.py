"""A LoRA adapter loaded while a real worker serves, through the ZeroMQ client: its
requests answer as PEFT's adapted model; the worker killed, the one the supervisor starts
again (from its flags, which name no adapter) is sent the load before the request that
waited for it, which it answers with the adapter's weights."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from engine_helpers import peft_greedy, random_prompts
from foreign_peers import wait_until

from radixserve.sampling_params import SamplingParams
from radixserve.serving.client import Client
from radixserve.serving.router.launcher import LocalServer
from radixserve.serving.router.router import RouterConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

N = 6
GREEDY = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
ENGINE = dict(num_pages=64, page_size=4, num_threads=1, enable_lora=True)


def test_a_loaded_adapter_survives_its_workers_restart(
    tiny_llama_dir: Path, tiny_lora_dir: Path, tmp_path: Path
) -> None:
    prompt = random_prompts([10], seed=61)[0]
    ref = peft_greedy(tiny_llama_dir, tiny_lora_dir, prompt, N)
    # ipc: the kernel names the client's user, so this process may load adapters.
    cfg = RouterConfig(
        endpoint=f"ipc://{tmp_path}/clients.sock",
        heartbeat_interval_s=0.2,
        restart_backoff_s=0.2,
    )
    with LocalServer(tiny_llama_dir, num_workers=1, config=cfg, engine_config=ENGINE) as srv:
        with Client(srv.endpoint, timeout=60) as c:
            reply = c.load_lora_adapter("sql", str(tiny_lora_dir))
            assert reply.ok and list(reply.adapters) == ["sql"], reply
            assert c.generate(input_ids=prompt, params=GREEDY, lora="sql").token_ids == ref
            assert c.model_info().lora_adapters == ["sql"]
            first = srv.procs[0].pid
            os.kill(first, signal.SIGKILL)
            assert wait_until(lambda: c.health().workers_alive == 0, 60), "the worker's death"
            # It waits for the restarted worker, which loads the adapter first.
            again = c.generate(input_ids=prompt, params=GREEDY, lora="sql")
            assert again.token_ids == ref
            assert srv.procs[-1].pid != first and c.model_info().lora_adapters == ["sql"]
            gone = c.unload_lora_adapter("sql")
            assert gone.ok and gone.adapters == {}
