"""The generated table of session 40's measurement on the AMD machine (2026-12-06): a bf16
decode row's attention per layer with each of its parts taken out in turn
(``bench_decode_attention.py --ablate``), beside the kernel whole and a bare cold read of the
same pages; summary_tables.TABLES lists it with the others.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from results_data import load
from summary_tables_s22 import _head, _row

# bench_decode_attention.py --ablate ... --read-floor --pages ascending --dtypes bfloat16
DECODE_ABLATION = "bench_decode_attention_s40.json"


def part_cost(samples: dict[str, list[float]], part: str, kind: str) -> float:
    """What ``part`` costs a call (``kind``: cold or hot), in us: the median over the
    repetitions of the whole kernel's time less the kernel's without that part (the two were
    timed alternately, call for call)."""
    pairs = zip(samples[f"current {kind}"], samples[f"without {part} {kind}"], strict=True)
    return statistics.median(a - b for a, b in pairs)


def table_decode_ablation(name: str = DECODE_ABLATION) -> str:
    """Per context and part taken out: the whole kernel's time per layer from memory (cold) and
    from the caches (hot), a bare cold read of its pages, the kernel's time without the part,
    and the part's cost (``part_cost``) with its share of the whole kernel's time."""
    out = _head(
        "context",
        "kernel cold / hot, us",
        "pages read cold, us",
        "taken out",
        "cold / hot without it, us",
        "its cost cold, us (share)",
        "its cost hot, us (share)",
        align="rrrlrrr",
    )
    d = load(name)
    for r in d["results"]:
        us, s = r["us_per_layer"], r["samples_us"]
        whole = f"{us['current cold']:.0f} / {us['current hot']:.0f}"
        for part in d["ablations"]:
            cold, hot = part_cost(s, part, "cold"), part_cost(s, part, "hot")
            out.append(
                _row(
                    r["context"],
                    whole,
                    f"{us['read cold']:.0f}",
                    part,
                    f"{us[f'without {part} cold']:.0f} / {us[f'without {part} hot']:.0f}",
                    f"{cold:.0f} ({cold / us['current cold']:.0%})",
                    f"{hot:.0f} ({hot / us['current hot']:.0%})",
                )
            )
    return "\n".join(out)


TABLES: dict[str, Callable[[], str]] = {"decode_ablation_s40": table_decode_ablation}
