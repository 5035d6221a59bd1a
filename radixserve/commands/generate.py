"""``radixserve generate`` (offline generation) and ``radixserve demo`` (prefix reuse, shown).

No torch at module level: ``radixserve --help`` imports every command module.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from radixserve.cli import register
from radixserve.commands.engine_args import add_engine_arguments, engine_config


def _model_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="default",
        help="'default' (SmolLM2-135M-Instruct) or a local HF directory",
    )


def _generate_arguments(p: argparse.ArgumentParser) -> None:
    _model_argument(p)
    p.add_argument("prompts", nargs="+", help="prompt texts (one request each, run as one batch)")
    p.add_argument(
        "--chat",
        action="store_true",
        help="wrap each prompt as a user message in the chat template",
    )
    p.add_argument("--system", default=None, help="system message (implies --chat)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument(
        "--lora", default=None, help="run every prompt with this adapter of --lora-paths"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_engine_arguments(p)


@register(
    "generate", help="offline generation with the engine (no server)", arguments=_generate_arguments
)
def generate(args: argparse.Namespace) -> int:
    config = engine_config(args)  # first: it may switch Triton to its interpreter
    from radixserve.engine.engine import Engine
    from radixserve.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
    ).validate()
    engine = Engine(args.model, **config)
    prompts: list[Any] = list(args.prompts)
    if args.chat or args.system:
        prompts = [chat_ids(engine.tokenizer, _messages(args.system, p)) for p in prompts]
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params, lora=args.lora)
    dt = time.perf_counter() - t0
    engine.close()  # with --hicache-storage-dir: the next run starts warm
    for prompt, o in zip(args.prompts, outs):
        if args.json:
            print(
                json.dumps(
                    {
                        "prompt": prompt,
                        "text": o.text,
                        "finish_reason": o.finish_reason,
                        "usage": {
                            "prompt_tokens": o.usage.prompt_tokens,
                            "cached_tokens": o.usage.cached_tokens,
                            "completion_tokens": o.usage.completion_tokens,
                        },
                    }
                )
            )
        else:
            print(o.text if len(outs) == 1 else f"[{prompt!r}] {o.text}")
    if not args.json:
        gen = sum(o.usage.completion_tokens for o in outs)
        print(
            f"# {len(outs)} request(s), {gen} tokens in {dt:.2f} s ({gen / dt:.1f} tok/s)",
            flush=True,
        )
    return 0


def _messages(system: str | None, user: str) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": system}] if system else []
    return msgs + [{"role": "user", "content": user}]


def chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` in the model's chat template, ready for the assistant's turn."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


DEMO_SYSTEM = (
    "You are Radix, the support assistant of a small bookshop called The Paged Reader. "
    "The shop opens at 9 am and closes at 6 pm from Monday to Saturday, and is closed on Sundays. "
    "It sells new and second-hand books, with a large section of science fiction and a reading corner "
    "for children. Orders placed online before noon ship the same day; delivery takes two to four days. "
    "Returns are accepted within 30 days with the receipt. Members of the reading club get 10% off every "
    "purchase and an invitation to the monthly author evening. Answer in one or two short, friendly "
    "sentences, and never invent facts that are not stated here."
)
DEMO_QUESTIONS = [
    "When are you open on Saturday?",
    "Can I return a book I bought last week?",
    "Do you have books for kids?",
    "How long does delivery take?",
]
DEMO_FOLLOW_UP = "Thanks! And is there a discount for members?"


def _demo_arguments(p: argparse.ArgumentParser) -> None:
    _model_argument(p)
    p.add_argument("--max-tokens", type=int, default=32)
    add_engine_arguments(p)


@register(
    "demo",
    help="a chat-shaped run with a shared system prompt that prints the prefix-reuse figures",
    arguments=_demo_arguments,
)
def demo(args: argparse.Namespace) -> int:
    config = engine_config(args)  # first: it may switch Triton to its interpreter
    from radixserve.engine.engine import Engine
    from radixserve.sampling_params import SamplingParams

    engine = Engine(args.model, **config)
    tok = engine.tokenizer
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    print(
        f"model {engine.model_path}  |  KV pool {engine.allocator.num_pages} pages x {engine.pool.page_size} tokens"
        f"  |  radix cache {'off' if engine.config.disable_radix_cache else 'on'}\n"
    )

    rows: list[tuple[str, Any]] = []
    t0 = time.perf_counter()
    # Turn 1: the first question alone (cold), then the others together (they share the system prompt).
    convs = [_messages(DEMO_SYSTEM, q) for q in DEMO_QUESTIONS]
    first = engine.generate([chat_ids(tok, convs[0])], params)
    rest = engine.generate([chat_ids(tok, c) for c in convs[1:]], params)
    for q, c, o in zip(DEMO_QUESTIONS, convs, first + rest):
        rows.append((f"turn 1: {q}", o))
        c.append({"role": "assistant", "content": o.text})
        c.append({"role": "user", "content": DEMO_FOLLOW_UP})
    # Turn 2: every conversation continues; each hits its whole history.
    second = engine.generate([chat_ids(tok, c) for c in convs], params)
    rows += [(f"turn 2 of {q!r}", o) for q, o in zip(DEMO_QUESTIONS, second)]
    dt = time.perf_counter() - t0

    print(f"{'request':58} {'prompt':>6} {'cached':>6} {'output':>6}")
    for label, o in rows:
        u = o.usage
        print(f"{label[:58]:58} {u.prompt_tokens:6d} {u.cached_tokens:6d} {u.completion_tokens:6d}")
        print(f"    -> {o.text.strip()[:100]!r}")
    prompt = sum(o.usage.prompt_tokens for _, o in rows)
    cached = sum(o.usage.cached_tokens for _, o in rows)
    gen = sum(o.usage.completion_tokens for _, o in rows)
    s = engine.stats()
    print(f"\nprompt tokens {prompt}, cached (reused) {cached}, hit rate {cached / prompt:.1%}")
    print(
        f"computed {s.computed_tokens_total} tokens in {s.steps_total} steps, {dt:.2f} s: "
        f"{(prompt + gen) / dt:.1f} tok/s processed, {gen / dt:.1f} tok/s generated"
    )
    return 0
