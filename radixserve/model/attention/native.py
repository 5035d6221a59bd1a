"""The CPU paged-attention kernel (``csrc/paged_attention.cpp``): build, load, call.

The kernel is compiled on first use with ``torch.utils.cpp_extension`` (g++ and ninja; the
build is cached under ``TORCH_EXTENSIONS_DIR``, ~30 s the first time) for the machine it
runs on (``-march=native``, so the cache entry's name carries a digest of the CPU's flags:
a cache shared by different CPUs never hands one the other's instructions). Where it cannot
be built the torch path serves instead and :func:`load` says why once in the log;
``RADIXSERVE_NATIVE_ATTENTION=0`` turns it off.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "paged_attention.cpp"
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)


def _cpu_digest() -> str:
    """A short digest of what the CPU can do (its flags line), for the build's name."""
    flags = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags += line
                break
    except OSError:
        pass
    return hashlib.sha1(flags.encode()).hexdigest()[:10]


def _ninja_on_path() -> None:
    """cpp_extension runs ``ninja`` from PATH: where only the PyPI package (a dependency) has
    it, e.g. a venv not on PATH, put that package's bin directory on PATH."""
    if shutil.which("ninja") is None:
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


@functools.cache
def load() -> bool:
    """Build (once per machine) and register ``torch.ops.radixserve_cpu``; False where unavailable."""
    if os.environ.get("RADIXSERVE_NATIVE_ATTENTION", "1") == "0":
        return False
    try:
        from torch.utils import cpp_extension

        _ninja_on_path()
        cpp_extension.load(
            name=f"radixserve_cpu_attention_{_cpu_digest()}",
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as e:  # no compiler, no ninja, a failed build: the torch path still works
        log.warning("CPU paged-attention kernel unavailable, using the torch path: %s", e)
        return False
    return True


def supported(q_dtype: torch.dtype, kv_dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
    """Whether the kernel takes queries and (unquantized) pages of these dtypes and head size on ``device``.

    Head sizes are those of the models served, each compiled unrolled: 16 (tiny test models), 32, 64, 80, 96, 128, 256.
    """
    return device.type == "cpu" and q_dtype in _DTYPES and kv_dtype in _DTYPES and head_dim in _HEAD_DIMS


@dataclass
class AttentionPlan:
    """Which rows attend to which pages, in the kernel's index layout (int64 CPU tensors).

    Member ``i`` (a sequence) has ``new_len[i]`` new tokens at rows ``q_start[i]..`` of ``q``.
    Members of group ``g`` are ``group_start[g]:group_start[g+1]``; they first read
    ``shared_pages[shared_start[g]:shared_start[g+1]]`` together, then member ``i`` reads the
    first ``own_len[i]`` tokens of ``own_pages[own_start[i]:own_start[i+1]]``, causally: its
    new tokens are the last ``new_len[i]`` of those keys.
    """

    q_start: torch.Tensor
    new_len: torch.Tensor
    group_start: torch.Tensor
    shared_pages: torch.Tensor
    shared_start: torch.Tensor
    own_pages: torch.Tensor
    own_start: torch.Tensor
    own_len: torch.Tensor

    @staticmethod
    def build(groups: list[tuple[list["Member"], list[int]]]) -> "AttentionPlan":
        """``groups``: (members, shared pages) each, a member's own pages following the shared ones."""
        members = [m for ms, _ in groups for m in ms]

        def offsets(sizes: list[int]) -> list[int]:
            out = [0]
            for n in sizes:
                out.append(out[-1] + n)
            return out

        def t(xs: list[int]) -> torch.Tensor:
            return torch.tensor(xs, dtype=torch.int64)

        return AttentionPlan(
            q_start=t([m.q_start for m in members]),
            new_len=t([m.new_len for m in members]),
            group_start=t(offsets([len(ms) for ms, _ in groups])),
            shared_pages=t([p for _, pages in groups for p in pages]),
            shared_start=t(offsets([len(pages) for _, pages in groups])),
            own_pages=t([p for m in members for p in m.pages]),
            own_start=t(offsets([len(m.pages) for m in members])),
            own_len=t([m.own_len for m in members]),
        )


@dataclass
class Member:
    """One sequence of the plan: its new rows and its own pages (those after its group's)."""

    q_start: int  # first row of its new tokens in q
    new_len: int  # new tokens (1 for a decode)
    pages: list[int]  # own pages, in order
    own_len: int  # keys in its own pages, its new tokens the last new_len of them


def paged_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    out: torch.Tensor,
    plan: AttentionPlan,
    sm_scale: float,
) -> None:
    """Write into ``out`` (like ``q``: ``[T, Hq, D]``) the attention of the planned rows.

    ``k_pages``/``v_pages``: one layer's pool, ``[num_pages, page_size, Hkv, D]``, the new
    tokens' K/V already stored. Rows of ``q`` not in the plan are left as they are. Call
    :func:`load` first.
    """
    torch.ops.radixserve_cpu.paged_attention(
        q, k_pages, v_pages, out,
        plan.q_start, plan.new_len, plan.group_start, plan.shared_pages, plan.shared_start,
        plan.own_pages, plan.own_start, plan.own_len, sm_scale,
    )
