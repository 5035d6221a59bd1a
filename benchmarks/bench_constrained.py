"""Constrained decoding: what a grammar mask costs per decode step, at batch 1, 16 and 64.

Two measurements, each interleaved round by round (this machine's speed drifts):

1. ``step``: whole engine decode steps of the default model (SmolLM2-135M) with a batch of
   B requests, all unconstrained (``none``), all under a regex (``regex``) or all under a
   JSON schema (``json``). Grammars that cannot end before ``--steps`` tokens keep every
   request decoding; only steps where all B requests decode are timed (median). The grammar
   hooks (sampler masking, matcher updates) are timed inside those steps too, so the report
   gives both the step ratio and the grammar work as a share of an unconstrained step.
2. ``sampler``: the grammar work alone, on ``[B, vocab]`` logits with no model: the
   sampler's masking of B constrained rows (copy + one batched mask call), plus the per-row
   matcher update (accept the token, fill the next mask) that the scheduler runs after it,
   next to the unconstrained sampler call for scale.

``--libraries`` adds the library comparison behind the choice of xgrammar: compile time
of a regex and a JSON schema and per-step mask fill at batch 1/16/64, for xgrammar and
outlines-core (when installed) on the same tokenizer.

    python benchmarks/bench_constrained.py                    # SmolLM2, ~5 min on 2 busy cores
    python benchmarks/bench_constrained.py --batches 1 16 --steps 8 --rounds 1   # quick
    python benchmarks/bench_constrained.py --libraries        # also the library comparison

Times are CPU time (``time.process_time``/``thread_time``): on a shared machine wall time
mostly measures the neighbours. Prints tables and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Before torch: radixserve sets the served process's OpenMP wait policy and spin count
# (OMP_WAIT_POLICY=PASSIVE, GOMP_SPINCOUNT), which the runtime reads once, when torch loads it.
import radixserve  # noqa: F401

# isort: split

import torch  # noqa: E402

from radixserve.constrained import Constraint  # noqa: E402
from radixserve.sampling_params import SamplingParams  # noqa: E402

# Long-running grammars: neither can end before a few hundred characters, so every request
# keeps decoding for the measured steps whatever the model samples.
LONG_REGEX = r"[a-z][a-z ,.]{399}"
LONG_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "items": {
            "type": "array",
            "minItems": 60,
            "maxItems": 80,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 16},
                    "qty": {"type": "integer", "minimum": 0, "maximum": 99},
                },
                "required": ["name", "qty"],
            },
        },
    },
    "required": ["title", "items"],
}
# For the library comparison: the tests' IPv4 regex and a nested schema, walked with real text.
IPV4 = r"((25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "[0-9]{5}"},
            },
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
}
PERSON_TEXT = json.dumps(
    {
        "name": "Ada Lovelace",
        "age": 36,
        "role": "admin",
        "tags": ["math", "poetry"],
        "address": {"city": "London", "zip": "12345"},
    }
)


def mode_params(mode: str, i: int, max_tokens: int) -> SamplingParams:
    kw: dict[str, Any] = dict(temperature=0.8, seed=i, max_tokens=max_tokens, ignore_eos=True)
    if mode == "regex":
        kw["regex"] = LONG_REGEX
    elif mode == "json":
        kw["json_schema"] = json.dumps(LONG_SCHEMA)
    return SamplingParams(**kw)


class GrammarTimer:
    """CPU time spent in the grammar hooks (sampler masking, matcher updates) while stepping."""

    def __init__(self) -> None:
        from radixserve.constrained.matcher import GrammarMatcher
        from radixserve.engine.sampler import Sampler

        self.seconds = 0.0
        for cls, name in ((Sampler, "_apply_grammar"), (GrammarMatcher, "accept")):
            setattr(cls, name, self._timed(getattr(cls, name)))

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kw: Any) -> Any:
            t0 = time.thread_time()  # CPU time: immune to the preemption of a busy machine
            try:
                return fn(*args, **kw)
            finally:
                self.seconds += time.thread_time() - t0

        return wrapper


def engine_steps(
    engine: Any, prompts: list[list[int]], mode: str, steps: int, timer: GrammarTimer
) -> tuple[list[float], list[float]]:
    """CPU milliseconds (all threads) of each engine step in which all requests decode, and of
    its grammar work. CPU time, not wall time: on a shared machine wall time mostly measures
    the neighbours, while the work a step does is what the comparison is about."""
    rids = [engine.add_request(p, mode_params(mode, i, steps + 4)) for i, p in enumerate(prompts)]
    times: list[float] = []
    grammar: list[float] = []
    while engine.has_unfinished():
        decoding = all(r.is_decoding for r in engine.scheduler.running) and len(
            engine.scheduler.running
        ) == len(rids)
        g0 = timer.seconds
        t0 = time.process_time()
        outs = engine.step()
        dt_ms = (time.process_time() - t0) * 1e3
        if decoding and len(times) < steps:
            times.append(dt_ms)
            grammar.append((timer.seconds - g0) * 1e3)
        if len(times) >= steps:
            for rid in rids:
                engine.abort(rid)
        assert all(o.finish_reason in (None, "abort", "length") for o in outs), [
            o.finish_reason for o in outs
        ]
    engine.flush_cache()
    return times, grammar


def bench_steps(engine: Any, batches: list[int], steps: int, rounds: int) -> list[dict[str, Any]]:
    tok = engine.tokenizer
    base = "Write a long shopping list for a family of four, with quantities, for a whole month of meals"
    rows = []
    timer = GrammarTimer()
    for b in batches:
        # Distinct prompts of equal length (no prefix sharing to blur the comparison).
        prompts = [tok.encode(f"{i:03d}. {base}") for i in range(b)]
        n = min(len(p) for p in prompts)
        prompts = [p[:n] for p in prompts]
        per_mode: dict[str, list[float]] = {"none": [], "regex": [], "json": []}
        grammar: dict[str, list[float]] = {"none": [], "regex": [], "json": []}
        for _ in range(rounds):
            for mode in per_mode:
                t, g = engine_steps(engine, prompts, mode, steps, timer)
                per_mode[mode] += t
                grammar[mode] += g
        med = {m: statistics.median(v) for m, v in per_mode.items()}
        gmed = {m: statistics.median(v) for m, v in grammar.items()}
        row = {
            "batch": b,
            "steps_timed": len(per_mode["none"]),
            "ms_per_step": med,
            "grammar_ms_per_step": gmed,
        }
        for m in ("regex", "json"):
            row[f"step_ratio_{m}"] = med[m] / med["none"]
            row[f"grammar_share_{m}"] = gmed[m] / med["none"]  # grammar work / unconstrained step
        rows.append(row)
        print(
            f"  batch {b:3d}: step none {med['none']:7.1f} ms | regex {med['regex']:7.1f} ms "
            f"(x{row['step_ratio_regex']:.2f}), grammar {gmed['regex']:5.2f} ms = {row['grammar_share_regex']:.1%} "
            f"| json {med['json']:7.1f} ms "
            f"(x{row['step_ratio_json']:.2f}), grammar {gmed['json']:5.2f} ms = {row['grammar_share_json']:.1%}",
            flush=True,
        )
    return rows


def best_ms(fn: Callable[[], object], repeat: int) -> float:
    """Least CPU milliseconds of ``repeat`` calls."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return best * 1e3


def bench_sampler(engine: Any, batches: list[int], repeat: int) -> list[dict[str, Any]]:
    """The sampler with and without masks on random logits, and the matcher update per row."""
    from radixserve.constrained.grammar import compiler_for
    from radixserve.engine.sampler import Sampler

    mc = engine.model_config
    compiler = compiler_for(engine.tokenizer, mc.vocab_size, mc.eos_token_ids)
    sampler = Sampler(mc.vocab_size, mc.eos_token_ids)
    # Matchers part-way into a JSON document (inside the items array), like mid-generation.
    prefix = engine.tokenizer.encode(
        '{"title": "groceries", "items": [{"name": "apples", "qty": 4}, {"name": "'
    )

    class Row:
        def __init__(self, grammar: Any) -> None:
            self.params = SamplingParams(temperature=0.8, top_p=0.95)
            self.token_ids = [1, 2, 3]
            self.prompt_len = 3
            self.generator = None
            self.grammar = grammar

    rows_out = []
    for b in batches:
        logits = torch.randn(b, mc.vocab_size)
        free = [Row(None) for _ in range(b)]
        masked = []
        for _ in range(b):
            m = compiler.new_matcher(Constraint("json_schema", json.dumps(LONG_SCHEMA)))
            assert m.replay(prefix)
            masked.append(Row(m))
        t_free = best_ms(lambda: sampler.sample(logits, free), repeat)
        t_mask = best_ms(
            lambda: sampler._apply_grammar(logits, masked), repeat
        )  # copy + batched mask
        # The scheduler's per-row update: accept a token and fill the next mask (then undo it:
        # fork() copies the state so every timed call starts from the same place).
        token = engine.tokenizer.encode("b")[0]
        forks = [r.grammar._m.fork() for r in masked]

        def update() -> None:
            for f in forks:
                f.accept_token(token)
                f.fill_next_token_bitmask(masked[0].grammar.next_mask)
                f.rollback(1)

        t_update = best_ms(update, repeat)
        row = {
            "batch": b,
            "sample_ms": t_free,
            "mask_ms": t_mask,
            "matcher_update_ms": t_update,
            "grammar_ms": t_mask + t_update,
        }
        rows_out.append(row)
        print(
            f"  batch {b:3d}: masks {t_mask:6.2f} ms + matcher updates {t_update:6.2f} ms = grammar "
            f"{row['grammar_ms']:6.2f} ms per step (the unconstrained sampler alone: {t_free:6.2f} ms)",
            flush=True,
        )
    return rows_out


def bench_libraries(
    tokenizer: Any, vocab_size: int, eos: int, batches: list[int]
) -> dict[str, Any]:
    """xgrammar vs outlines-core: compile times and per-step mask fill on the same walks (CPU ms)."""
    import xgrammar as xgr

    ipv4_text, json_text = "192.168.10.254", PERSON_TEXT
    schema = json.dumps(PERSON)
    out: dict[str, Any] = {}
    t0 = time.process_time()
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=[eos]
    )
    t_info = time.process_time() - t0
    comp = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    t0 = time.process_time()
    g_re = comp.compile_regex(IPV4)
    t_re = time.process_time() - t0
    t0 = time.process_time()
    g_js = comp.compile_json_schema(schema, any_whitespace=False)
    t_js = time.process_time() - t0
    words = (vocab_size + 31) // 32

    def xgr_fill(g: Any, text: str, b: int) -> float:
        ms = [xgr.GrammarMatcher(g) for _ in range(b)]
        mask = xgr.allocate_token_bitmask(b, vocab_size)
        ids = tokenizer.encode(text, add_special_tokens=False)
        total = 0.0
        for t in ids:
            t1 = time.process_time()
            for i, m in enumerate(ms):
                m.fill_next_token_bitmask(mask, i)
            total += time.process_time() - t1
            for m in ms:
                assert m.accept_token(t)
        return total / len(ids) * 1e3

    out["xgrammar"] = {
        "tokenizer_ms": t_info * 1e3,
        "regex_compile_ms": t_re * 1e3,
        "schema_compile_ms": t_js * 1e3,
        "fill_ms": {
            b: {"regex": xgr_fill(g_re, ipv4_text, b), "json": xgr_fill(g_js, json_text, b)}
            for b in batches
        },
    }
    try:
        import outlines_core as oc
    except ImportError:
        print("  outlines-core not installed: comparison skipped (pip install outlines-core)")
        return out
    # A byte-level vocabulary for outlines-core: GPT-2's byte symbols mapped back to bytes.
    bs = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    u2b = {chr(c): b for b, c in zip(bs, cs)}
    t0 = time.process_time()
    special = set(tokenizer.all_special_ids)
    vocab: dict[bytes, list[int]] = {}
    for tok, i in tokenizer.get_vocab().items():
        if i not in special and all(ch in u2b for ch in tok):
            vocab.setdefault(bytes(u2b[ch] for ch in tok), []).append(i)
    ov = oc.Vocabulary(eos, vocab)
    t_info = time.process_time() - t0
    t0 = time.process_time()
    i_re = oc.Index(IPV4, ov)
    t_re = time.process_time() - t0
    t0 = time.process_time()
    i_js = oc.Index(oc.json_schema.build_regex_from_schema(schema), ov)
    t_js = time.process_time() - t0

    def oc_fill(index: Any, text: str, b: int) -> float:
        guides = [oc.Guide(index) for _ in range(b)]
        mask = torch.zeros(b, words, dtype=torch.int32)
        ids = tokenizer.encode(text, add_special_tokens=False)
        total = 0.0
        for t in ids:
            t1 = time.process_time()
            for i, g in enumerate(guides):
                g.write_mask_into(mask[i].data_ptr(), words, 4)
            total += time.process_time() - t1
            for g in guides:
                g.advance(t, return_tokens=False)
        return total / len(ids) * 1e3

    out["outlines_core"] = {
        "tokenizer_ms": t_info * 1e3,
        "regex_compile_ms": t_re * 1e3,
        "schema_compile_ms": t_js * 1e3,
        "fill_ms": {
            b: {"regex": oc_fill(i_re, ipv4_text, b), "json": oc_fill(i_js, json_text, b)}
            for b in batches
        },
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model", default=None, help="HF model directory (default: SmolLM2-135M-Instruct)"
    )
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed per mode and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--libraries", action="store_true", help="also compare xgrammar with outlines-core"
    )
    ap.add_argument("--skip-steps", action="store_true", help="skip the engine-step measurement")
    ap.add_argument("--out", default="benchmarks/results/constrained.json")
    args = ap.parse_args()

    from radixserve.engine.engine import Engine

    engine = Engine(
        args.model,
        page_size=16,
        num_pages=4096 if args.device == "cpu" else 16384,
        max_num_tokens=8192,
        max_running_requests=max(args.batches),
        device=args.device,
        num_threads=args.threads,
        dtype="float32" if args.device == "cpu" else "bfloat16",
    )
    result: dict[str, Any] = {
        "when": dt.datetime.now().isoformat(timespec="seconds"),
        "host": platform.node(),
        "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(),
        "model": str(engine.model_path),
        "torch_threads": torch.get_num_threads(),
        "args": vars(args),
    }
    print(
        f"model {engine.model_path.name}, device {result['device']}, torch threads {result['torch_threads']}"
    )
    if args.libraries:
        print(
            "library comparison (same tokenizer; CPU ms to compile once, and to fill the masks of one step):"
        )
        mc = engine.model_config
        libs = bench_libraries(engine.tokenizer, mc.vocab_size, mc.eos_token_ids[0], args.batches)
        for name, r in libs.items():
            fills = "  ".join(
                f"B={b}: regex {v['regex']:.3f} json {v['json']:.3f}"
                for b, v in r["fill_ms"].items()
            )
            print(
                f"  {name:14s} vocab {r['tokenizer_ms']:6.0f} ms, compile regex {r['regex_compile_ms']:7.1f} ms, "
                f"schema {r['schema_compile_ms']:7.1f} ms; fill ms/step {fills}"
            )
        result["libraries"] = libs
    print("grammar work per step, no model (CPU ms, best of 20):")
    result["sampler"] = bench_sampler(engine, args.batches, repeat=20)
    if not args.skip_steps:
        print(
            f"engine decode steps (CPU ms; {args.steps} per mode and round, {args.rounds} rounds, median):"
        )
        result["steps"] = bench_steps(engine, args.batches, args.steps, args.rounds)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
