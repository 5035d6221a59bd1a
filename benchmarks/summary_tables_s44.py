"""The generated table of session 44's measurement on the AMD machine (2026-12-06): code edits
through /v1/chat/completions with and without the code as OpenAI's ``prediction``, beside
prompt lookup (``bench_predicted_outputs.py``); summary_tables.TABLES lists it with the others.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from results_data import PREDICTED, load, spread
from summary_tables_s22 import _head, _row

LABELS = {
    "plain": "no algorithm, no prediction",
    "predicted": "no algorithm, the code as the prediction",
    "ngram": "`--speculative-algorithm ngram`, no prediction",
    "ngram+pred": "`--speculative-algorithm ngram`, the code as the prediction",
}


def table_predicted_outputs(name: str = PREDICTED) -> str:
    """Per variant: edits, output tokens, the median time per output token after the first,
    each edit's time per token over its own without a prediction (median and range), the
    tokens drafted and accepted, and whether every answer was the plain one."""
    out = _head(
        "server, request",
        "edits",
        "output tokens",
        "ms a token (median)",
        "over no prediction, edit by edit",
        "drafted",
        "accepted",
        "same answers",
        align="lrrrlrrl",
    )
    d = load(name)
    for variant, row in d["results"].items():
        per_token = [
            1000 * r["decode_s"] / max(1, r["tokens"] - 1)
            for r in d["requests"]
            if r["variant"] == variant
        ]
        out.append(
            _row(
                LABELS[variant],
                row["requests"],
                row["tokens"],
                f"{statistics.median(per_token):.1f}",
                spread(row["over_plain"]),
                row["drafted"],
                row["accepted"],
                "yes" if row["same_text"] else "no",
            )
        )
    return "\n".join(out)


TABLES: dict[str, Callable[[], str]] = {"predicted_outputs_s44": table_predicted_outputs}
