"""The factory the scheduler builds its drafter with."""

from __future__ import annotations

from radixserve.speculative.drafter import ALGORITHMS, Drafter
from radixserve.speculative.ngram import NgramDrafter
from radixserve.speculative.suffix_index import RadixDrafter

__all__ = ["make_drafter"]


def make_drafter(algorithm: str) -> Drafter:
    """The drafter of ``--speculative-algorithm`` (one of :data:`ALGORITHMS`)."""
    if algorithm == "ngram":
        return NgramDrafter()
    if algorithm == "radix":
        return RadixDrafter()
    if algorithm == "draft":  # a model to load: the engine builds it (engine.draft_setup)
        raise ValueError(
            "speculative algorithm 'draft' needs its drafter built with the draft model"
        )
    raise ValueError(f"unknown speculative algorithm {algorithm!r}; expected one of {ALGORITHMS}")
