"""The generated table of session 45's run on the AMD machine (2026-12-06): lm-evaluation-harness
through radixserve's ``/v1/completions`` and through transformers on the same tasks
(``eval_harness.py``); summary_tables.TABLES lists it with the others.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from results_data import load
from summary_tables_s22 import _head, _row

EVAL_HARNESS = "eval_harness_s45.json"


ROUTES = (
    ("tasks", "`local-completions`, `/v1/completions`"),
    ("tasks_sglang_generate", "`sglang-generate`, `/generate`"),
)


def table_eval_harness(name: str = EVAL_HARNESS) -> str:
    """Per lm-eval model (the route it calls) and task: documents, each metric from
    transformers and from radixserve, and request by request how far apart they are
    (log-likelihoods, is_greedy, the choice each makes, the answer each generates)."""
    out = _head(
        "lm-eval model, route",
        "task",
        "documents",
        "metric: transformers / radixserve",
        "requests",
        "log-likelihood difference, largest (median)",
        "same is_greedy",
        "same choice / answer",
        align="llrlrlrr",
    )
    d = load(name)
    for key, route in ROUTES:
        out += [_task_row(route, task, row) for task, row in d[key].items()]
    return "\n".join(out)


def _task_row(route: str, task: str, row: dict[str, Any]) -> str:
    """One task's row: a multiple-choice task's scored requests, a generation task's answers."""
    metrics = ", ".join(f"{m} {v['hf']:.2f} / {v['served']:.2f}" for m, v in row["metrics"].items())
    docs = row["docs"]
    if "requests" in row:
        diff = f"{row['loglik_abs_diff_max']:.1e} ({row['loglik_abs_diff_median']:.1e})"
        cells = (row["requests"], diff, f"{row['is_greedy_same']} of {row['requests']}")
        same = f"{row['choice_same']} of {docs}"
    else:
        cells = (docs, "(generated)", "")
        same = f"{row['answers_same']} of {docs}"
    return _row(route, f"`{task}`", docs, metrics, *cells, same)


TABLES: dict[str, Callable[[], str]] = {"eval_harness_s45": table_eval_harness}
