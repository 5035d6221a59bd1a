"""Weights updated while a real worker serves, through the ZeroMQ client: a request running
when the update comes finishes with the old weights (transformers' tokens of A), the ones
after it answer with the new (B's), the model info names them; a checkpoint of another
architecture is refused and changes nothing; the worker killed, the one the supervisor
starts again (from its flags, which name A) is sent the update before the request that
waited for it."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import tiny_models
from engine_helpers import hf_greedy, random_prompts
from foreign_peers import wait_until

from radixserve.sampling_params import SamplingParams
from radixserve.serving.client import Client
from radixserve.serving.router.launcher import LocalServer
from radixserve.serving.router.router import RouterConfig
from radixserve.serving.wire import protocol as p

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

N, LONG = 6, 120
ENGINE = dict(num_pages=128, page_size=4, num_threads=1)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_weights_updated_while_serving(tmp_path: Path) -> None:
    a = tiny_models.build_tiny_llama(tmp_path / "a", seed=31)
    b = tiny_models.build_tiny_llama(tmp_path / "b", seed=32)
    wider = tiny_models.build_tiny_llama(tmp_path / "wider", seed=32, num_layers=3)
    prompt, long_prompt = random_prompts([10, 7], seed=33)
    # ipc: the kernel names the client's user, so this process may update the weights.
    cfg = RouterConfig(
        endpoint=f"ipc://{tmp_path}/clients.sock",
        heartbeat_interval_s=0.2,
        restart_backoff_s=0.2,
    )
    with LocalServer(a, num_workers=1, config=cfg, engine_config=ENGINE) as srv:
        with Client(srv.endpoint, timeout=120) as c:
            assert c.generate(input_ids=prompt, params=_greedy(N)).token_ids == hf_greedy(
                a, prompt, N
            )
            running = c.submit(input_ids=long_prompt, params=_greedy(LONG), stream=True)
            events = c.events(running)
            assert isinstance(next(events), p.GenerateChunk)  # it runs on the worker now
            reply = c.update_weights_from_disk(str(b), "step-1")
            assert reply.ok and (reply.model_path, reply.weight_version) == (str(b), "step-1")
            *_, final = events
            assert final.token_ids == hf_greedy(a, long_prompt, LONG)  # A's, to the end
            assert c.generate(input_ids=prompt, params=_greedy(N)).token_ids == hf_greedy(
                b, prompt, N
            )
            info = c.model_info()
            assert (info.model_path, info.weight_version) == (str(b), "step-1")

            refused = c.update_weights_from_disk(str(wider))
            assert not refused.ok and refused.code == "invalid_params"
            assert "num_layers 2 -> 3" in (refused.error or "")
            assert c.model_info().weight_version == "step-1"

            first = srv.procs[0].pid
            os.kill(first, signal.SIGKILL)
            assert wait_until(lambda: c.health().workers_alive == 0, 60), "the worker's death"
            # It waits for the restarted worker, which takes the update first.
            again = c.generate(input_ids=prompt, params=_greedy(N))
            assert again.token_ids == hf_greedy(b, prompt, N)
            assert srv.procs[-1].pid != first
            assert c.model_info().weight_version == "step-1"
