"""Build or load the C++ CPU kernels as a start-up phase of its own, named for what it did.

The kernels (``radixserve/model/csrc``) compile once per machine and source version (g++
``-O3 -march=native``, cached under ``TORCH_EXTENSIONS_DIR``); later starts only load the
cached library. An engine on the CPU does this before it reads the weights, so its start-up
line says "build CPU kernels" when it compiled them (a first start: what ``radixserve
build-kernels`` or ``radixserve fetch-model`` does ahead of time) and "load CPU kernels"
otherwise, and never counts a build as loading weights.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

__all__ = ["KernelBuild", "build_cpu_kernels", "is_built"]


class KernelBuild(NamedTuple):
    """What :func:`build_cpu_kernels` did: the phase's name, whether the ops are usable, where."""

    phase: str  # "build CPU kernels", "load CPU kernels" or "CPU kernels off"
    ok: bool
    directory: Path | None


def _library() -> Path:
    from torch.utils import cpp_extension

    from radixserve.model import native

    name = native._build_name()
    return Path(cpp_extension._get_build_directory(name, verbose=False)) / f"{name}.so"


def _stamp() -> int | None:
    try:
        return _library().stat().st_mtime_ns
    except OSError:
        return None


def is_built() -> bool:
    """Whether this machine's build of the current sources is in the cache already."""
    return _stamp() is not None


def build_cpu_kernels() -> KernelBuild:
    """Build (if not cached) and load the kernels; torch paths serve where they cannot be built."""
    from radixserve.model import native

    if os.environ.get("RADIXSERVE_CPU_KERNELS", "1") == "0":
        return KernelBuild("CPU kernels off", False, None)
    before = _stamp()
    ok = native.load()
    # Compiled now if the library is new or was rewritten (cpp_extension rebuilds a cached one
    # whose recorded build command changed, e.g. the same sources in another checkout).
    compiled = _stamp() != before or before is None
    return KernelBuild(
        "build CPU kernels" if compiled else "load CPU kernels", ok, _library() if ok else None
    )
