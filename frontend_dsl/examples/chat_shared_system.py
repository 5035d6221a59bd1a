"""A chat program with a long shared system prompt, run for many users at once.

Every run starts with the same system prompt: the engine computes it once and every
other run (and every later turn of a run) reuses it from the radix cache.

    radixserve serve &                         # the default model, on tcp://127.0.0.1:5555
    python frontend_dsl/examples/chat_shared_system.py
    python frontend_dsl/examples/chat_shared_system.py --local   # no server: an in-process engine
"""

from __future__ import annotations

from _backend import make_backend, parse_args

from frontend_dsl import assistant, batch_usage, gen, program, system, user

SYSTEM = (
    "You are Atlas, a concise geography tutor. You answer in one or two short sentences, "
    "you always name the country you are talking about, and you never invent facts. "
    "If a question is not about geography, you say so politely and suggest a geography topic instead."
)


@program
def tutor(s, question: str):
    s += system(SYSTEM)
    s += user(question)
    s += assistant(gen("answer", max_tokens=48, stop=["\n\n"]))
    s += user("Give me one more fact about that place, in one sentence.")
    s += assistant(gen("fact", max_tokens=48, stop=["\n\n"]))


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    questions = [
        "What is the capital of France?",
        "Which river flows through Cairo?",
        "What is the highest mountain in Japan?",
        "Which ocean lies west of Portugal?",
        "What is the largest desert in Africa?",
        "Which country has the city of Kyoto?",
    ]
    with make_backend(args) as backend:
        states = tutor.run_batch(
            [{"question": q} for q in questions],
            backend=backend,
            concurrency=8,
            progress_bar=True,
            defaults={"temperature": 0.0},
        )
        for state in states:
            state.raise_for_error()
            print(
                f"\nQ: {state.messages()[1]['content']}\nA: {state['answer'].strip()}\n+ {state['fact'].strip()}"
            )
        usage = batch_usage(states)
        print(
            f"\n{usage.calls} calls: {usage.tokens_sent} prompt tokens sent, {usage.tokens_reused} reused "
            f"from the radix cache ({usage.hit_rate:.0%})"
        )


if __name__ == "__main__":
    main()
