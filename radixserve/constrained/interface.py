"""What the scheduler and the sampler need of a request's grammar, whichever object keeps it:
a :class:`~radixserve.constrained.matcher.GrammarMatcher`, or a
:class:`~radixserve.constrained.thinking_budget.ThinkingBudget` around one (or around none)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


class TokenGrammar(Protocol):
    """A request's position in what its output must follow, advanced token by token."""

    @property
    def failure(self) -> str | None:
        """Why :meth:`accept` refused a token the grammar allows (too costly to follow)."""
        ...

    @property
    def can_only_end(self) -> bool:
        """Nothing but a stop token may follow: the request finishes without a step more."""
        ...

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False when it may not follow (or :attr:`failure`)."""
        ...

    def lookahead(self, draft: Sequence[int]) -> int:
        """How many leading tokens of a speculative draft may follow, masks kept for them."""
        ...

    def mask_at(self, j: int) -> torch.Tensor:
        """The allowed-token bitmask of the row ``j`` tokens into the last lookahead."""
        ...
