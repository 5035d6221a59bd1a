"""Fork / join: answer from several angles in parallel, then combine them.

`s.fork(n)` makes n states that continue from the same text, so their calls share the
cached prefix and decode together in the engine's batches; `join()` gathers each fork's
variables into the parent as lists. Control flow is plain Python.

    radixserve serve &
    python frontend_dsl/examples/fork_join.py               # or: python frontend_dsl/examples/fork_join.py --local
"""

from __future__ import annotations

from _backend import make_backend, parse_args

from frontend_dsl import assistant, gen, program, system, user

ASPECTS = ["its food", "its history", "its landmarks"]


@program
def travel_guide(s, city: str):
    s += system("You are a travel guide. Each answer is one sentence.")
    s += user(f"I am visiting {city}.")
    forks = s.fork(len(ASPECTS))
    for fork, aspect in zip(forks, ASPECTS):
        fork += user(f"Tell me about {aspect}.")
        fork += assistant(gen("tip", max_tokens=40, stop=["\n"]))
    forks.join()  # s["tip"] is now the list of the three tips
    notes = "\n".join(f"- {aspect}: {tip.strip()}" for aspect, tip in zip(ASPECTS, s["tip"]))
    s += user(f"My notes:\n{notes}\nSummarize them in one sentence.")
    s += assistant(gen("summary", max_tokens=60, stop=["\n"]))


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    with make_backend(args) as backend:
        state = travel_guide.run("Paris", backend=backend, defaults={"temperature": 0.0})
        state.raise_for_error()
        for aspect, tip in zip(ASPECTS, state["tip"]):
            print(f"{aspect}: {tip.strip()}")
        print(f"\nSummary: {state['summary'].strip()}")
        u = state.usage
        print(
            f"\n{u.calls} calls, {u.tokens_reused}/{u.tokens_sent} prompt tokens reused ({u.hit_rate:.0%})"
        )


if __name__ == "__main__":
    main()
