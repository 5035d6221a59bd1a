"""Two CUDA-only behaviours of the parallel paths, made safe by default and checked on the CPU.

- Tensor parallelism does not capture its all-reduces inside the decode graphs unless
  ``--tp-graph-capture`` asks (c10d NCCL collectives in a graph need two GPUs to try).
- A pipeline hop's receive is waited on the stream on CUDA (``Work.wait()`` with no
  timeout), not by the host polling; the CPU's gloo receive keeps its timeout.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch

from radixserve.cli import build_parser
from radixserve.commands.engine_args import engine_config
from radixserve.distributed.pipeline.comm import wait_for_transfer
from radixserve.engine.config import EngineConfig


def test_tp_decode_graphs_are_captured_only_on_request() -> None:
    assert EngineConfig().capture_decode_graphs
    assert not EngineConfig(tensor_parallel_size=2).capture_decode_graphs
    assert EngineConfig(tensor_parallel_size=2, tp_graph_capture=True).capture_decode_graphs
    args = build_parser().parse_args(["generate", "--tp", "2", "--tp-graph-capture", "hi"])
    cfg = engine_config(args)
    assert cfg["tp_graph_capture"] is True and cfg["tensor_parallel_size"] == 2
    assert "tp_graph_capture" not in engine_config(build_parser().parse_args(["generate", "hi"]))


class _Work:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def wait(self, *args: Any) -> bool:
        self.calls.append(args)
        return True


def test_pipeline_receive_waits_on_the_stream_on_cuda() -> None:
    timeout = datetime.timedelta(seconds=5)
    cuda, cpu = _Work(), _Work()
    wait_for_transfer(cuda, torch.device("cuda"), timeout)
    wait_for_transfer(cpu, torch.device("cpu"), timeout)
    assert cuda.calls == [()]  # no timeout: NCCL makes the stream wait, the host goes on
    assert cpu.calls == [(timeout,)]
