"""Seeded shared-prefix workloads for the peer benchmarks, and their optimal hit rates.

Every workload is generated locally from a seed (no downloads) as chat messages, rendered
to token ids with the model's own chat template, so every peer receives the *same token
ids*. A workload is a list of sessions; a session's requests are sent one after another
(a conversation), sessions run concurrently.

=================  =============================================================  ==========
workload           prefix structure                                               answers
=================  =============================================================  ==========
shared_system      ``systems`` system prompts of ~``system_tokens`` tokens, each  128 tokens
                   shared by many one-turn chats with short, distinct user turns
multi_turn         ``conversations`` chats of ``turns`` turns; turn k+1's prompt   64 tokens
                   carries turn k's whole history (scripted assistant answers,
                   so the prefix structure is the same for every peer)
few_shot           one long prefix (``examples`` worked Q/A pairs) followed by     64 tokens
                   many different questions
tree (DSL)         see ``benchmarks/peers/dsl_tree.py``: one prompt forked into
                   branches and sub-branches through ``frontend_dsl``; its optimum
                   comes from the calls actually issued (answers are part of the
                   later prompts), computed by :func:`optimal_hit_rate` too
=================  =============================================================  ==========

**Optimal hit rate.** The hit rate of an ideal prefix cache of unbounded size that sees
the requests in issue order: each request may reuse the longest prefix it shares with
anything cached before it (earlier prompts, and for the DSL tree also their answers),
short of its own last token (whose logits must be computed), rounded down to whole pages
of ``page_size`` tokens. ``hit = sum(reused) / sum(prompt tokens)``. For the static
workloads this depends only on the prefix structure (order only moves which request pays
for a prefix first).

**Salt.** ``salt`` prefixes every prompt with a per-run tag (same token count for every
salt), so a run never hits on what an earlier run left in a peer's cache (peers without a
flush endpoint keep serving between runs) while the prefix structure stays identical.

Torch-free; needs only a tokenizer with a chat template (transformers').
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from radixserve.prefix import common_prefix_len

__all__ = [
    "Request",
    "Workload",
    "WORKLOADS",
    "build",
    "optimal_hit_rate",
    "common_prefix",
    "PrefixTrie",
]


@dataclass(frozen=True)
class Request:
    """One generation request: its chat messages, the token ids they render to, and its budget."""

    messages: tuple[dict[str, str], ...]
    prompt_ids: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True)
class Workload:
    """Sessions of requests (each session sequential, sessions concurrent) and its optimum."""

    name: str
    sessions: tuple[tuple[Request, ...], ...]
    description: str
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def requests(self) -> list[Request]:
        """Requests in issue order: every session's first turn, then every second turn, ..."""
        out: list[Request] = []
        depth = max((len(s) for s in self.sessions), default=0)
        for k in range(depth):
            out.extend(s[k] for s in self.sessions if k < len(s))
        return out

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt_ids) for r in self.requests)

    @property
    def max_output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    def optimal_hit_rate(self, page_size: int = 1) -> float:
        """The ideal-cache hit rate of this workload's prompts (see the module docstring)."""
        return optimal_hit_rate([r.prompt_ids for r in self.requests], page_size=page_size)

    def summary(self, page_size: int = 16) -> dict[str, Any]:
        reqs = self.requests
        return {
            "name": self.name,
            "sessions": len(self.sessions),
            "requests": len(reqs),
            "prompt_tokens": self.prompt_tokens,
            "max_output_tokens": self.max_output_tokens,
            "mean_prompt_tokens": self.prompt_tokens / max(1, len(reqs)),
            "optimal_hit_rate": self.optimal_hit_rate(1),
            f"optimal_hit_rate_page{page_size}": self.optimal_hit_rate(page_size),
            "params": self.params,
        }


# ----------------------------------------------------------------------------- optimum
class PrefixTrie:
    """A token trie (nested dicts): ``insert`` a sequence, ``match`` the longest shared prefix."""

    def __init__(self) -> None:
        self.root: dict[int, dict] = {}

    def insert(self, tokens: Iterable[int]) -> None:
        node = self.root
        for t in tokens:
            node = node.setdefault(t, {})

    def match(self, tokens: Sequence[int]) -> int:
        node, n = self.root, 0
        for t in tokens:
            nxt = node.get(t)
            if nxt is None:
                break
            node, n = nxt, n + 1
        return n


def optimal_hit_rate(
    prompts: Sequence[Sequence[int]],
    page_size: int = 1,
    cacheable: Sequence[Sequence[int]] | None = None,
) -> float:
    """Ideal-cache hit rate of ``prompts`` in this order.

    Request i reuses ``min(lcp_i, len_i - 1)`` tokens rounded down to a multiple of
    ``page_size``, where ``lcp_i`` is its longest common prefix with anything cached before
    it: the earlier prompts, or ``cacheable[j]`` for j < i when given (e.g. prompt + answer).
    """
    if page_size < 1:
        raise ValueError("page_size must be >= 1")
    trie = PrefixTrie()
    total = hit = 0
    for i, ids in enumerate(prompts):
        n = len(ids)
        reuse = min(trie.match(ids), max(0, n - 1))
        hit += reuse // page_size * page_size
        total += n
        trie.insert(cacheable[i] if cacheable is not None else ids)
    return hit / total if total else 0.0


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two token sequences."""
    return common_prefix_len(a, b)


# ----------------------------------------------------------------------------- text
TOPICS = [
    "astronomy",
    "cooking",
    "gardening",
    "chess",
    "linear algebra",
    "medieval history",
    "sailing",
    "compilers",
    "beekeeping",
    "photography",
    "volcanoes",
    "jazz",
    "origami",
    "cryptography",
    "marathon training",
    "ceramics",
]
_SUBJECTS = [
    "the student",
    "a beginner",
    "every answer",
    "the explanation",
    "a good example",
    "the summary",
    "each step",
    "the final advice",
    "a careful reader",
    "the tutor",
]
_VERBS = [
    "should mention",
    "must avoid",
    "can compare",
    "will describe",
    "ought to stress",
    "may include",
    "needs to define",
    "should connect",
    "has to check",
    "can illustrate",
]
_OBJECTS = [
    "the most common mistakes",
    "a concrete number",
    "the historical background",
    "a safety note",
    "the trade-offs involved",
    "a simple analogy",
    "the key vocabulary",
    "an everyday situation",
    "the underlying principle",
    "a short checklist",
    "what experts disagree about",
    "a practical tip",
]
_TAILS = [
    "before moving on",
    "in plain words",
    "without jargon",
    "with one example",
    "for a curious adult",
    "in at most two sentences",
    "when it helps",
    "if the question is vague",
    "at the end",
    "first",
]
QUESTIONS = [
    "What should a beginner learn first?",
    "Name three common mistakes.",
    "Explain one key idea simply.",
    "What tools do I need?",
    "Give me a short exercise.",
    "How do experts practice?",
    "What is a surprising fact?",
    "Summarize the history in two sentences.",
    "What is a good first project?",
    "How do I measure progress?",
    "Recommend a book.",
    "What does a typical day look like?",
    "Why does this matter?",
    "What is hard about it?",
]


def _sentence(rng: random.Random, topic: str) -> str:
    return (
        f"When the topic is {topic}, {rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} "
        f"{rng.choice(_OBJECTS)} {rng.choice(_TAILS)}."
    )


def _text_of_tokens(tok: Any, rng: random.Random, topic: str, n_tokens: int, head: str = "") -> str:
    """Sentences about ``topic`` until the text is about ``n_tokens`` tokens long (sentences
    are counted one by one; joined, the count differs by a token or so per sentence)."""
    parts = [head] if head else []
    count = len(tok.encode(head, add_special_tokens=False)) if head else 0
    while count < n_tokens:
        sentence = " " + _sentence(rng, topic)
        parts.append(sentence.strip())
        count += len(tok.encode(sentence, add_special_tokens=False))
    return " ".join(parts)


def _salt_tag(salt: int) -> str:
    # A fixed-width number, so every salt gives the same token count.
    return f"[run {salt % 100000:05d}] "


def render(tok: Any, messages: Sequence[dict[str, str]]) -> tuple[int, ...]:
    """Token ids of a chat with the generation prompt, by the tokenizer's chat template."""
    out = tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
    ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
    return tuple(int(t) for t in ids)


# ----------------------------------------------------------------------------- builders
def shared_system(
    tok: Any,
    *,
    seed: int = 0,
    salt: int = 0,
    systems: int = 4,
    requests: int = 64,
    system_tokens: int = 1000,
    max_tokens: int = 128,
) -> Workload:
    """Many one-turn chats under a few long system prompts; shuffled; short user turns."""
    rng = random.Random(seed)
    prompts = [
        _salt_tag(salt)
        + _text_of_tokens(
            tok,
            random.Random(f"{seed}/{s}"),
            TOPICS[s % len(TOPICS)],
            system_tokens,
            head=f"You are an expert tutor in {TOPICS[s % len(TOPICS)]}.",
        )
        for s in range(systems)
    ]
    sessions = []
    for i in range(requests):
        s = i % systems
        msgs = (
            {"role": "system", "content": prompts[s]},
            {
                "role": "user",
                "content": f"{QUESTIONS[rng.randrange(len(QUESTIONS))]} (question {i})",
            },
        )
        sessions.append((Request(msgs, render(tok, msgs), max_tokens),))
    rng.shuffle(sessions)
    return Workload(
        "shared_system",
        tuple(sessions),
        "few long system prompts, many one-turn chats",
        {
            "seed": seed,
            "salt": salt,
            "systems": systems,
            "requests": requests,
            "system_tokens": system_tokens,
            "max_tokens": max_tokens,
        },
    )


def multi_turn(
    tok: Any,
    *,
    seed: int = 0,
    salt: int = 0,
    conversations: int = 16,
    turns: int = 4,
    answer_tokens: int = 100,
    max_tokens: int = 64,
) -> Workload:
    """Conversations whose next turn carries the whole history (scripted assistant turns)."""
    sessions = []
    system = (
        _salt_tag(salt)
        + "You are a friendly and knowledgeable assistant. Answer clearly and briefly."
    )
    for c in range(conversations):
        rng = random.Random(f"{seed}/conv{c}")
        topic = TOPICS[c % len(TOPICS)]
        history: list[dict[str, str]] = [{"role": "system", "content": system}]
        reqs = []
        for k in range(turns):
            history.append(
                {"role": "user", "content": f"About {topic}: {rng.choice(QUESTIONS)} (turn {k})"}
            )
            msgs = tuple(history)
            reqs.append(Request(msgs, render(tok, msgs), max_tokens))
            history.append(
                {"role": "assistant", "content": _text_of_tokens(tok, rng, topic, answer_tokens)}
            )
        sessions.append(tuple(reqs))
    return Workload(
        "multi_turn",
        tuple(sessions),
        "conversations; each turn carries the whole history",
        {
            "seed": seed,
            "salt": salt,
            "conversations": conversations,
            "turns": turns,
            "answer_tokens": answer_tokens,
            "max_tokens": max_tokens,
        },
    )


def few_shot(
    tok: Any,
    *,
    seed: int = 0,
    salt: int = 0,
    examples: int = 5,
    requests: int = 64,
    example_tokens: int = 150,
    max_tokens: int = 64,
) -> Workload:
    """One long few-shot prefix (worked Q/A pairs as chat turns), many different questions."""
    rng = random.Random(f"{seed}/fewshot")
    msgs: list[dict[str, str]] = [
        {
            "role": "system",
            "content": _salt_tag(salt) + "You answer study questions "
            "in the style of the examples: a short, precise paragraph.",
        }
    ]
    for e in range(examples):
        topic = TOPICS[e % len(TOPICS)]
        msgs.append({"role": "user", "content": f"About {topic}: {QUESTIONS[e % len(QUESTIONS)]}"})
        msgs.append(
            {"role": "assistant", "content": _text_of_tokens(tok, rng, topic, example_tokens)}
        )
    qrng = random.Random(seed)
    sessions = []
    for i in range(requests):
        topic = TOPICS[qrng.randrange(len(TOPICS))]
        m = tuple(msgs) + (
            {"role": "user", "content": f"About {topic}: {qrng.choice(QUESTIONS)} (question {i})"},
        )
        sessions.append((Request(m, render(tok, m), max_tokens),))
    return Workload(
        "few_shot",
        tuple(sessions),
        f"{examples}-example few-shot prefix, many questions",
        {
            "seed": seed,
            "salt": salt,
            "examples": examples,
            "requests": requests,
            "example_tokens": example_tokens,
            "max_tokens": max_tokens,
        },
    )


WORKLOADS: dict[str, Callable[..., Workload]] = {
    "shared_system": shared_system,
    "multi_turn": multi_turn,
    "few_shot": few_shot,
}


def build(name: str, tok: Any, **kwargs: Any) -> Workload:
    """Build workload ``name`` (a key of :data:`WORKLOADS`) with the given tokenizer."""
    try:
        fn = WORKLOADS[name]
    except KeyError:
        raise ValueError(
            f"unknown workload {name!r}; choose from {sorted(WORKLOADS)} (or 'tree')"
        ) from None
    return fn(tok, **kwargs)


def main() -> None:
    """Print each workload's size and optimum (``python benchmarks/workloads.py [--model DIR]``)."""
    import argparse
    import json

    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--model", default=None, help="HF dir (default: the default model)")
    ap.add_argument("--page-size", type=int, default=16)
    args = ap.parse_args()
    if args.model is None:
        from radixserve.model_store import ensure_default_model

        args.model = str(ensure_default_model())
    tok = AutoTokenizer.from_pretrained(args.model)
    for name in WORKLOADS:
        print(json.dumps(build(name, tok).summary(args.page_size)))


if __name__ == "__main__":
    main()
