"""What a real worker serves, changed while it serves, through the ZeroMQ client: a LoRA
adapter loaded (its requests answer as PEFT's adapted model), then new weights (a request
running when they come finishes with the old, transformers' tokens of A; those after answer
with B's, the adapter applied on B as PEFT applies it on B; a checkpoint of another
architecture is refused and changes nothing). The worker killed, the one the supervisor
starts again (from its flags, which name A and no adapter) is sent the load and the update
before the request that waited for it, which it answers with both."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import tiny_models
from engine_helpers import hf_greedy, peft_greedy, random_prompts
from foreign_peers import wait_until

from radixserve.sampling_params import SamplingParams
from radixserve.serving.client import Client
from radixserve.serving.router.launcher import LocalServer
from radixserve.serving.router.router import RouterConfig
from radixserve.serving.wire import protocol as p

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

N, LONG = 6, 120
ENGINE = dict(num_pages=128, page_size=4, num_threads=1, enable_lora=True)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_an_adapter_and_new_weights_survive_the_workers_restart(
    tiny_llama_dir: Path, tiny_lora_dir: Path, tmp_path: Path
) -> None:
    a, adapter = tiny_llama_dir, tiny_lora_dir
    b = tiny_models.build_tiny_llama(tmp_path / "b", seed=32)
    wider = tiny_models.build_tiny_llama(tmp_path / "wider", seed=32, num_layers=3)
    prompt, long_prompt = random_prompts([10, 7], seed=61)
    # ipc: the kernel names the client's user, so this process may change what is served.
    cfg = RouterConfig(
        endpoint=f"ipc://{tmp_path}/clients.sock",
        heartbeat_interval_s=0.2,
        restart_backoff_s=0.2,
    )
    with LocalServer(a, num_workers=1, config=cfg, engine_config=ENGINE) as srv:
        with Client(srv.endpoint, timeout=120) as c:

            def answer(lora: str | None = None) -> list[int]:
                return c.generate(input_ids=prompt, params=_greedy(N), lora=lora).token_ids

            reply = c.load_lora_adapter("sql", str(adapter))
            assert reply.ok and list(reply.adapters) == ["sql"], reply
            assert answer("sql") == peft_greedy(a, adapter, prompt, N)
            assert c.model_info().lora_adapters == ["sql"]

            running = c.submit(input_ids=long_prompt, params=_greedy(LONG), stream=True)
            events = c.events(running)
            assert isinstance(next(events), p.GenerateChunk)  # it runs on the worker now
            update = c.update_weights_from_disk(str(b), "step-1")
            assert update.ok and (update.model_path, update.weight_version) == (str(b), "step-1")
            *_, final = events
            assert final.token_ids == hf_greedy(a, long_prompt, LONG)  # A's, to the end
            assert final.weight_version == "default"  # and named so
            after = c.generate(input_ids=prompt, params=_greedy(N))
            assert (after.token_ids, after.weight_version) == (hf_greedy(b, prompt, N), "step-1")
            assert answer("sql") == peft_greedy(b, adapter, prompt, N)
            info = c.model_info()
            assert (info.model_path, info.weight_version) == (str(b), "step-1")

            refused = c.update_weights_from_disk(str(wider))
            assert not refused.ok and refused.code == "invalid_params"
            assert "num_layers 2 -> 3" in (refused.error or "")

            first = srv.procs[0].pid
            os.kill(first, signal.SIGKILL)
            assert wait_until(lambda: c.health().workers_alive == 0, 60), "the worker's death"
            # It waits for the restarted worker, which loads the adapter and B first.
            assert answer("sql") == peft_greedy(b, adapter, prompt, N)
            assert answer() == hf_greedy(b, prompt, N)
            assert srv.procs[-1].pid != first
            info = c.model_info()
            assert (info.weight_version, info.lora_adapters) == ("step-1", ["sql"])
            gone = c.unload_lora_adapter("sql")
            assert gone.ok and gone.adapters == {}
