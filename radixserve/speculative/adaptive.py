"""How many tokens one request drafts: adapted from its own acceptance, down to none.

A verify row costs little next to reading the weights while a step is memory-bound, but not
nothing (more rows, the row-invariant linear path), and a draft that fails costs its rows
for no token. So each request keeps its own ``k``:

- all drafts accepted: ``k`` doubles (up to the configured ``k_max``);
- some rejected: ``k`` becomes what was accepted plus one (the next guess is as long as the
  last run that held, and one more);
- the running acceptance rate (an exponential average of accepted / drafted) under
  ``OFF_BELOW`` after at least ``MIN_VERIFIES`` verifications: no drafting for ``backoff``
  steps, which doubles each time (16 .. 1024), so a request whose text copies nothing stops
  paying for drafts but tries again now and then (its output may start quoting later).
"""

from __future__ import annotations

__all__ = ["AdaptiveK"]

OFF_BELOW = 0.2
MIN_VERIFIES = 4
FIRST_BACKOFF = 16
MAX_BACKOFF = 1024
EWMA = 0.5  # weight of the latest verification in the running rate


class AdaptiveK:
    """One request's draft length and acceptance record."""

    def __init__(self, k_max: int) -> None:
        self.k_max = k_max
        self.k = k_max
        self.rate = 1.0  # running accepted / drafted
        self.verifies = 0  # since drafting was last (re)started
        self.off_until = -1  # the step from which drafting resumes
        self.backoff = FIRST_BACKOFF

    def budget(self, step: int) -> int:
        """Tokens to draft at scheduler step ``step`` (0: not now)."""
        return 0 if step < self.off_until else self.k

    def update(self, drafted: int, accepted: int, step: int) -> None:
        """Record one verification of ``drafted`` tokens of which ``accepted`` stood."""
        if drafted <= 0:
            return
        self.verifies += 1
        self.rate = (1 - EWMA) * self.rate + EWMA * accepted / drafted
        if accepted == drafted:
            self.k = min(self.k_max, 2 * self.k)
        else:
            self.k = min(self.k_max, accepted + 1)
        if self.verifies >= MIN_VERIFIES and self.rate < OFF_BELOW:
            self.off_until = step + self.backoff
            self.backoff = min(MAX_BACKOFF, 2 * self.backoff)
            self.verifies, self.rate, self.k = 0, 1.0, 1  # a careful restart after the pause
