"""Model parallelism on this machine: one rank against tensor parallel 2, honestly.

For each configuration (interleaved rounds, one engine each, all alive at once so that the
machine's drift hits every one alike) it runs ``--batch`` requests of ``--prompt`` tokens of
the default model: one prefill step (all prompts in one step), then ``--decode`` decode steps,
and reports per step:

    prefill ms / decode ms   wall time of the step on rank 0 (the whole engine step)
    comm ms                  rank 0's time inside the model's collectives (all-reduces after
                             o_proj/down_proj and the embedding, the LM head's all-gather);
                             it includes waiting for the slower rank, i.e. the skew
    comm %                   comm ms / step ms
    plan ms                  rank 0's time sending the step to the other ranks (encode + broadcast)

``--channel`` also measures the step channel alone: one decode step's message (``--batch``
rows) from rank 0 to rank 1 over the gloo broadcast the engine uses, and over POSIX shared
memory with a semaphore pair (nano-vllm's way; one host only), as round trips.

On a 2-core CPU no speed-up is expected: TP 2 runs two 1-thread ranks where TP 1 runs one
2-thread process, and adds the collectives. The point is the communication share.

Pipeline parallelism (``PP 2``, ``TP2xPP2``): ``comm ms`` is rank 0's plan broadcast, its sends
of the hidden states and its wait for the last stage's logits (which includes the other
stages' compute: one step is in the pipe at a time); ``bubble`` is the share of rank 0's
accounted time (compute + waits) that a rank spent not computing, averaged over the ranks;
``pp wait ms`` rank 0's wait for the logits per step (per-rank counters:
``engine.topology.launch.comm.gather_stats()``).

    python benchmarks/bench_parallel.py --quick --configs "TP 1,TP 2,PP 2"
"""

from __future__ import annotations

import os

# Before torch: radixserve sets the served process's OpenMP wait policy and spin count
# (OMP_WAIT_POLICY=PASSIVE, GOMP_SPINCOUNT), which the runtime reads once, when torch loads it.
import radixserve  # noqa: F401

# isort: split

import argparse  # noqa: E402
import datetime as dt  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from radixserve.distributed.topology import PipelineParallel, TensorParallel  # noqa: E402
from radixserve.engine.engine import Engine  # noqa: E402
from radixserve.sampling_params import SamplingParams  # noqa: E402

# name -> Engine keyword arguments on top of the common ones. The PP helper adds "PP 2".
CONFIGS: dict[str, dict[str, Any]] = {
    "TP 1": {},
    "TP 2": {"tensor_parallel_size": 2},
    "PP 2": {"pipeline_parallel_size": 2},
    "PP 2 mb1": {"pipeline_parallel_size": 2, "pipeline_micro_batches": 1},  # no micro-batches
    "TP2xPP2": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2},
}


def _pp_stats(engine: Engine) -> list[dict[str, float]] | None:
    """Every pipeline rank's counters since the last call (gathered once per phase)."""
    if not isinstance(engine.topology, PipelineParallel):
        return None
    if id(engine) not in _PP_GATHERED:
        _PP_GATHERED[id(engine)] = engine.topology.launch.comm.gather_stats()
    return _PP_GATHERED[id(engine)]


def _pp_bubble(engine: Engine) -> float | None:
    """The pipeline's bubble: the share of rank 0's accounted time (its compute and its waits)
    that a rank did not compute, averaged over the ranks."""
    stats = _pp_stats(engine)
    if stats is None:
        return None
    r0 = stats[0]
    total = r0["compute_seconds"] + r0["recv_seconds"] + r0["plan_seconds"] + r0["send_seconds"]
    return statistics.mean(1 - s["compute_seconds"] / total for s in stats)


def _pp_wait_ms(engine: Engine) -> float | None:
    """Rank 0's wait for the last stage's logits, ms per step (the later stages' turn)."""
    stats = _pp_stats(engine)
    _PP_GATHERED.pop(id(engine), None)  # the last metric of a phase: the next one gathers anew
    if stats is None:
        return None
    return 1e3 * stats[0]["recv_seconds"] / max(1.0, stats[0]["steps"])


_PP_GATHERED: dict[int, list[dict[str, float]]] = {}
# Extra per-configuration figures: name -> f(engine) read after each phase, in this order.
EXTRA_METRICS: dict[str, Callable[[Engine], float | None]] = {
    "bubble": _pp_bubble,
    "pp wait ms": _pp_wait_ms,
}


def _tp(engine: Engine) -> Any:
    topo = engine.topology
    return topo.ranks.tp if isinstance(topo, TensorParallel) else None


def _phase(engine: Engine, prompts: list[list[int]], decode: int) -> dict[str, Any]:
    """Prefill ``prompts`` in one step, then ``decode`` steps; per-step figures in ms."""
    tp = _tp(engine)
    topo = engine.topology
    chan = topo.ranks.channel if isinstance(topo, TensorParallel) else None
    pp = (
        None
        if not isinstance(engine.topology, PipelineParallel)
        else engine.topology.launch.comm.stats
    )
    params = SamplingParams(max_tokens=decode + 1, temperature=0.0, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    steps: list[dict[str, float]] = []
    while engine.has_unfinished():
        if tp is not None:
            tp.timing, tp.comm_seconds = True, 0.0
        plan0 = 0.0 if chan is None else chan.seconds
        if pp is not None:  # a pipeline's rank 0: plan broadcast, sends, the wait for logits
            plan0 = pp.plan_seconds
            comm0 = pp.plan_seconds + pp.send_seconds + pp.recv_seconds
        t0 = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - t0
        comm_ms = 0.0 if tp is None else tp.comm_seconds * 1e3
        plan_ms = 0.0 if chan is None else (chan.seconds - plan0) * 1e3
        if pp is not None:
            comm_ms += (pp.plan_seconds + pp.send_seconds + pp.recv_seconds - comm0) * 1e3
            plan_ms = (pp.plan_seconds - plan0) * 1e3
        steps.append({"ms": wall * 1e3, "comm_ms": comm_ms, "plan_ms": plan_ms})
    if tp is not None:
        tp.timing = False
    prefill, decodes = steps[0], steps[1 : 1 + decode]
    med = {k: statistics.median(s[k] for s in decodes) for k in decodes[0]}
    out = {"prefill": prefill, "decode": med}
    for name, fn in EXTRA_METRICS.items():
        out[name] = fn(engine)
    return out


def _channel_bench(batch: int, iters: int) -> dict[str, float]:
    """Round-trip µs of one decode step's message: gloo broadcast vs shared memory."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q: Any = ctx.Queue()
    p = ctx.Process(target=_channel_peer, args=(batch, iters, q))
    p.start()
    try:
        res = q.get(timeout=300)
    finally:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    return res


def _decode_message(batch: int) -> Any:
    from radixserve.distributed import step_wire

    ctx = 2048
    pages = [list(range(i * 64, i * 64 + ctx // 16)) for i in range(batch)]
    return step_wire.StepMessage(
        *[list(range(batch))] * 5,
        [1] * batch,
        [ctx] * batch,
        pages,
        [],
        [],
        [],
        list(range(batch)),
        [],
        [],
        [],
        batch,
        None,
        None,
    )


def _channel_peer(batch: int, iters: int, q: Any) -> None:
    """Rank 0 of the channel benchmark (rank 1 is its child); puts the figures on ``q``."""
    import multiprocessing as mp
    from multiprocessing import shared_memory

    from radixserve.distributed import step_wire
    from radixserve.distributed.ranks import ParallelConfig, rendezvous
    from radixserve.model.parallel import listen_socket

    ctx = mp.get_context("spawn")
    listen = listen_socket("127.0.0.1", 0)
    pc = ParallelConfig(2, 1, 0, "127.0.0.1", listen.getsockname()[1], dt.timedelta(seconds=60))
    shm = shared_memory.SharedMemory(create=True, size=1 << 20)
    sems = (ctx.Semaphore(0), ctx.Semaphore(0))
    child = ctx.Process(target=_channel_child, args=(pc, shm.name, sems, iters))
    child.start()
    rv = rendezvous(pc, 0, torch.device("cpu"), listen)
    msg = _decode_message(batch)
    data = step_wire.encode(msg)
    ack = torch.zeros(1)
    t0 = time.perf_counter()
    for _ in range(iters):
        rv.channel.send(msg)
        rv.tp.all_reduce(ack)  # the round trip's way back
    gloo_us = (time.perf_counter() - t0) / iters * 1e6
    t0 = time.perf_counter()
    for _ in range(iters):
        shm.buf[:8] = len(data).to_bytes(8, "little")
        shm.buf[8 : 8 + len(data)] = data
        sems[0].release()
        sems[1].acquire()
    shm_us = (time.perf_counter() - t0) / iters * 1e6
    rv.channel.send(step_wire.Shutdown("done"))
    child.join(timeout=30)
    shm.close()
    shm.unlink()
    q.put({"message_bytes": len(data), "gloo_broadcast_us": gloo_us, "shared_memory_us": shm_us})


def _channel_child(pc: Any, shm_name: str, sems: Any, iters: int) -> None:
    from multiprocessing import shared_memory

    from radixserve.distributed import step_wire
    from radixserve.distributed.ranks import rendezvous

    rv = rendezvous(pc, 1, torch.device("cpu"))
    ack = torch.zeros(1)
    for _ in range(iters):
        rv.channel.recv()
        rv.tp.all_reduce(ack)
    shm = shared_memory.SharedMemory(name=shm_name)
    for _ in range(iters):
        sems[0].acquire()
        n = int.from_bytes(bytes(shm.buf[:8]), "little")
        step_wire.decode(bytes(shm.buf[8 : 8 + n]))
        sems[1].release()
    rv.channel.recv()  # Shutdown
    shm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--quick", action="store_true", help="batch 4, prompt 128, 8 decode steps, 2 rounds"
    )
    ap.add_argument("--channel", action="store_true", help="also time the step channel alone")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names of CONFIGS")
    ap.add_argument("--out", default="benchmarks/results/bench_parallel.json")
    args = ap.parse_args()
    if args.quick:
        args.batch, args.prompt, args.decode, args.rounds = 4, 128, 8, 2
    names = args.configs.split(",")
    common = dict(page_size=16, max_num_tokens=max(2048, args.batch * args.prompt), num_pages=1024)
    engines = {n: Engine(args.model, **common, **CONFIGS[n]) for n in names}
    vocab = engines[names[0]].model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    per: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    try:
        for r in range(args.rounds + 1):  # round 0 warms every engine up
            for n in names:
                prompts = [
                    torch.randint(3, vocab, (args.prompt,), generator=g).tolist()
                    for _ in range(args.batch)
                ]
                res = _phase(engines[n], prompts, args.decode)
                if r > 0:
                    per[n].append(res)
    finally:
        for e in engines.values():
            e.close()
    rows = []
    for n in names:
        pre = [x["prefill"] for x in per[n]]
        dec = [x["decode"] for x in per[n]]
        row: dict[str, Any] = {"config": n}
        for label, xs in (("prefill", pre), ("decode", dec)):
            ms = statistics.median(x["ms"] for x in xs)
            comm = statistics.median(x["comm_ms"] for x in xs)
            row[label] = {
                "ms": ms,
                "comm_ms": comm,
                "comm_share": comm / ms,
                "plan_ms": statistics.median(x["plan_ms"] for x in xs),
            }
        for name in EXTRA_METRICS:
            vals = [x[name] for x in per[n] if x.get(name) is not None]
            row[name] = statistics.median(vals) if vals else None
        rows.append(row)
    base = rows[0]
    print(
        f"{args.batch} x {args.prompt}-token prompts, {args.decode} decode steps, median of "
        f"{args.rounds} interleaved rounds; {os.cpu_count()} CPUs, torch {torch.__version__}"
    )
    print(
        f"{'config':8} {'prefill ms':>10} {'comm ms':>8} {'comm %':>7} {'plan ms':>8} | "
        f"{'decode ms':>9} {'comm ms':>8} {'comm %':>7} {'plan ms':>8} {'vs TP 1':>8}"
        + "".join(f" {k:>10}" for k in EXTRA_METRICS)
    )
    for row in rows:
        p, d = row["prefill"], row["decode"]
        print(
            f"{row['config']:8} {p['ms']:10.1f} {p['comm_ms']:8.2f} {p['comm_share']:7.1%} "
            f"{p['plan_ms']:8.3f} | {d['ms']:9.2f} {d['comm_ms']:8.2f} {d['comm_share']:7.1%} "
            f"{d['plan_ms']:8.3f} {d['ms'] / base['decode']['ms']:7.2f}x"
            + "".join(
                f" {row[k]:10.3f}" if row[k] is not None else f" {'-':>10}" for k in EXTRA_METRICS
            )
        )
    channel = _channel_bench(args.batch, 300) if args.channel else None
    if channel is not None:
        print(
            f"step channel, decode message of {channel['message_bytes']} B ({args.batch} rows), "
            f"round trip: gloo broadcast {channel['gloo_broadcast_us']:.0f} us, "
            f"shared memory {channel['shared_memory_us']:.0f} us"
        )
    out = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "settings": vars(args),
        "results": rows,
        "channel": channel,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
