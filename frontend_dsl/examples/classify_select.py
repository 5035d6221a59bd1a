"""A select-based classifier: the model scores each label, no free-form generation.

`select` tokenizes the prompt and each label together, scores every label's tokens with
the model's logprobs (length-normalized mean by default) in one batched call that reuses
the cached prompt, and appends the best label.

    radixserve serve &
    python frontend_dsl/examples/classify_select.py
    python frontend_dsl/examples/classify_select.py --local   # no server: an in-process engine
"""

from __future__ import annotations

from _backend import make_backend, parse_args

from frontend_dsl import assistant, batch_usage, program, select, user

LABELS = ["positive", "negative"]


@program
def sentiment(s, review: str):
    s += user(f"Is the following movie review positive or negative?\n\n{review}")
    s += assistant("This review is " + select("label", choices=LABELS))


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    reviews = [
        "I loved this movie, it was wonderful and moving!",
        "Terrible. Boring plot and awful acting; I walked out.",
        "A delightful film with a great cast.",
        "The worst film I have seen this year.",
        "What a waste of two hours.",
        "An absolute masterpiece.",
    ]
    with make_backend(args) as backend:
        states = sentiment.run_batch(
            [{"review": r} for r in reviews], backend=backend, concurrency=8
        )
        for review, state in zip(reviews, states):
            state.raise_for_error()
            scores = state.get_meta("label")["scores"]
            detail = ", ".join(f"{label} {score:.2f}" for label, score in zip(LABELS, scores))
            print(f"{state['label']:>8}  ({detail})  {review}")
        usage = batch_usage(states)
        print(
            f"\n{usage.calls} scoring calls, {usage.tokens_reused}/{usage.tokens_sent} prompt tokens reused"
        )


if __name__ == "__main__":
    main()
