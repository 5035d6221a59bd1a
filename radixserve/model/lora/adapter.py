"""One LoRA adapter, read from PEFT's saved directory and checked against the served model.

PEFT saves ``adapter_config.json`` (rank ``r``, ``lora_alpha``, the options below) and
``adapter_model.safetensors`` with two matrices per adapted layer:
``base_model.model.<layer>.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight`` ``[out, r]``.
The layer's output gains ``(x A^T) B^T * scaling``, ``scaling = alpha / r`` (``alpha /
sqrt(r)`` with ``use_rslora``). radixserve fuses q/k/v and gate/up into one linear each, so
an adapted q_proj becomes a delta on the q columns of the fused ``qkv_proj`` output.

Only the attention and MLP projections can be adapted. Everything PEFT could save beyond
them (DoRA's magnitudes, LoRA biases, trained embeddings or heads, ``modules_to_save``) is
refused by name rather than silently dropped: the adapter would compute something else.
Pickled ``adapter_model.bin`` files are refused too (loading one runs its code).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from safetensors import safe_open
from torch import nn

from radixserve.model import cpu_gemv
from radixserve.model.lora.tp import RankCut, rank_cut

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# The projections an adapter may target: Hugging Face's names, and the fused ones of
# checkpoints that store them fused (Phi-3).
TARGETS = frozenset(
    ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
) | frozenset(("qkv_proj", "gate_up_proj"))
# adapter_config.json options that change what the weights compute; any value but their
# default is refused (PEFT's defaults: false, null, {} or []).
UNSUPPORTED_OPTIONS = (
    "use_dora",
    "lora_bias",
    "fan_in_fan_out",
    "modules_to_save",
    "trainable_token_indices",
    "target_parameters",
    "layer_replication",
    "use_qalora",
    "use_bdlora",
    "alora_invocation_tokens",
    "rank_pattern",
)
# adapter_config.json is read whole: a path naming some other file is refused by its size.
# (The weights' names and shapes are checked before any tensor is read.)
MAX_CONFIG_BYTES = 1 << 20


@dataclass(frozen=True)
class LoraDelta:
    """An adapted layer's update: columns ``lo:hi`` of its output gain ``(x a^T) b^T``.

    A fused layer's adapted shards are one delta (two matmuls, not two per shard): ``a``
    stacks their A matrices, ``b`` holds each shard's B, times its scaling, in its own
    rows and rank columns (zero elsewhere; a shard not adapted keeps zero rows)."""

    lo: int
    hi: int
    a: torch.Tensor  # [R, in], R: the shards' ranks together
    b: torch.Tensor  # [hi - lo, R]

    def apply(self, x: torch.Tensor, out: torch.Tensor, rows: torch.Tensor | None) -> None:
        """Add the delta of ``x`` (the rows ``rows`` of ``out``'s, or all of them) in place.

        On a CPU with the GEMV kernel both products run it at any row count: the matrices
        are small enough to stay in the caches, so row by row costs nothing, and each row's
        delta is then the same bits however many rows the step holds (speculative
        decoding's verify rows rely on that); oneDNN's GEMM is far slower on such small
        products at one row."""
        if x.dtype == self.a.dtype and _gemv(x):
            x = x.contiguous()
            delta = cpu_gemv.linear(cpu_gemv.linear(x, self.a), self.b)
        else:
            delta = nn.functional.linear(nn.functional.linear(x, self.a), self.b)
        cols = out[:, self.lo : self.hi]
        if rows is None:
            cols.add_(delta)
        else:
            cols.index_add_(0, rows, delta)


def _gemv(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and cpu_gemv.available()


@dataclass(frozen=True)
class _Shard:
    """One adapted projection as PEFT saved it: its columns of the layer's output."""

    lo: int
    hi: int
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [hi - lo, r]
    scaling: float


def _fuse(shards: list[_Shard], dtype: torch.dtype, device: torch.device) -> LoraDelta:
    """One layer's shards as one :class:`LoraDelta` (the scalings folded into B, in float32
    before the model's dtype rounds them)."""
    lo, hi = min(s.lo for s in shards), max(s.hi for s in shards)
    ranks = [s.a.shape[0] for s in shards]
    b = torch.zeros(hi - lo, sum(ranks), dtype=torch.float32)
    col = 0
    for s, r in zip(shards, ranks):
        b[s.lo - lo : s.hi - lo, col : col + r] = s.b.float() * s.scaling
        col += r
    a = torch.cat([s.a.float() for s in shards])
    return LoraDelta(lo, hi, _place(a, dtype, device), _place(b, dtype, device))


@dataclass(frozen=True)
class LoraAdapter:
    """An adapter ready to serve: its deltas per adapted module of the served model (the
    module's name in radixserve's model, e.g. ``model.layers.3.self_attn.qkv_proj``), and
    a digest of its files."""

    name: str
    path: str
    rank: int
    deltas: dict[str, LoraDelta]
    digest: str

    @property
    def cache_key(self) -> str:
        """What its requests' cache namespace is split by: its name and its files' digest.
        KV cached under an adapter's name by other weights (another worker's adapter of
        that name, sharing a Mooncake store; a disk tier written before a restart with
        new weights) never answers this adapter's requests."""
        return f"{self.name}@{self.digest}"


def read_adapter(name: str, path: str | Path, model: nn.Module, max_rank: int) -> LoraAdapter:
    """Read PEFT's saved adapter at ``path`` for ``model`` (its weights' dtype and device).
    ``ValueError`` names what does not fit: an option radixserve does not compute, a layer
    the model lacks, a shape that differs, a rank above ``max_rank``."""
    root = Path(path)
    config = _read_config(root)
    tensors = _read_tensors(root, model)
    alpha, rslora = float(config["lora_alpha"]), bool(config.get("use_rslora"))
    alphas: dict[str, Any] = config.get("alpha_pattern") or {}
    dtype, device = _weights_dtype_device(model)
    shards: dict[str, list[_Shard]] = {}
    ranks: set[int] = set()
    for layer, ((module_name, lo, hi), a, b) in tensors.items():
        r = a.shape[0]
        if not 0 < r <= max_rank:
            raise ValueError(f"LoRA adapter {name!r}: rank {r} of {layer} is above {max_rank}")
        ranks.add(r)
        alpha_i = float(_pattern_value(alphas, layer, alpha))
        scaling = alpha_i / math.sqrt(r) if rslora else alpha_i / r
        shards.setdefault(module_name, []).append(_Shard(lo, hi, a, b, scaling))
    if not shards:
        raise ValueError(f"LoRA adapter {name!r} at {root} adapts no layer")
    deltas = {m: _fuse(sorted(s, key=lambda d: d.lo), dtype, device) for m, s in shards.items()}
    return LoraAdapter(name, str(root), max(ranks), deltas, _digest(root))


def _digest(root: Path) -> str:
    """The first 16 hex digits of the SHA-256 of the adapter's config and weights files."""
    h = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        with (root / name).open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def _read_config(root: Path) -> dict[str, Any]:
    cfg_path = root / CONFIG_FILE
    if not cfg_path.is_file():
        raise ValueError(f"no LoRA adapter at {root}: {CONFIG_FILE} is missing")
    if cfg_path.stat().st_size > MAX_CONFIG_BYTES:
        raise ValueError(f"{cfg_path} is larger than {MAX_CONFIG_BYTES} bytes")
    config = json.loads(cfg_path.read_text())
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{cfg_path} is not a LoRA adapter's config (peft_type LORA)")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{cfg_path}: trained biases (bias={config['bias']!r}) are not supported")
    unsupported = [k for k in UNSUPPORTED_OPTIONS if config.get(k)]
    if unsupported:
        raise ValueError(f"{cfg_path}: not supported: {', '.join(unsupported)}")
    if "lora_alpha" not in config:
        raise ValueError(f"{cfg_path} has no lora_alpha")
    return config


def _read_tensors(
    root: Path, model: nn.Module
) -> dict[str, tuple[tuple[str, int, int], torch.Tensor, torch.Tensor]]:
    """``{layer name: (its target in model, A, B)}`` (:func:`_target`), each pair's names
    and shapes checked against ``model`` before any tensor is read (a path naming some
    other checkpoint reads nothing)."""
    weights = root / WEIGHTS_FILE
    if not weights.is_file():
        pickled = " (a pickled adapter_model.bin is not read: loading one runs code)"
        bin_there = (root / "adapter_model.bin").is_file()
        raise ValueError(f"no {WEIGHTS_FILE} at {root}{pickled if bin_there else ''}")
    with safe_open(str(weights), framework="pt") as f:
        pairs = _pairs(list(f.keys()))
        targets = {
            layer: _checked_target(
                model, layer, f.get_slice(a).get_shape(), f.get_slice(b).get_shape()
            )
            for layer, (a, b) in pairs.items()
        }
        return {
            layer: (targets[layer], *_rank_pair(f, rank_cut(model, layer), a, b))
            for layer, (a, b) in pairs.items()
        }


def _rank_pair(f: Any, cut: RankCut | None, a: str, b: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A and B as this rank serves them (:mod:`.tp`): of a tensor-parallel rank, only its
    part of the one it cuts is read."""
    if cut is None:
        return f.get_tensor(a), f.get_tensor(b)
    if cut.dim == 0:
        return f.get_tensor(a), cut.take(f.get_slice(b))
    return cut.take(f.get_slice(a)), f.get_tensor(b)


def _pairs(keys: list[str]) -> dict[str, tuple[str, str]]:
    """``{layer name: (A's key, B's key)}`` from PEFT's tensor names; anything else is
    refused."""
    a_of: dict[str, str] = {}
    b_of: dict[str, str] = {}
    for key in keys:
        name = key.removeprefix(PEFT_PREFIX)
        for suffix, into in ((".lora_A.weight", a_of), (".lora_B.weight", b_of)):
            if name.endswith(suffix):
                into[name.removesuffix(suffix)] = key
                break
        else:
            raise ValueError(f"unsupported tensor {key!r} in the adapter (not a LoRA A or B)")
    if a_of.keys() != b_of.keys():
        odd = sorted(a_of.keys() ^ b_of.keys())
        raise ValueError(f"LoRA A and B matrices do not pair up for {odd[:3]}")
    return {k: (a_of[k], b_of[k]) for k in sorted(a_of)}


def _checked_target(
    model: nn.Module, layer: str, a: list[int], b: list[int]
) -> tuple[str, int, int]:
    """``layer``'s target in ``model`` (:func:`_target`), its A ``[r, in]`` and B ``[out,
    r]`` shapes checked against it."""
    target = module_name, lo, hi = _target(model, layer)
    in_features = cast("nn.Linear", model.get_submodule(module_name)).in_features
    r = a[0] if a else 0
    need_in, need_out = _whole_widths(model, layer, in_features, hi - lo)
    if list(a) != [r, need_in] or list(b) != [need_out, r]:
        raise ValueError(
            f"{layer}'s LoRA matrices are {list(a)} and {list(b)}; this model's layer needs "
            f"[r, {need_in}] and [{need_out}, r]"
        )
    return target


def _whole_widths(model: nn.Module, layer: str, in_local: int, out_local: int) -> tuple[int, int]:
    """The input and output widths of the whole ``layer`` (every rank's, under tensor
    parallelism: the saved matrices are the whole model's) from this rank's local ones."""
    cut = rank_cut(model, layer)
    if cut is None:
        return in_local, out_local
    if cut.width != (out_local if cut.dim == 0 else in_local):  # the shard rules disagree
        raise ValueError(f"{layer}: this rank's share of it is not its local layer's")
    return (in_local, cut.total) if cut.dim == 0 else (cut.total, out_local)


def _target(model: nn.Module, layer: str) -> tuple[str, int, int]:
    """The served model's module an adapted layer lands in, and its output columns."""
    if layer.rsplit(".", 1)[-1] not in TARGETS:
        raise ValueError(
            f"the adapter adapts {layer}; only the attention and MLP projections "
            f"({', '.join(sorted(TARGETS))}) can be"
        )
    if ".experts." in layer:  # the expert kernels read their weights, not a module's forward
        raise ValueError(f"the adapter adapts {layer}: LoRA on experts is not supported")
    output_slice = getattr(model, "output_slice", None)
    if output_slice is None:
        raise ValueError(f"{type(model).__name__} cannot serve LoRA adapters")
    try:
        return output_slice(layer)
    except AttributeError:
        raise ValueError(f"the adapter adapts {layer}, which this model does not have") from None


def _pattern_value(patterns: dict[str, Any], layer: str, default: float) -> float:
    """PEFT's per-layer override (``alpha_pattern``): a key equal to the layer's name or to
    its last components."""
    for key, value in patterns.items():
        if layer == key or layer.endswith("." + key):
            return float(value)
    return default


def _weights_dtype_device(model: nn.Module) -> tuple[torch.dtype, torch.device]:
    dtype = getattr(model, "dtype", None)
    device = getattr(model, "device", None)
    if not isinstance(dtype, torch.dtype) or not isinstance(device, torch.device):
        p = next(model.parameters())
        return p.dtype, p.device
    return dtype, device


def _place(t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if not t.is_floating_point():
        raise ValueError(f"LoRA matrices must be floating point, got {t.dtype}")
    return t.to(device=device, dtype=dtype).contiguous()
