"""``logit_bias``: per-token additive biases on a request's logits, with OpenAI's semantics.

A map of token id to a bias in ``[-100, 100]``, at most 300 entries (OpenAI's limits). The
bias is added to the logits before anything else the draw does (temperature, top-k/p),
after the penalties and before the grammar mask, so ``-100`` all but bans a token and
``+100`` all but forces it, while a constrained request still only writes what its grammar
allows. JSON bodies spell token ids as strings (``{"50256": -100}``); on the wire and in
:class:`~radixserve.sampling_params.SamplingParams` they are integers.

Torch-free, like :mod:`radixserve.sampling_params`, so clients and gateways import it light.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

#: OpenAI's limits: at most this many entries, each bias within +-BIAS_LIMIT.
MAX_ENTRIES = 300
BIAS_LIMIT = 100.0


def from_json(value: Any) -> dict[int, float] | None:
    """A ``logit_bias`` as a JSON body sends it (keys: token id strings, or ints from
    Python callers) -> ``{token_id: bias}``; ``ValueError`` naming the bad entry."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(
            f"logit_bias must be a map of token id to bias, not {type(value).__name__}"
        )
    if len(value) > MAX_ENTRIES:
        raise ValueError(f"logit_bias has {len(value)} entries, more than {MAX_ENTRIES}")
    out: dict[int, float] = {}
    for key, bias in value.items():
        if isinstance(key, bool) or not isinstance(key, (int, str)):
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        if isinstance(key, str) and not (key.isascii() and key.isdigit() and len(key) <= 10):
            raise ValueError(f"logit_bias keys must be token ids (decimal strings), got {key!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise ValueError(f"logit_bias[{key!r}] must be a number, got {bias!r}")
        out[int(key)] = float(bias)
    return out


def errors(bias: Mapping[int, float] | None, vocab_size: int | None, id_limit: int) -> list[str]:
    """What is wrong with a parsed ``logit_bias`` (empty: nothing)."""
    if not bias:
        return []
    out: list[str] = []
    if len(bias) > MAX_ENTRIES:
        out.append(f"logit_bias has {len(bias)} entries, more than {MAX_ENTRIES}")
    limit = id_limit if vocab_size is None else vocab_size
    bad_ids = [t for t in bias if not 0 <= t < limit]
    if bad_ids:
        where = "in [0, 2**31)" if vocab_size is None else f"in the vocabulary (size {vocab_size})"
        out.append(f"logit_bias keys must be token ids {where}, got {bad_ids[:8]}")
    bad = [t for t, b in bias.items() if not (math.isfinite(b) and -BIAS_LIMIT <= b <= BIAS_LIMIT)]
    if bad:
        out.append(
            f"logit_bias values must be in [-{BIAS_LIMIT:g}, {BIAS_LIMIT:g}], "
            f"got {[bias[t] for t in bad[:8]]}"
        )
    return out
