"""Pages move between two pools through two real Mooncake transfer engines (tcp, 127.0.0.1)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch

from radixserve.distributed.disagg.kv_transfer import (
    KVTransfer,
    TransferError,
    head_sources,
    page_runs,
)
from radixserve.memory.pool import KVPool

pytest.importorskip("mooncake.engine", reason="Mooncake wheel (and libibverbs1) not importable")


def _pool(kv_dtype: str = "auto", kv_heads: int = 2) -> KVPool:
    return KVPool(3, 16, 4, kv_heads, 8, kv_dtype=kv_dtype, act_dtype=torch.bfloat16)


def _fill(pool: KVPool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in pool.page_tensors():
        raw = t.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))


@pytest.fixture
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[KVTransfer, KVTransfer]]:
    kv_dtype = getattr(request, "param", "auto")
    a, b = KVTransfer(_pool(kv_dtype)), KVTransfer(_pool(kv_dtype))
    yield a, b
    a.close()
    b.close()


def test_page_runs_coalesce_pages_consecutive_on_both_sides() -> None:
    assert page_runs([1, 2, 3, 7, 8], [5, 6, 7, 2, 4]) == [(1, 5, 3), (7, 2, 1), (8, 4, 1)]
    assert page_runs([], []) == []


def test_head_sources_pair_ranks_and_send_every_decode_head_once() -> None:
    # Equal TP: rank r to rank r, its whole slice.
    assert head_sources([(0, 2), (2, 4)], [(0, 2), (2, 4)]) == [[(0, 0, 2)], [(1, 2, 4)]]
    # TP 1 -> TP 2 and TP 2 -> TP 1.
    assert head_sources([(0, 4)], [(0, 2), (2, 4)]) == [[(0, 0, 2), (1, 2, 4)]]
    assert head_sources([(0, 2), (2, 4)], [(0, 4)]) == [[(0, 0, 2)], [(0, 2, 4)]]
    # Uneven (3 heads over 2 ranks) into 3 ranks; replicated heads (MQA at TP 2) both ways.
    assert head_sources([(0, 2), (2, 3)], [(0, 1), (1, 2), (2, 3)]) == [
        [(0, 0, 1), (1, 1, 2)],
        [(2, 2, 3)],
    ]
    assert head_sources([(0, 1), (0, 1)], [(0, 1), (0, 1)]) == [[(0, 0, 1)], [(1, 0, 1)]]
    assert head_sources([(0, 1), (0, 1)], [(0, 1)]) == [[(0, 0, 1)], []]
    with pytest.raises(ValueError, match="no prefill rank holds KV head 2"):
        head_sources([(0, 2)], [(0, 3)])


def _by_head(t: torch.Tensor) -> torch.Tensor:
    """A page tensor's bytes as ``[layers, pages, page_size, heads, bytes of a head]`` (data
    is ``[..., heads, head_dim]``, per-token scales ``[..., heads]``)."""
    return t.view(torch.uint8).reshape(*t.shape[:4], -1)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_head_slices_land_in_the_pools_of_another_split(kv_dtype: str) -> None:
    """One pool of 2 KV heads into two of one head each (TP 1 -> TP 2), and back."""
    whole = KVTransfer(_pool(kv_dtype))
    halves = [
        KVTransfer(_pool(kv_dtype, kv_heads=1), heads=(h, h + 1), total_heads=2) for h in (0, 1)
    ]
    back = KVTransfer(_pool(kv_dtype))
    try:
        _fill(whole.pool, 3)
        src, dst = [1, 2, 5], [4, 5, 9]
        for h, half in enumerate(halves):
            n = whole.write_pages(half.descriptor(), src, dst)
            assert n == len(src) * half.pool.bytes_per_page
            for tw, th in zip(whole.pool.page_tensors(), half.pool.page_tensors()):
                tw, th = _by_head(tw), _by_head(th)
                assert torch.equal(tw[:, src, :, h], th[:, dst, :, 0])
        for half in halves:
            half.write_pages(back.descriptor(), dst, src)
        for tw, tb in zip(whole.pool.page_tensors(), back.pool.page_tensors()):
            assert torch.equal(tw.view(torch.uint8)[:, src], tb.view(torch.uint8)[:, src])
    finally:
        for t in (whole, *halves, back):
            t.close()


@pytest.mark.parametrize("pair", ["auto", "int8"], indirect=True)
def test_pages_land_in_the_peers_pool_bytes_equal(pair: tuple[KVTransfer, KVTransfer]) -> None:
    a, b = pair
    _fill(a.pool, 1)
    src, dst = [1, 2, 3, 7], [5, 6, 7, 2]
    written = a.write_pages(b.descriptor(), src, dst)
    assert written == len(src) * a.pool.bytes_per_page
    for ta, tb in zip(a.pool.page_tensors(), b.pool.page_tensors()):
        ta, tb = ta.view(torch.uint8), tb.view(torch.uint8)  # random bytes: NaNs compare unequal
        assert torch.equal(ta[:, src], tb[:, dst])  # every layer
        untouched = [p for p in range(b.pool.num_pages) if p not in dst]
        assert not tb[:, untouched].any()
    s = a.stats()
    assert (s.transfers, s.failures, s.pages, s.bytes) == (1, 0, 4, written)
    assert b.stats().bytes == 0  # writes are counted by the side that sends


def test_a_pool_of_another_layout_is_refused_and_nothing_written() -> None:
    a, b = KVTransfer(_pool()), KVTransfer(_pool(kv_heads=1))
    try:
        _fill(a.pool, 2)
        with pytest.raises(ValueError, match="layouts differ"):
            a.write_pages(b.descriptor(), [0], [0])
        with pytest.raises(ValueError, match="out of range"):
            a.write_pages(a.descriptor(), [0], [16])
        assert not b.pool.page_tensors()[0].view(torch.uint8).any()
    finally:
        a.close()
        b.close()


def test_a_peer_that_is_gone_is_a_transfer_error(pair: tuple[KVTransfer, KVTransfer]) -> None:
    a, b = pair
    gone = msgspec.structs.replace(b.descriptor(), session="127.0.0.1:1")
    with pytest.raises(TransferError):
        a.write_pages(gone, [0, 1], [0, 1])
    assert a.stats().failures == 1 and a.stats().bytes == 0


def test_the_cli_flags_reach_the_engine_config() -> None:
    from radixserve.cli import build_parser
    from radixserve.commands.engine_args import engine_config
    from radixserve.engine.config import EngineConfig

    argv = ["serve", "--disaggregation-mode", "decode", "--disaggregation-ib-device", "mlx5_0"]
    cfg = engine_config(build_parser().parse_args(argv))
    assert cfg["disaggregation_mode"] == "decode"
    assert (cfg["disaggregation_protocol"], cfg["disaggregation_ib_device"]) == ("rdma", "mlx5_0")
    assert "disaggregation_mode" not in engine_config(build_parser().parse_args(["serve"]))
    with pytest.raises(ValueError, match="disaggregation_mode must be"):
        EngineConfig.from_kwargs(disaggregation_mode="both")


def test_disaggregation_refuses_pipeline_parallelism() -> None:
    """Each stage holds some layers in a process of its own: refused, not wrong."""
    from radixserve.engine.config import EngineConfig

    for mode in ("prefill", "decode"):
        with pytest.raises(ValueError, match="does not run with pipeline parallelism"):
            EngineConfig.from_kwargs(disaggregation_mode=mode, pipeline_parallel_size=2)
        EngineConfig.from_kwargs(disaggregation_mode=mode, tensor_parallel_size=2)  # runs


def test_serve_refuses_disaggregation_with_pipeline_parallelism(
    tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`serve --disaggregation ... --pp 2` stops with the reason before any worker starts."""
    from radixserve.cli import main

    argv = ["serve", "--model", str(tiny_llama_dir), "--disaggregation", "prefill:1,decode:1"]
    assert main([*argv, "--pp", "2", "--port", "0"]) != 0
    assert "does not run with pipeline parallelism" in capsys.readouterr().err
