"""Parts of a decode row's CPU attention taken out, one at a time, for
``bench_decode_attention.py --ablate``: where the time of a bf16 decode row goes, on a
machine whose performance counters a VM does not expose (no ``perf stat``, and a sampling
profile of the kernel's one inlined function says little about which part its instructions
serve).

Each ablation is the current kernel source with exact text edits that skip one part of a
narrow block (``paged_attention_narrow.h``: a decode token's query rows of one KV head over
64 keys, the path every full block of a bf16 decode row takes). The ablated kernel's outputs
are wrong by construction; only its time means something: the current kernel's time less
the ablated one's, timed alternately in one process, is what that part costs. A part's cost
from the caches (``hot``) and from memory (``cold``) differ where the arithmetic hides under
the reads.

An edit that no longer matches the source raises (:func:`ablated_sources`), so a kernel
change cannot leave an ablation silently timing something else;
tests/benchmarks/test_bench_decode_attention.py applies every one to the sources as they
are.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Edit:
    """Replace ``old``, which must occur exactly once in the source file ``file``, by ``new``."""

    file: str
    old: str
    new: str


@dataclass(frozen=True)
class Ablation:
    """What is taken out (``what``) and the edits that take it out."""

    what: str
    edits: tuple[Edit, ...]


NARROW = "paged_attention_narrow.h"
KERNEL = "paged_attention.cpp"

_TRANSPOSE = "      for (int b = 0; b < GB; ++b) transpose16x8(words[b], c, w[b]);\n"
_SCORES = "    narrow_scores_in_registers<NC, R>(krow, qw, scale, sc, ahead);\n"
_NO_SCORES = (
    "    for (int64_t t = 0; t < kBlock; ++t) ahead(t);\n"
    "    for (int r = 0; r < R; ++r) for (int g = 0; g < G; ++g) sc[r][g] = splat(scale * (g + r));\n"
)
_SOFTMAX = "  const vf alpha = narrow_softmax<R>(sc, vm, vl, ps);\n"
_VALUES = (
    "    narrow_value_pairs<NC, R>(acc, alpha, ps, scratch, [&](int64_t j, __m512i (&v)[NC]) {"
)
_AHEAD = (
    "        auto ahead = [&](int64_t t) {\n"
    "          if (sc.streaming) sc.stream.step();\n"
    "          else if (t < next_n) prefetch_row(L, next[t]);\n"
    "        };\n"
    "        float* acc0"
)

ABLATIONS: dict[str, Ablation] = {
    "key-transpose": Ablation(
        "the transposition of the keys' pairs of dimensions in registers: each group's 32-bit "
        "words loaded as they lie in the page (what a page layout holding each page's keys "
        "transposed would save at most; half the keys' lines are read, the rest prefetched)",
        (
            Edit(
                NARROW,
                _TRANSPOSE,
                "      for (int b = 0; b < GB; ++b) for (int j = 0; j < 8; ++j) "
                "w[b][j] = _mm512_loadu_ps(words[b][2 * j] + (c & 15));\n",
            ),
        ),
    ),
    "scores": Ablation(
        "the scores: no key is read (only prefetched) and every score is a constant",
        (Edit(NARROW, _SCORES, _NO_SCORES),),
    ),
    "values": Ablation(
        "the products of the probabilities and the values (no value is read, only prefetched)",
        (Edit(NARROW, _VALUES, "    if (alpha[0] < -1.0f) " + _VALUES.lstrip()),),
    ),
    "arithmetic": Ablation(
        "the scores, the softmax and the values' products: what is left is the blocks' "
        "bookkeeping (the keys' offsets, the loops, the prefetch stream) and the call's own",
        (
            Edit(NARROW, _SCORES, _NO_SCORES),
            Edit(
                NARROW,
                _SOFTMAX,
                "  const vf alpha = splat(1.0f);\n  vm = vm + sc[0][0];\n"
                "  if (alpha[0] > 0.0f) return;\n",
            ),
        ),
    ),
    "prefetch": Ablation(
        "the prefetches a narrow block issues for what comes next (the stream of the "
        "thread's next chunk, or the next block's rows): the pages come as the loads ask",
        (Edit(KERNEL, _AHEAD, "        auto ahead = [&](int64_t) {};\n        float* acc0"),),
    ),
}


def ablated_sources(name: str, csrc: Path) -> dict[str, str]:
    """The files of ``csrc`` that ablation ``name`` edits, edited: file name to text."""
    out: dict[str, str] = {}
    for edit in ABLATIONS[name].edits:
        text = out.get(edit.file) or (csrc / edit.file).read_text()
        if text.count(edit.old) != 1:
            raise ValueError(
                f"ablation {name!r}: its edit of {edit.file} matches {text.count(edit.old)} "
                "times, not once (the kernel changed: update benchmarks/decode_ablations.py)"
            )
        out[edit.file] = text.replace(edit.old, edit.new)
    return out
