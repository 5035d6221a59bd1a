"""Batched sampling: one pass over a step's logits for every request in it.

Order of operations, per row (each stage runs only when some row in the batch uses it)::

    raw logits ──> log_softmax ──> chosen/top-k logprobs (reported from the model's distribution)
         │
         ├─ repetition penalty (prompt + output tokens, HF style: divide positive, multiply negative)
         ├─ frequency / presence penalties (output tokens, OpenAI style); the seen/count tables
         │  stay on the device between steps (sampling_ops.PenaltyCounts)
         ├─ min_tokens: EOS and stop ids masked until enough tokens are out
         ├─ grammar: tokens a constrained row's grammar forbids -> -inf (those rows only)
         ├─ greedy rows: argmax
         └─ other rows: / temperature -> top-k -> softmax -> min-p -> top-p -> inverse-CDF draw
                         (top-k is a selection, top-p a threshold bisection: no vocabulary sort)

The draw uses one uniform number per row; a request with a seed owns a
``torch.Generator`` so its samples do not depend on what else is in the batch.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol, Sequence

import torch

from radixserve.sampling_params import SamplingParams
from radixserve.scheduling.sampling_ops import PenaltyCounts, has_penalties, top_p_keep


class SamplingRow(Protocol):
    """What the sampler reads from a request (implemented by ``Request``)."""

    params: SamplingParams
    token_ids: list[int]  # prompt + output so far
    prompt_len: int
    generator: torch.Generator | None
    grammar: Any | None  # a radixserve.constrained.GrammarMatcher, or None


class SampleResult(NamedTuple):
    """Chosen tokens of one step, plus logprobs for the rows that asked for them."""

    token_ids: list[int]
    # Per row: (logprob, [(token_id, logprob), ...]) or None when the row did not ask.
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


class Sampler:
    """Samples the next token of each row of a ``[B, vocab]`` logits tensor."""

    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int] = (), device: str | torch.device = "cpu",
                 seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.device = torch.device(device)
        # Unseeded rows draw from this generator (the engine's seed makes runs reproducible).
        self._generator = torch.Generator(device="cpu")
        self._generator.manual_seed(seed)
        self.penalty_counts = PenaltyCounts(vocab_size, self.device)

    def new_generator(self, seed: int) -> torch.Generator:
        """A per-request generator for ``params.seed``."""
        g = torch.Generator(device="cpu")
        g.manual_seed(seed)
        return g

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SampleResult:
        """Pick one token per row of ``logits`` (``[len(rows), vocab]``, any float dtype)."""
        params = [r.params for r in rows]
        logits = logits.float()
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_logprobs = torch.log_softmax(logits[lp_rows], dim=-1) if lp_rows else None

        logits = self._apply_penalties(logits, rows)
        logits = self._apply_min_tokens(logits, rows)
        logits = self._apply_grammar(logits, rows)

        greedy = [p.greedy for p in params]
        if all(greedy):
            chosen = logits.argmax(dim=-1)
        else:
            chosen = self._draw(logits, rows, greedy)

        token_ids: list[int] = chosen.tolist()
        pen = [i for i, p in enumerate(params) if has_penalties(p)]
        if pen:  # count the sampled tokens on the device for the next step
            idx = torch.tensor(pen, dtype=torch.int64, device=chosen.device)
            self.penalty_counts.advance([rows[i] for i in pen], chosen.index_select(0, idx), [token_ids[i] for i in pen])
        logprobs: list[tuple[float, list[tuple[int, float]]] | None] = [None] * len(rows)
        if raw_logprobs is not None:
            idx = torch.tensor([token_ids[i] for i in lp_rows], dtype=torch.int64, device=raw_logprobs.device)
            chosen_lp = raw_logprobs.gather(1, idx[:, None]).squeeze(1).tolist()
            k_max = max(params[i].logprobs or 0 for i in lp_rows)
            if k_max > 0:
                top_v, top_i = raw_logprobs.topk(k_max, dim=-1)
                top_v_l, top_i_l = top_v.tolist(), top_i.tolist()
            for j, i in enumerate(lp_rows):
                k = params[i].logprobs or 0
                top = list(zip(top_i_l[j][:k], top_v_l[j][:k])) if k else []
                logprobs[i] = (chosen_lp[j], top)
        return SampleResult(token_ids, logprobs)

    def _apply_penalties(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        pen = [i for i, r in enumerate(rows) if has_penalties(r.params)]
        if not pen:
            return logits
        logits = logits.clone()
        dev = logits.device
        tables = self.penalty_counts.tables([rows[i] for i in pen])
        ps = [rows[i].params for i in pen]
        idx = torch.tensor(pen, dtype=torch.int64, device=dev)
        sub = logits.index_select(0, idx)
        rep = torch.tensor([p.repetition_penalty for p in ps], device=dev)[:, None]
        sub = torch.where(tables.seen, torch.where(sub > 0, sub / rep, sub * rep), sub)  # 1.0: unchanged
        f = torch.tensor([p.frequency_penalty for p in ps], device=dev)[:, None]
        pr = torch.tensor([p.presence_penalty for p in ps], device=dev)[:, None]
        sub = sub - (tables.counts * f + (tables.counts > 0).float() * pr)
        return logits.index_copy_(0, idx, sub)

    def _apply_min_tokens(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        blocked: list[tuple[int, int]] = []
        for i, r in enumerate(rows):
            p = r.params
            if p.min_tokens and len(r.token_ids) - r.prompt_len < p.min_tokens:
                ids = list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.eos_token_ids))
                blocked.extend((i, t) for t in ids if 0 <= t < self.vocab_size)
        if not blocked:
            return logits
        logits = logits.clone()
        r_idx, t_idx = zip(*blocked)
        logits[list(r_idx), list(t_idx)] = float("-inf")
        return logits

    def _apply_grammar(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        constrained = [i for i, r in enumerate(rows) if getattr(r, "grammar", None) is not None]
        if not constrained:
            return logits
        from radixserve.constrained.mask import apply_token_masks  # xgrammar loads only when used

        logits = logits.clone()  # the caller's logits stay the model's
        apply_token_masks(logits, constrained, [rows[i].grammar for i in constrained])
        # ignore_eos under a grammar: the end token only where the grammar allows nothing else.
        eos = [t for t in self.eos_token_ids if 0 <= t < self.vocab_size]
        for i in constrained:
            if rows[i].params.ignore_eos and eos:
                allowed = torch.isfinite(logits[i])
                if int(allowed.sum()) > int(allowed[eos].sum()):
                    logits[i, eos] = float("-inf")
        return logits

    def _draw(self, logits: torch.Tensor, rows: Sequence[SamplingRow], greedy: list[bool]) -> torch.Tensor:
        params = [r.params for r in rows]
        dev = logits.device
        temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=dev)
        scaled = logits / temps[:, None]
        top_k = [p.top_k if p.top_k > 0 else 0 for p in params]
        if any(top_k):
            k_max = min(max(top_k), self.vocab_size)
            kth_idx = torch.tensor([min(k, k_max) - 1 if k else k_max - 1 for k in top_k], device=dev)
            top_vals = scaled.topk(k_max, dim=-1).values
            kth = top_vals.gather(1, kth_idx[:, None])
            active = torch.tensor([k > 0 for k in top_k], device=dev)[:, None]
            scaled = scaled.masked_fill(active & (scaled < kth), float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        min_p = [p.min_p for p in params]
        if any(min_p):
            thresh = probs.max(dim=-1, keepdim=True).values * torch.tensor(min_p, device=dev)[:, None]
            probs = probs.masked_fill(probs < thresh, 0.0)
        top_p = [p.top_p for p in params]
        if any(tp < 1.0 for tp in top_p):
            nucleus = [i for i, tp in enumerate(top_p) if tp < 1.0]
            idx = torch.tensor(nucleus, dtype=torch.int64, device=dev)
            sub = probs.index_select(0, idx)
            keep = top_p_keep(sub, torch.tensor([top_p[i] for i in nucleus], device=dev))
            probs = probs.index_copy(0, idx, sub.masked_fill(~keep, 0.0))
        u = self._uniforms(rows).to(dev)
        cdf = probs.cumsum(dim=-1)
        target = (u * cdf[:, -1])[:, None]
        sampled = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=self.vocab_size - 1)
        if any(greedy):
            argmax = logits.argmax(dim=-1)
            sampled = torch.where(torch.tensor(greedy, device=dev), argmax, sampled)
        return sampled

    def _uniforms(self, rows: Sequence[SamplingRow]) -> torch.Tensor:
        u = torch.rand(len(rows), generator=self._generator)
        for i, r in enumerate(rows):
            if r.generator is not None:
                u[i] = torch.rand((), generator=r.generator)
        return u


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> list[float]:
    """``log_softmax(logits)[i, targets[i]]`` for every row (prompt logprobs)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    return lp.gather(1, targets.to(lp.device).view(-1, 1)).squeeze(1).tolist()
