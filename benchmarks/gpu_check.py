"""The whole engine on one GPU, in one run, one JSON report (driven by benchmarks/gpu_check.sh).

Phases, in order (each timed; a failing phase is recorded and the next one still runs)::

    kernel_tests     pytest tests/kernels with TRITON_INTERPRET=0: every kernel test, the
                     Triton-vs-torch engine tests and the no-compile-after-warm-up test,
                     compiled for this GPU
    greedy_vs_hf     the engine's greedy tokens against transformers' generate on the GPU:
                     tiny Llama / Qwen2 / MQA checkpoints (built here, random weights) in fp32
                     (must be identical) and bf16 (agreement reported), and the default model
                     (SmolLM2-135M-Instruct) when it is already on disk (nothing is fetched)
    decode_table     decode steps per second of a SmolLM2-shaped model (random weights, bf16,
                     Triton): batch 1/16/64/256 x context 1k/4k, eager and with the model's
                     forward captured in a CUDA graph (this script captures it; the model
                     runner's own graphs are another issue's)
    shared_system    the shared-system-prompt workload (4 system prompts x 1000 tokens, 64
                     chats) through the engine with the radix cache on and off
    decode_bandwidth benchmarks/bench_kernels_gpu.py: the paged decode kernel's achieved
                     bandwidth against the device's copy bandwidth (target >= 70%), extend
                     TFLOP/s against SDPA
    model_runner     tests/engine/test_model_runner.py on CUDA (no implicit sync in a step,
                     graphs and overlap) and benchmarks/bench_runner_step.py --device cuda

``--dry-run`` runs the same code on the CPU with tiny shapes and the torch backend, skipping
the phases that need a GPU (they are listed with their commands): what CI can check.
"""

from __future__ import annotations

import os

# Before torch: radixserve sets the served process's OpenMP wait policy and spin count
# (OMP_WAIT_POLICY=PASSIVE, GOMP_SPINCOUNT), which the runtime reads once, when torch loads it.
import radixserve  # noqa: F401

# isort: split

import argparse  # noqa: E402
import datetime as dt  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # tiny_models: the tests' checkpoint builders

import torch  # noqa: E402


class Ctx:
    """What every phase reads: the device, the sizes, where to build checkpoints."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.dry = args.dry_run
        self.device = "cpu" if self.dry else "cuda"
        self.workdir = workdir
        self.batches = [1, 4] if self.dry else [1, 16, 64, 256]
        self.contexts = [64, 128] if self.dry else [1024, 4096]
        self.backend = "torch" if self.dry else "triton"
        self.dtype = "float32" if self.dry else "bfloat16"

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()


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


# ------------------------------------------------------------------------------------ phases
def phase_kernel_tests(ctx: Ctx) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/kernels"]
    if ctx.dry:
        return {"skipped": "needs a GPU", "command": "python " + " ".join(cmd[1:])}
    proc = subprocess.run(
        cmd, cwd=ROOT, env=dict(os.environ, TRITON_INTERPRET="0"), capture_output=True, text=True
    )
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
    if proc.returncode:
        raise RuntimeError("kernel tests failed:\n" + "\n".join(tail))
    return {"summary": tail[-1] if tail else ""}


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


def phase_greedy_vs_hf(ctx: Ctx) -> dict[str, Any]:
    import tiny_models

    from radixserve.engine.engine import Engine
    from radixserve.model_store import default_model_path, get_cache_dir, is_complete_model_dir
    from radixserve.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 400, (n,), generator=g).tolist() for n in (5, 23, 1, 40, 16)]
    n_new = 8
    models: dict[str, Path] = {
        "tiny_llama": tiny_models.build_tiny_llama(ctx.workdir / "tiny_llama", head_dim=64),
        "tiny_qwen2": tiny_models.build_tiny_qwen2(ctx.workdir / "tiny_qwen2"),
        "tiny_mqa": tiny_models.build_tiny_mqa(ctx.workdir / "tiny_mqa"),
    }
    res: dict[str, Any] = {}
    if ctx.dry:
        res["smollm2"] = {
            "skipped": "dry run (the CPU suite covers it: tests/model/test_smollm2_vs_hf.py)"
        }
    else:
        # Only a converted copy already on disk (or carried, GPU_CHECK_DEFAULT_MODEL=dir): the
        # first-use fetch would need pip and the network, which the GPU machine does not have.
        path = Path(
            os.environ.get("GPU_CHECK_DEFAULT_MODEL") or default_model_path(get_cache_dir(None))
        )
        if is_complete_model_dir(path):
            models["smollm2"] = path
        else:
            res["smollm2"] = {
                "skipped": f"default model not on disk at {path} (nothing is fetched here; "
                "set GPU_CHECK_DEFAULT_MODEL to a converted SmolLM2 directory)"
            }
    dtypes = ["float32"] if ctx.dry else ["float32", "bfloat16"]
    for name, path in models.items():
        for dt_name in dtypes:
            dtype = getattr(torch, dt_name)
            want = _hf_greedy(path, prompts, n_new, dtype, ctx.device)
            engine = Engine(
                str(path),
                device=ctx.device,
                dtype=dt_name,
                attention_backend=ctx.backend,
                num_pages=512,
                page_size=16,
                max_num_tokens=32,
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


def _decode_batch(batch: int, context: int, page_size: int, device: str) -> Any:
    from radixserve.model.forward_batch import ForwardBatch

    pages_per = -(-(context + 1) // page_size)
    pages = [list(range(b * pages_per, (b + 1) * pages_per)) for b in range(batch)]
    fb = ForwardBatch.from_pages(pages, [context] * batch, [1] * batch, page_size)
    fb.logits_indices = torch.arange(batch, dtype=torch.int64)
    import dataclasses

    return dataclasses.replace(
        fb,
        **{
            f.name: getattr(fb, f.name).to(device)
            for f in dataclasses.fields(fb)
            if isinstance(getattr(fb, f.name), torch.Tensor)
        },
    ), batch * pages_per


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
            reps = 3 if ctx.dry else 20
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
                    model(fb, attn)
                    torch.cuda.synchronize()
                    with torch.cuda.graph(graph):
                        model(fb, attn)
                    t = _time_steps(ctx, graph.replay, reps)
                    row.update(graph_ms=t * 1e3, graph_tok_s=batch / t)
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


def phase_decode_bandwidth(ctx: Ctx, out_dir: Path) -> dict[str, Any]:
    out = out_dir / "kernels_gpu.json"
    cmd = [sys.executable, "benchmarks/bench_kernels_gpu.py", "--out", str(out)]
    if ctx.dry:
        return {"skipped": "needs a GPU", "command": "python " + " ".join(cmd[1:])}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    print(proc.stdout[-3000:], flush=True)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-2000:])
    return json.loads(out.read_text())


def phase_model_runner(ctx: Ctx, out_dir: Path) -> dict[str, Any]:
    out = out_dir / "bench_runner_step_cuda.json"
    test = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "tests/engine/test_model_runner.py",
    ]
    bench = [
        sys.executable,
        "benchmarks/bench_runner_step.py",
        "--device",
        "cuda",
        "--dtype",
        "bfloat16",
        "--out",
        str(out),
    ]
    if ctx.dry:
        return {
            "skipped": "needs a GPU",
            "commands": ["python " + " ".join(c[1:]) for c in (test, bench)],
        }
    for cmd in (test, bench):
        proc = subprocess.run(
            cmd,
            cwd=ROOT,
            env=dict(os.environ, TRITON_INTERPRET="0"),
            capture_output=True,
            text=True,
        )
        print((proc.stdout + proc.stderr)[-2000:], flush=True)
        if proc.returncode:
            raise RuntimeError(
                f"{' '.join(cmd[1:3])} failed:\n" + (proc.stdout + proc.stderr)[-2000:]
            )
    return json.loads(out.read_text())


# ------------------------------------------------------------------------------------ driver
def machine(ctx: Ctx) -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
    }
    if ctx.device == "cuda":
        p = torch.cuda.get_device_properties(0)
        info.update(
            gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), sms=p.multi_processor_count
        )
    import triton

    info["triton"] = triton.__version__
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/gpu_check.json"))
    ap.add_argument(
        "--dry-run", action="store_true", help="CPU, tiny shapes, GPU-only phases skipped"
    )
    ap.add_argument(
        "--phases",
        default="kernel_tests,greedy_vs_hf,decode_table,shared_system,decode_bandwidth,model_runner",
    )
    args = ap.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU visible to torch; use --dry-run on the CPU", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        ctx = Ctx(args, Path(tmp))
        phases: dict[str, Callable[[], dict[str, Any]]] = {
            "kernel_tests": lambda: phase_kernel_tests(ctx),
            "greedy_vs_hf": lambda: phase_greedy_vs_hf(ctx),
            "decode_table": lambda: phase_decode_table(ctx),
            "shared_system": lambda: phase_shared_system(ctx),
            "decode_bandwidth": lambda: phase_decode_bandwidth(ctx, Path(tmp)),
            "model_runner": lambda: phase_model_runner(ctx, Path(tmp)),
        }
        report: dict[str, Any] = {
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "dry_run": ctx.dry,
            "machine": machine(ctx),
            "phases": {},
        }
        failed = []
        for name in args.phases.split(","):
            print(f"== {name} ==", flush=True)
            t0 = time.perf_counter()
            try:
                result = phases[name]()
                result["ok"] = True
            except Exception as e:  # record and go on: one report covers every phase
                result = {"ok": False, "error": f"{type(e).__name__}: {e}"[:4000]}
                failed.append(name)
            result["elapsed_s"] = round(time.perf_counter() - t0, 1)
            report["phases"][name] = result
            print(
                f"   {name}: {'ok' if result['ok'] else 'FAILED'} in {result['elapsed_s']} s",
                flush=True,
            )
            out.write_text(json.dumps(report, indent=2))  # partial reports survive a timeout
    print(f"gpu_check: report in {out}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
