"""Would ``torch.compile`` (Inductor, CPU) speed up the static-buffer decode step here?

The CPU decode forward is ~90 % oneDNN linear layers (weights pre-packed once, see
``model/cpu_linear.py``) and ~5-12 % the paged-attention C++ kernel; what remains
(RMSNorm, residual adds, RoPE, SiLU * up, casts) is one op each already. This script
measures, in one process and interleaved, the engine's eager decode forward against the
same forward compiled by Inductor the way its CPU inference path expects: ``freezing`` on
(Inductor packs the weights for oneDNN itself and fuses the elementwise ops around them),
``dynamic=False``, one compile per batch size (one static-buffer bucket), the attention
kernel and the KV store one opaque op with fixed-shape inputs (the bucket's page table), RoPE and SiLU * up
left to Inductor. Logits are checked against the eager forward's.

    python benchmarks/bench_decode_compile.py --dtype float32 --batch 1 16
    python benchmarks/bench_decode_compile.py --dtype bfloat16 --batch 1 16 --mode max-autotune-no-cudagraphs

It prints the compile time (which a warm start would add to start-up, per bucket) and the
median forward time of each variant.
"""

from __future__ import annotations

# Before torch: radixserve sets the served process's OpenMP wait policy and spin count
# (OMP_WAIT_POLICY=PASSIVE, GOMP_SPINCOUNT), which the runtime reads once, when torch loads it.
import radixserve  # noqa: F401

# isort: split

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from radixserve.engine.engine import Engine  # noqa: E402
from radixserve.model.forward_batch import ForwardBatch  # noqa: E402
from radixserve.model.llama import LlamaForCausalLM, apply_rotary  # noqa: E402
from radixserve.sampling_params import SamplingParams  # noqa: E402


@torch.library.custom_op("radixserve_bench::store_attend", mutates_args=("k_pages", "v_pages"))
def store_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    slots: torch.Tensor,
    plan: list[torch.Tensor],
    sm_scale: float,
) -> torch.Tensor:
    """Store the step's K/V into one layer's pages and attend (the engine's CPU path), as one
    opaque op: written as graph ops, the in-place store into the pool was functionalized
    into a copy of the whole layer's pool per step."""
    kd = k_pages.view(-1, k_pages.shape[-2], k_pages.shape[-1])
    vd = v_pages.view(-1, v_pages.shape[-2], v_pages.shape[-1])
    kd.index_copy_(0, slots, k.to(kd.dtype))
    vd.index_copy_(0, slots, v.to(vd.dtype))
    out = torch.empty_like(q)
    torch.ops.radixserve_cpu.paged_attention(q.contiguous(), k_pages, v_pages, out, *plan, sm_scale)
    return out


@store_attend.register_fake
def _(q: torch.Tensor, *args: Any) -> torch.Tensor:
    return torch.empty_like(q)


class CompiledDecode(nn.Module):
    """The model's decode forward over a bucket's fixed-shape inputs, written for tracing:
    the same parameters (shared, not copied), plain ``F.linear`` (Inductor packs under
    freezing), torch RoPE and SiLU, the CPU attention kernel as one op per layer."""

    def __init__(
        self, model: LlamaForCausalLM, k_pages: list[torch.Tensor], v_pages: list[torch.Tensor]
    ) -> None:
        super().__init__()
        cfg = model.config
        self.cfg = cfg
        m = model.model
        self.embed = m.embed_tokens.weight
        self.params = nn.ParameterList()
        for layer in m.layers:
            a, mlp = layer.self_attn, layer.mlp
            for mod in (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj):
                assert mod.bias is None, "the experiment covers bias-free Llama layers"
            self.params.extend(
                [
                    layer.input_layernorm.weight,
                    a.qkv_proj.weight,
                    a.o_proj.weight,
                    layer.post_attention_layernorm.weight,
                    mlp.gate_up_proj.weight,
                    mlp.down_proj.weight,
                ]
            )
        self.final_norm = m.norm.weight
        self.lm_head = model.lm_head.weight
        self.eps = cfg.rms_norm_eps
        self.k_pages, self.v_pages = k_pages, v_pages

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, w.shape, w, self.eps)
        return w * F.rms_norm(x.float(), w.shape, None, self.eps).to(x.dtype)

    def forward(
        self,
        ids: torch.Tensor,
        slots: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        plan: list[torch.Tensor],
    ) -> torch.Tensor:
        cfg = self.cfg
        hq, hkv, d = cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim
        h = F.embedding(ids, self.embed)
        t = h.shape[0]
        for i in range(cfg.num_layers):
            w_in, w_qkv, w_o, w_post, w_gu, w_down = self.params[6 * i : 6 * i + 6]
            qkv = F.linear(self._norm(h, w_in), w_qkv).view(t, hq + 2 * hkv, d)
            qk = apply_rotary(qkv[:, : hq + hkv], cos, sin)
            q, k, v = qk[:, :hq], qk[:, hq:], qkv[:, hq + hkv :]
            out = store_attend(q, k, v, self.k_pages[i], self.v_pages[i], slots, plan, d**-0.5)
            h = h + F.linear(out.reshape(t, hq * d), w_o)
            gate, up = F.linear(self._norm(h, w_post), w_gu).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, w_down)
        return F.linear(self._norm(h, self.final_norm), self.lm_head).float()


def static_inputs(model: LlamaForCausalLM, batch: ForwardBatch) -> tuple[Any, ...]:
    """A decode batch as the fixed-shape tensors of a static bucket (the whole page-table
    width per row, so the shapes never change between steps)."""
    assert batch.page_table is not None and batch.out_cache_loc is not None
    b, width = batch.page_table.shape
    i64 = torch.int64
    plan = [
        torch.arange(b, dtype=i64),  # q_start
        torch.ones(b, dtype=i64),  # new_len
        torch.arange(b + 1, dtype=i64),  # group_start: one member per group
        torch.zeros(0, dtype=i64),  # shared_pages
        torch.zeros(b + 1, dtype=i64),  # shared_start
        batch.page_table.to(i64).reshape(-1),  # own_pages
        torch.arange(b + 1, dtype=i64) * width,  # own_start
        batch.seq_lens.to(i64),  # own_len
    ]
    dt = model.dtype
    cos, sin = model.model.rotary.cos_sin(batch.positions, max(batch.seq_lens_cpu), dt)
    return batch.input_ids, batch.out_cache_loc, cos, sin, plan


def decode_batch(engine: Engine, b: int) -> ForwardBatch:
    """The ForwardBatch of a real decode step of ``b`` sequences (32-token prompts)."""
    seen: list[ForwardBatch] = []
    fwd = engine.runner.model.forward

    def spy(batch: ForwardBatch, attn: Any) -> torch.Tensor:
        seen.append(batch)
        return fwd(batch, attn)

    engine.runner.model.forward = spy  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(b)
    for _ in range(b):
        engine.add_request(torch.randint(100, 20000, (32,), generator=g).tolist(), params)
    while engine.has_unfinished():
        engine.step()
    engine.runner.model.forward = fwd  # type: ignore[method-assign]
    return next(x for x in reversed(seen) if x.is_decode_only and x.batch_size == b)


def time_ms(fn: Any, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--mode", default="default", help="torch.compile mode")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/bench_decode_compile.json")
    args = ap.parse_args()
    import torch._inductor.config as inductor_config

    from radixserve.model_store import resolve_model

    inductor_config.freezing = True
    engine = Engine(
        resolve_model(None),
        dtype=args.dtype,
        device="cpu",
        num_pages=512,
        max_model_len=1024,
        max_running_requests=max(args.batch),
    )
    model, attn, pool = engine.runner.model, engine.runner.attn, engine.runner.pool
    stack = CompiledDecode(model, pool.k_data, pool.v_data).eval()
    results: list[dict[str, Any]] = []
    for b in args.batch:
        batch = decode_batch(engine, b)
        inputs = static_inputs(model, batch)

        def eager() -> torch.Tensor:
            attn.init_forward_metadata(batch)
            return model.forward(batch, attn)

        compiled = torch.compile(
            stack, dynamic=False, mode=None if args.mode == "default" else args.mode
        )
        with torch.no_grad():
            t = time.perf_counter()
            got = compiled(*inputs)
            compile_s = time.perf_counter() - t
            ref = eager()
            err = (got - ref).abs().max().item()
            same_top = bool((got.argmax(-1) == ref.argmax(-1)).all())
            rounds: dict[str, list[float]] = {"eager": [], "compiled": []}
            for _ in range(args.rounds):  # interleaved: the machine's drift hits both alike
                rounds["eager"].append(time_ms(eager, args.reps))
                rounds["compiled"].append(time_ms(lambda: compiled(*inputs), args.reps))
        e, c = statistics.median(rounds["eager"]), statistics.median(rounds["compiled"])
        print(
            f"{args.dtype} batch {b:3d}: eager forward {e:6.1f} ms, compiled {c:6.1f} ms ({c / e:.2f}x; "
            f"rounds eager {rounds['eager']}, compiled {rounds['compiled']}); compile {compile_s:.1f} s; "
            f"max |dlogit| {err:.2e}, same argmax {same_top}",
            flush=True,
        )
        results.append(
            {
                "batch": b,
                "eager_ms": e,
                "compiled_ms": c,
                "compile_s": compile_s,
                "rounds": rounds,
                "max_abs_logit_diff": err,
                "same_argmax": same_top,
            }
        )
    out = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "dtype": args.dtype,
        "mode": args.mode,
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
