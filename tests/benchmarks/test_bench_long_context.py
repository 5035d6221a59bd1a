"""bench_long_context.py's growth arithmetic: each server's growth of the time per token from
the shortest context to the longest, over its sequential KV read floor's growth and, for bf16
KV, over the paged read floors' (the same KV on scattered and on ascending pages, read cold),
from the run's median floors; a quantized server gets no paged ratio (those are bf16 KV's).
And ``quiet``: which servers run while one is measured."""

from __future__ import annotations

from typing import Any

import bench_modules
import pytest

blc = bench_modules.load("bench_long_context.py", "bench_long_context_growth")


def _doc() -> dict[str, Any]:
    floors = []
    for rep, (seq, paged) in enumerate([((0.4, 3.0), (1.0, 6.0)), ((0.6, 3.4), (1.2, 7.2))]):
        for ctx, s, p in ((1000, seq[0], paged[0]), (7500, seq[1], paged[1])):
            floors.append(
                {
                    "rep": rep,
                    "context": ctx,
                    "kv_floor_ms": {"auto": s, "int8": s / 2},
                    "paged_kv_floor_ms": p,
                    "contiguous_kv_floor_ms": p / 2,
                }
            )
    cells = [
        {"server": server, "rep": rep, "context": ctx, "ttft_s": 1.0, "tpot_ms": ms, "error": None}
        for rep in (0, 1)
        for server, by_ctx in (
            ("radixserve-bf16", {1000: 10.0, 7500: 16.0}),
            ("radixserve-bf16-kv-int8", {1000: 11.0, 7500: 19.0}),
        )
        for ctx, ms in by_ctx.items()
    ]
    doc = {
        "floors": floors,
        "cells": cells,
        "kv_dtype_of": {"radixserve-bf16": "auto", "radixserve-bf16-kv-int8": "int8"},
    }
    doc["summary"] = blc.summary(doc)
    return doc


def test_growth_over_the_sequential_and_the_paged_floor() -> None:
    g = blc.growth(_doc())
    bf16 = g["radixserve-bf16"]
    assert bf16["tpot_ms"] == pytest.approx(6.0)
    # Median floors: sequential 0.5 -> 3.2 (growth 2.7), paged 1.1 -> 6.6 (growth 5.5).
    assert bf16["kv_floor_ms"] == pytest.approx(2.7)
    assert bf16["tpot_ms_over_kv_floor"] == pytest.approx(6.0 / 2.7)
    assert bf16["paged_kv_floor_ms"] == pytest.approx(5.5)
    assert bf16["tpot_ms_over_paged_kv_floor"] == pytest.approx(6.0 / 5.5)
    assert bf16["contiguous_kv_floor_ms"] == pytest.approx(2.75)
    assert bf16["tpot_ms_over_contiguous_kv_floor"] == pytest.approx(6.0 / 2.75)
    int8 = g["radixserve-bf16-kv-int8"]
    assert int8["tpot_ms_over_kv_floor"] == pytest.approx(8.0 / 1.35)
    assert "paged_kv_floor_ms" not in int8 and "tpot_ms_over_paged_kv_floor" not in int8


def test_a_run_without_paged_floors_has_no_paged_ratio() -> None:
    doc = _doc()
    for f in doc["floors"]:
        del f["paged_kv_floor_ms"], f["contiguous_kv_floor_ms"]
    g = blc.growth(doc)["radixserve-bf16"]
    assert "tpot_ms_over_kv_floor" in g
    assert "tpot_ms_over_paged_kv_floor" not in g and "contiguous_kv_floor_ms" not in g


class _Proc:
    """What ``quiet`` uses of a ServerProcess: its paused flag, pause and resume."""

    def __init__(self) -> None:
        self.paused = False

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False


def _servers(*names: str) -> list[Any]:
    spec = blc.servers.peer_spec("radixserve-bf16")
    group = [blc.Server(name, spec, None) for name in names]
    for srv in group:
        srv.proc = _Proc()
    return group


def test_quiet_pauses_every_server_but_the_measured_one() -> None:
    a, b, c = group = _servers("a", "b", "c")
    assert blc.quiet(group, None, keep_running=False) is False  # the floors: all paused
    assert all(s.proc.paused for s in group)
    assert blc.quiet(group, b, keep_running=False) is True  # b was paused: to be woken
    assert [s.proc.paused for s in group] == [True, False, True]
    assert blc.quiet(group, b, keep_running=False) is False  # already running
    assert blc.quiet(group, c, keep_running=False) is True
    assert [s.proc.paused for s in group] == [True, True, False]
    assert a.proc.paused


def test_keep_idle_running_resumes_and_never_pauses() -> None:
    group = _servers("a", "b")
    blc.quiet(group, None, keep_running=False)
    assert blc.quiet(group, group[0], keep_running=True) is True
    assert not any(s.proc.paused for s in group)
    assert blc.quiet(group, None, keep_running=True) is False
    assert not any(s.proc.paused for s in group)
