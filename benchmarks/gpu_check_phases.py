"""The phases of benchmarks/gpu_check.py (one function each; the driver times and budgets them).

Every phase takes the run's :class:`Ctx` and returns its JSON-able result; a phase that
needs a GPU returns ``{"skipped": ..., "command": ...}`` in a dry run. Subprocess phases
get what is left of the budget as their timeout (:meth:`Ctx.run`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent


class Ctx:
    """What every phase reads: the device, the sizes, where to build checkpoints, the deadline."""

    def __init__(self, dry: bool, workdir: Path) -> None:
        self.dry = dry
        self.device = "cpu" if dry else "cuda"
        self.workdir = workdir
        self.batches = [1, 4] if dry else [1, 16, 64, 256]
        self.contexts = [64, 128] if dry else [1024, 4096]
        self.backend = "torch" if dry else "triton"
        self.dtype = "float32" if dry else "bfloat16"
        self.deadline = time.monotonic() + 3600.0  # the driver sets the budget's end

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def time_left(self) -> float:
        return max(1.0, self.deadline - time.monotonic())

    def run(self, cmd: list[str], **env: str) -> str:
        """Run ``cmd`` in the repository within the budget; its output's tail (raises on failure)."""
        try:
            proc = subprocess.run(
                cmd,
                cwd=ROOT,
                env={**os.environ, "TRITON_INTERPRET": "0" if not self.dry else "1", **env},
                capture_output=True,
                text=True,
                timeout=self.time_left(),
            )
        except subprocess.TimeoutExpired as e:
            got = [
                o.decode(errors="replace") if isinstance(o, bytes) else o or ""
                for o in (e.stdout, e.stderr)
            ]
            tail = "".join(got)[-2000:]
            raise RuntimeError(
                f"stopped at the budget's end ({' '.join(cmd[1:3])}):\n{tail}"
            ) from None
        out = (proc.stdout + proc.stderr).strip()
        print(out[-2000:], flush=True)
        if proc.returncode:
            raise RuntimeError(f"{' '.join(cmd[1:4])} failed:\n" + out[-3000:])
        return out


def pytest_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]


def gpu_only(cmds: list[list[str]]) -> dict[str, Any]:
    """A dry run's record of a GPU-only phase: what it would run."""
    return {"skipped": "needs a GPU", "commands": ["python " + " ".join(c[1:]) for c in cmds]}


def smollm2_shaped(ctx: Ctx) -> Path:
    """A random checkpoint with SmolLM2-135M's shape (tiny in a dry run), built once."""
    import tiny_models

    out = ctx.workdir / "smollm2_shaped"
    if not (out / "config.json").exists():
        if ctx.dry:
            tiny_models.build_tiny_llama(
                out, num_q_heads=9, num_kv_heads=3, head_dim=16, hidden_size=72, num_layers=2
            )
        else:
            tiny_models.build_tiny_llama(
                out,
                num_q_heads=9,
                num_kv_heads=3,
                head_dim=64,
                hidden_size=576,
                num_layers=30,
                intermediate_size=1536,
                vocab_size=49152,
                tie_word_embeddings=True,
                rope_theta=100000.0,
                max_position_embeddings=8192,
            )
    return out


# ------------------------------------------------------------------------------- part 1
def phase_kernel_tests(ctx: Ctx) -> dict[str, Any]:
    # The sm_90 compile-only check is redundant where the kernels really compile and run.
    # One line per failure (--tb=line): the report keeps the output's tail, and on the first
    # GPU run the long tracebacks of six failures pushed the seventh's reason out of it.
    cmd = pytest_cmd("tests/kernels", "--ignore=tests/kernels/test_kernel_compile.py", "--tb=line")
    if ctx.dry:
        return gpu_only([cmd])
    tail = ctx.run(cmd).splitlines()
    return {"summary": tail[-1] if tail else ""}


def phase_decode_bandwidth(ctx: Ctx) -> dict[str, Any]:
    out = ctx.workdir / "kernels_gpu.json"
    cmd = [sys.executable, "benchmarks/bench_kernels_gpu.py", "--out", str(out)]
    if ctx.dry:
        return gpu_only([cmd])
    ctx.run(cmd)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def _hf_greedy(
    model_dir: Path, prompts: list[list[int]], n: int, dtype: torch.dtype, device: str
) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            gen = hf.generate(
                ids, max_new_tokens=n, do_sample=False, min_new_tokens=n, pad_token_id=0
            )
            out.append(gen[0, len(p) :].tolist())
    del hf
    return out


def greedy_against_hf(ctx: Ctx, models: dict[str, Path]) -> dict[str, Any]:
    """Each model's engine greedy tokens against transformers' (fp32 must be identical)."""
    from radixserve.engine.engine import Engine
    from radixserve.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 400, (n,), generator=g).tolist() for n in (5, 23, 1, 40, 16)]
    n_new = 8
    res: dict[str, Any] = {}
    dtypes = ["float32"] if ctx.dry else ["float32", "bfloat16"]
    for name, path in models.items():
        for dt_name in dtypes:
            want = _hf_greedy(path, prompts, n_new, getattr(torch, dt_name), ctx.device)
            engine = Engine(
                str(path),
                device=ctx.device,
                dtype=dt_name,
                attention_backend=ctx.backend,
                num_pages=512,
                page_size=16,
                max_num_tokens=32,
                max_running_requests=8,  # few graph buckets to capture
            )
            outs = engine.generate(
                prompts, SamplingParams(max_tokens=n_new, temperature=0.0, ignore_eos=True)
            )
            got = [o.token_ids for o in outs]
            engine.check_invariants()
            same = sum(a == b for w, o in zip(want, got) for a, b in zip(w, o))
            res[f"{name}/{dt_name}"] = {
                "identical": got == want,
                "token_agreement": same / (len(prompts) * n_new),
            }
            del engine
            if dt_name == "float32" and got != want:
                raise AssertionError(
                    f"{name} fp32 greedy tokens differ from transformers: {got} vs {want}"
                )
    return res


def phase_greedy_vs_hf(ctx: Ctx) -> dict[str, Any]:
    import tiny_models

    return greedy_against_hf(
        ctx,
        {
            "tiny_llama": tiny_models.build_tiny_llama(ctx.workdir / "tiny_llama", head_dim=64),
            "tiny_qwen2": tiny_models.build_tiny_qwen2(ctx.workdir / "tiny_qwen2"),
            "tiny_mqa": tiny_models.build_tiny_mqa(ctx.workdir / "tiny_mqa"),
        },
    )


def default_model_dir() -> Path:
    """Where the default model's converted copy would be (GPU_CHECK_DEFAULT_MODEL overrides)."""
    from radixserve.model_store import default_model_path, get_cache_dir

    return Path(
        os.environ.get("GPU_CHECK_DEFAULT_MODEL") or default_model_path(get_cache_dir(None))
    )


def phase_default_model(ctx: Ctx) -> dict[str, Any]:
    """SmolLM2-135M-Instruct against transformers, only from weights already on disk."""
    from radixserve.model_store import is_complete_model_dir

    if ctx.dry:
        return {"skipped": "dry run (the CPU suite covers it: tests/model/test_smollm2_vs_hf.py)"}
    path = default_model_dir()
    if not is_complete_model_dir(path):
        return {
            "skipped": f"default model not on disk at {path} (nothing is fetched here; "
            "set GPU_CHECK_DEFAULT_MODEL to a converted SmolLM2 directory)"
        }
    return greedy_against_hf(ctx, {"smollm2": path})


# ------------------------------------------------------------------------------- part 2
def _decode_batch(batch: int, context: int, page_size: int, device: str) -> tuple[Any, int]:
    from radixserve.model.forward_batch import ForwardBatch

    pages_per = -(-(context + 1) // page_size)
    pages = [list(range(b * pages_per, (b + 1) * pages_per)) for b in range(batch)]
    fb = ForwardBatch.from_pages(pages, [context] * batch, [1] * batch, page_size)
    fb.logits_indices = torch.arange(batch, dtype=torch.int64)
    moved = dataclasses.replace(
        fb,
        **{
            f.name: getattr(fb, f.name).to(device)
            for f in dataclasses.fields(fb)
            if isinstance(getattr(fb, f.name), torch.Tensor)
        },
    )
    return moved, batch * pages_per


def _time_steps(ctx: Ctx, fn: Callable[[], object], reps: int) -> float:
    fn()
    ctx.sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    ctx.sync()
    return (time.perf_counter() - t0) / reps


def phase_decode_table(ctx: Ctx) -> dict[str, Any]:
    from radixserve.engine.model_runner import make_attention_backend
    from radixserve.memory.pool import KVPool
    from radixserve.model.loader import load_model

    dtype = getattr(torch, ctx.dtype)
    model = load_model(smollm2_shaped(ctx), dtype=dtype, device=torch.device(ctx.device))
    mc = model.config
    rows = []
    page_size = 16
    for context in ctx.contexts:
        for batch in ctx.batches:
            fb, num_pages = _decode_batch(batch, context, page_size, ctx.device)
            pool = KVPool(
                mc.num_layers,
                num_pages,
                page_size,
                mc.num_kv_heads,
                mc.head_dim,
                act_dtype=dtype,
                device=ctx.device,
            )
            attn = make_attention_backend(ctx.backend, pool)
            attn.init_forward_metadata(fb)  # host facts of this (static) batch, as the runner does
            reps = 3 if ctx.dry else 10
            eager = _time_steps(ctx, functools.partial(model, fb, attn), reps)
            row: dict[str, Any] = {
                "batch": batch,
                "context": context,
                "eager_ms": eager * 1e3,
                "eager_tok_s": batch / eager,
            }
            if ctx.device == "cuda":
                try:
                    graph = torch.cuda.CUDAGraph()
                    torch.cuda.synchronize()
                    with torch.cuda.graph(graph):
                        model(fb, attn)
                    t = _time_steps(ctx, graph.replay, reps)
                    row.update(graph_ms=t * 1e3, graph_tok_s=batch / t, graph_speedup=eager / t)
                    del graph
                except Exception as e:  # record why, keep the eager figure
                    row["graph_error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
            print(
                f"  decode batch {batch:4d} ctx {context:5d}: {row['eager_tok_s']:10.0f} tok/s eager"
                + (f", {row['graph_tok_s']:10.0f} graphed" if "graph_tok_s" in row else ""),
                flush=True,
            )
            del pool, attn
    return {
        "model": "SmolLM2-135M shape, random weights",
        "dtype": ctx.dtype,
        "backend": ctx.backend,
        "rows": rows,
    }


def phase_shared_system(ctx: Ctx) -> dict[str, Any]:
    from radixserve.engine.engine import Engine
    from radixserve.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(1)
    systems, requests, sys_len, max_tokens = (2, 6, 40, 4) if ctx.dry else (4, 64, 1000, 32)
    heads = [
        torch.randint(3, 40000 if not ctx.dry else 400, (sys_len,), generator=g).tolist()
        for _ in range(systems)
    ]
    prompts = [
        heads[i % systems] + torch.randint(3, 400, (20,), generator=g).tolist()
        for i in range(requests)
    ]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    res: dict[str, Any] = {
        "systems": systems,
        "requests": requests,
        "system_tokens": sys_len,
        "max_tokens": max_tokens,
    }
    for name, disable in (("cache_on", False), ("cache_off", True)):
        engine = Engine(
            str(smollm2_shaped(ctx)),
            device=ctx.device,
            dtype=ctx.dtype,
            attention_backend=ctx.backend,
            disable_radix_cache=disable,
            num_pages=256 if ctx.dry else 8192,
            page_size=16,
            max_running_requests=64,
        )
        engine.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True))  # compile/warm
        engine.flush_cache()
        t0 = time.perf_counter()
        outs = engine.generate(prompts, params)
        ctx.sync()
        wall = time.perf_counter() - t0
        st = engine.stats()
        res[name] = {
            "wall_s": wall,
            "output_tok_s": sum(len(o.token_ids) for o in outs) / wall,
            "hit_rate": st.hit_rate,
            "computed_tokens": st.computed_tokens_total,
        }
        del engine
    res["speedup"] = res["cache_off"]["wall_s"] / res["cache_on"]["wall_s"]
    return res


def phase_quant_linear(ctx: Ctx) -> dict[str, Any]:
    """The CUDA quantized-linear tests, then batch-1 timings of int8's CUDA paths against bf16."""
    test = pytest_cmd(
        "tests/model/test_quant_linear.py", "tests/kernels/test_int8_gemv.py", "-k", "cuda or gemv"
    )
    bench = [sys.executable, "benchmarks/gpu_int8_paths.py"]
    if ctx.dry:
        return gpu_only([test, bench])
    summary = ctx.run(test).splitlines()[-1]
    out = ctx.run(bench).splitlines()
    return {"tests": summary, "int8_paths": json.loads(out[-1])}


def phase_model_runner(ctx: Ctx) -> dict[str, Any]:
    """The runner's CUDA test, then bench_runner_step.py on the SmolLM2-shaped checkpoint."""
    out = ctx.workdir / "bench_runner_step.json"
    test = pytest_cmd("tests/engine/test_model_runner.py")
    bench = [
        sys.executable,
        "benchmarks/bench_runner_step.py",
        "--model",
        str(smollm2_shaped(ctx)),
        "--device",
        ctx.device,
        "--dtype",
        ctx.dtype,
        "--batch",
        *(["1"] if ctx.dry else ["1", "16", "64"]),
        "--steps",
        "3" if ctx.dry else "10",
        "--rounds",
        "1" if ctx.dry else "2",
        "--ttft-tokens",
        "8" if ctx.dry else "32",
        "--prompt-tokens",
        "8" if ctx.dry else "32",
        "--out",
        str(out),
    ]
    res: dict[str, Any] = {}
    if ctx.dry:
        res["test"] = gpu_only([test])
    else:
        res["test"] = ctx.run(test).splitlines()[-1]
    ctx.run(bench)
    res["bench"] = json.loads(out.read_text())
    return res
