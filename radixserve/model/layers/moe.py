"""The mixture-of-experts MLP block (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE): a router picks
``top_k`` of ``num_experts`` SiLU-gated MLPs for each row; the row's output is their weighted
sum, plus, where the family has one (``MoEConfig.shared_expert_size``: Qwen2-MoE), a shared
expert that every row runs, scaled per row by ``sigmoid(x @ shared_expert_gate)`` where the
family gates it (Qwen2-MoE; DeepSeek's shared experts are ungated).

Routing, as transformers computes it for all three families: ``softmax`` (float32) over the
router's logits, the ``top_k`` largest probabilities, renormalised to sum to one when the
family says so (``MoEConfig.norm_topk_prob``: Mixtral always, Qwen3-MoE and OLMoE per config).
gpt-oss takes the softmax over the top-k logits (after the router's bias): the same choice
and, renormalised, the same weights, so it routes here with ``norm_topk_prob``; its experts
are biased and clamp their SwiGLU (``GatedMLP``'s "swiglu_clamped"), which every path below
runs through the experts' own ``GatedMLP`` (the Triton kernel, SiLU only, is left to others).

The grouped path (every forward outside CUDA-graph capture)::

    rows x [T, H] --route--> (expert, weight) for each of T*k slots
    slots sorted by expert id (stable):  | e0 e0 e0 | e2 | e3 e3 | ...   (e1 got no row)
    x.index_select(0, row of each sorted slot) -> one contiguous run of rows per expert
    each expert that got rows: one gate_up and one down matmul over its run
        (its weights are read once for the step, however many rows it got; experts that got
        no row are skipped)
    runs scaled by their routing weights, then index_add_ back into their rows -> [T, H]

The per-expert matmuls are the expert's own linears (``GatedMLP``), so the weight
quantization (``model/quant``: int8/int4 linears) and the CPU's packed oneDNN linears apply to
experts as to any dense MLP. Which experts got rows is read on the host (one small
``bincount`` read per block).

On CUDA (``gpu_ops.enabled``) float experts run the fused Triton kernel
(:mod:`radixkernels.moe`): the same grouping done on the device, one grouped GEMM per
projection, no host read (CUDA graphs capture it). Quantized experts on CUDA take the grouped
path, and under CUDA-graph capture, where no host read is allowed, every expert runs over
every row with the weights of the rows not routed to it zero.

Under tensor parallelism (``tp``) every expert is cut on its MLP width as a dense MLP is
(``moe.intermediate_size`` is the rank's share), the router is whole on every rank (each
computes the same routing), and the block's partial output is summed by one all-reduce: the
same paths above run unchanged on each rank, and every rank does the same work whatever the
routing (docs/parallelism.md says why this is the default).

The shared expert is a ``GatedMLP`` of its own beside the routed ones (quantized and packed
like them; its gate, like the router, a parameter that stays in full precision), computed
on every path above and added after the routed sum, as transformers adds it. Under tensor
parallelism, and under expert parallelism too, it is cut on its MLP width like a dense MLP
(the gate whole on every rank): the per-row gate scales each rank's partial output, so the
block's one all-reduce sums it with the routed experts'.

Under expert parallelism (``moe.expert_range``, ``--expert-parallel``) each rank holds
``num_experts / N`` whole experts ``[lo, hi)`` (its modules ``experts.0 ..``), routes every
row with the whole router, and computes only the (row, expert) slots routed to its own
experts: in the grouped path those are one contiguous run of the expert-sorted slots, and a
rank whose experts got no row adds zeros. The same one all-reduce then sums each row's
experts across the ranks (vLLM's and SGLang's expert parallelism over the TP group).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.model import gpu_ops
from radixserve.model.families.moe import MoEConfig
from radixserve.model.layers.mlp import GatedMLP
from radixserve.model.parallel import TPGroup


class TopKRouter(nn.Module):
    """The router: a ``[num_experts, hidden]`` projection (a parameter, not an ``nn.Linear``,
    so weight quantization leaves it in full precision as vLLM and SGLang do), with a bias on
    its logits where the family has one (gpt-oss, ``MoEConfig.router_bias``)."""

    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(moe.num_experts)) if moe.router_bias else None
        self.top_k = moe.top_k
        self.norm_topk_prob = moe.norm_topk_prob
        self.moe = moe
        # Sigmoid routing's correction bias (checkpoint ``e_score_correction_bias``, float32).
        self.e_score_correction_bias = (
            nn.Parameter(torch.empty(moe.num_experts), requires_grad=False)
            if moe.scoring == "sigmoid"
            else None
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, k] in x's dtype, expert ids [T, k] int64)`` for each row of ``x``."""
        logits = F.linear(x, self.weight, self.bias)
        if self.e_score_correction_bias is not None:
            return self._sigmoid_route(logits.float(), x.dtype)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(x.dtype), ids

    def _sigmoid_route(
        self, logits: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek-V3's and GLM-4.5's routing (:class:`MoEConfig` ``scoring`` "sigmoid")."""
        assert self.e_score_correction_bias is not None
        moe = self.moe
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        if moe.n_group > 1:
            t = choice.shape[0]
            grouped = choice.view(t, moe.n_group, -1)
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
            keep = torch.topk(group_scores, moe.topk_group, dim=-1, sorted=False)[1]
            mask = torch.zeros_like(group_scores).scatter_(1, keep, 1.0)
            choice = choice.masked_fill(~mask.bool().repeat_interleave(grouped.shape[-1], 1), 0.0)
        ids = torch.topk(choice, self.top_k, dim=-1, sorted=False)[1]
        top = scores.gather(1, ids)
        if self.norm_topk_prob:
            top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
        return (top * moe.routed_scaling_factor).to(dtype), ids


class SharedExpertGate(nn.Module):
    """The shared expert's per-row gate: ``sigmoid(x @ weight.T)``, ``weight`` ``[1, hidden]``
    (checkpoint name ``shared_expert_gate.weight``; a parameter, not an ``nn.Linear``, so
    weight quantization leaves it in full precision, as the router)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, 1]`` in ``x``'s dtype."""
        return torch.sigmoid(F.linear(x, self.weight))


class SparseMoeBlock(nn.Module):
    """Router and experts of one layer, called like :class:`GatedMLP` (``[T, H] -> [T, H]``).

    The parameter names are the checkpoints' (``gate.weight``, ``experts.{e}.*``,
    ``shared_expert.*``, ``shared_expert_gate.weight``), with each expert's gate and up fused
    into ``gate_up_proj`` as the dense MLP's are. Under tensor parallelism
    ``moe.shared_expert_size`` is the rank's share of the shared expert's width.
    """

    def __init__(
        self, hidden_size: int, moe: MoEConfig, bias: bool, tp: TPGroup | None = None
    ) -> None:
        super().__init__()
        self.tp = tp
        self.num_experts = moe.num_experts
        self.top_k = moe.top_k
        self.gate = TopKRouter(hidden_size, moe)
        # The experts held here (all, or this rank's [lo, hi) under expert parallelism):
        # module ``experts.{e - lo}`` is global expert e.
        self.first_expert, last = moe.held_experts
        # gpt-oss's experts: biased, their own activation (MoEConfig.act).
        swiglu = (moe.swiglu_alpha, moe.swiglu_limit)
        self.experts = nn.ModuleList(
            GatedMLP(
                hidden_size,
                moe.intermediate_size,
                bias or moe.expert_bias,
                act=moe.act,
                swiglu=swiglu,
            )
            for _ in range(last - self.first_expert)
        )
        # The shared expert (no all-reduce of its own: the block's sums it with the experts').
        self.shared_expert = (
            GatedMLP(hidden_size, moe.shared_expert_size, bias) if moe.shared_expert_size else None
        )
        self.shared_expert_gate = (
            SharedExpertGate(hidden_size)
            if self.shared_expert is not None and moe.shared_expert_gate
            else None
        )
        # The Triton kernel's stacked weights (CUDA), made at the first forward that uses them.
        self._w13: torch.Tensor | None = None
        self._w2: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._forward(x)
        return out if self.tp is None else self.tp.all_reduce(out)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._add_shared(x, self._routed(x))

    def _add_shared(self, x: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        """``routed`` plus the shared expert's (gated) output, where there is a shared expert;
        added after the routed sum, as transformers adds it."""
        if self.shared_expert is None:
            return routed
        shared = self.shared_expert.forward(x)
        if self.shared_expert_gate is not None:
            shared = self.shared_expert_gate.forward(x) * shared
        return routed.add_(shared)

    def _routed(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum (this rank's part of it under parallelism)."""
        weights, ids = self.gate.forward(x)
        if gpu_ops.enabled(x) and self._plain_experts():
            from radixkernels.moe import fused_moe

            first = self.first_expert if len(self.experts) < self.num_experts else None
            return fused_moe(x, *self._stacked_weights(), weights, ids, first_expert=first)
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return self._forward_every_expert(x, weights, ids)
        return self._forward_grouped(x, weights, ids)

    def _plain_experts(self) -> bool:
        """Whether every expert's projections are bias-free float linears with SiLU between
        them (what the Triton kernel reads; quantized experts and gpt-oss's biased, clamped
        ones take the grouped torch path)."""
        return all(
            mlp.act == "silu"
            and all(
                type(proj) is nn.Linear and proj.bias is None
                for proj in (mlp.gate_up_proj, mlp.down_proj)
            )
            for mlp in cast("list[GatedMLP]", list(self.experts))
        )

    def _stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts' weights as ``w13 [E, 2I, H]`` and ``w2 [E, H, I]`` for the Triton
        kernel, stacked once (at the first forward, during warm-up); each expert's linears are
        then views into them, so the weights are held once."""
        if self._w13 is None or self._w2 is None:
            experts = cast("list[GatedMLP]", list(self.experts))
            self._w13 = torch.stack([m.gate_up_proj.weight.detach() for m in experts])
            self._w2 = torch.stack([m.down_proj.weight.detach() for m in experts])
            for e, m in enumerate(experts):
                m.gate_up_proj.weight = nn.Parameter(self._w13[e], requires_grad=False)
                m.down_proj.weight = nn.Parameter(self._w2[e], requires_grad=False)
        return self._w13, self._w2

    def _forward_grouped(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """Rows grouped by expert; each expert held here that got rows runs once over its run
        (module docstring). Summation per row in ascending expert order, as transformers adds
        them. Under expert parallelism only the slots of this rank's experts, one contiguous
        run of the sorted slots, are gathered."""
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        experts = cast("list[GatedMLP]", list(self.experts))
        lo = self.first_expert
        start = sum(counts[:lo])
        mine = counts[lo : lo + len(experts)]
        if len(experts) < self.num_experts:
            order = order[start : start + sum(mine)]
        rows = torch.div(order, self.top_k, rounding_mode="floor")
        grouped = x.index_select(0, rows)
        out = torch.empty_like(grouped)
        start = 0
        for expert, n in enumerate(mine):
            if n:
                run = slice(start, start + n)
                out[run] = experts[expert].forward(grouped[run])
                start += n
        out.mul_(weights.flatten().index_select(0, order).unsqueeze(1))
        return torch.zeros_like(x).index_add_(0, rows, out)

    def _forward_every_expert(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        """No host read (CUDA-graph capture): every expert over every row, weighted by the
        row's routing weight for that expert (zero where the row was not routed to it)."""
        dense = torch.zeros(x.shape[0], self.num_experts, dtype=weights.dtype, device=x.device)
        dense.scatter_(1, ids, weights)
        out = torch.zeros_like(x)
        for expert, mlp in enumerate(cast("list[GatedMLP]", list(self.experts))):
            e = self.first_expert + expert
            out.add_(mlp.forward(x) * dense[:, e : e + 1])
        return out

    def expert_counts(self, x: torch.Tensor) -> torch.Tensor:
        """How many of ``x``'s rows each expert receives (``[num_experts]``; for tests and
        reports)."""
        _, ids = self.gate.forward(x)
        return torch.bincount(ids.flatten(), minlength=self.num_experts)


# Mixtral's checkpoint names -> the names radixserve's (and Qwen3-MoE's, OLMoE's) use.
_MIXTRAL_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def expert_checkpoint_names(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's expert tensors under per-expert names, whichever layout it was saved in:

    - per expert, as every released checkpoint is: ``mlp.experts.{e}.gate_proj.weight`` ...
      (passed through), or Mixtral's ``block_sparse_moe.experts.{e}.w1|w3|w2.weight`` (renamed);
    - stacked, as transformers 5 holds them in memory: ``mlp.experts.gate_up_proj``
      ``[E, 2I, H]`` (gate rows then up rows, radixserve's fused order) and
      ``mlp.experts.down_proj`` ``[E, H, I]`` (split into one view per expert).
    """
    for name, tensor in weights:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        parts = name.split(".")
        if len(parts) >= 3 and parts[-3].isdigit() and parts[-4:-3] == ["experts"]:
            parts[-2] = _MIXTRAL_EXPERT.get(parts[-2], parts[-2])
            yield ".".join(parts), tensor
            continue
        stem = name.removesuffix(".weight")
        if stem.endswith((".experts.gate_up_proj", ".experts.down_proj")) and tensor.dim() == 3:
            prefix, _, proj = stem.rpartition(".")
            for expert in range(tensor.shape[0]):
                yield f"{prefix}.{expert}.{proj}.weight", tensor[expert]
            continue
        yield name, tensor
