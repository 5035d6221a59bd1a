"""The CPU kernels of ``csrc/``: build, load, call.

``paged_attention.cpp`` (its paths in ``paged_attention*.h``, ``store_kv.cpp`` writing the
new rows): the attention of a whole batch over the KV pool's pages (see
``attention/torch_paged.py``); ``elementwise.cpp``: RoPE in place, SiLU(gate) * up and RMSNorm
(with the residual add before it), one pass each (the model's layers use them on the CPU, see
:func:`enabled`); ``gemv.cpp`` and ``gemv_int4.cpp``: the linear layers at decode row counts
(see ``cpu_gemv.py``); ``decoder_layers.cpp``: all of these for every layer of a forward in
one call (see ``decoder_stack.py``).

They are compiled on first use with ``torch.utils.cpp_extension`` (g++ and ninja; the
build is cached under ``TORCH_EXTENSIONS_DIR``; 15-30 s the first time) for the machine it
runs on (``-march=native``; see :func:`_build_name`). Where they cannot
be built the torch paths serve instead and :func:`load` says why once in the log;
``RADIXSERVE_CPU_KERNELS=0`` turns them off.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import functools
import hashlib
import itertools
import logging
import os
import platform
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = [
    _CSRC / name
    for name in (
        "paged_attention.cpp",
        "store_kv.cpp",
        "elementwise.cpp",
        "gemv.cpp",
        "gemv_int8.cpp",
        "gemv_int4.cpp",
        "decoder_layers.cpp",
    )
]
#: The compiler and linker flags of the build (benchmarks build other revisions' kernels with them).
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
LDFLAGS = ["-fopenmp"]
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: Quantized page dtypes the attention kernel reads (``paged_attention_quant``): int8 codes
#: and int4 codes (uint8, two a byte, Hadamard-rotated rows) with per-token scales, fp8 codes
#: with per-head scales.
QUANT_PAGE_DTYPES = (torch.int8, torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2)
_HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)


def _build_name() -> str:
    """The build's name: a digest of the CPU's flags (``-march=native``) and of the sources and
    headers, so a cache shared by different CPUs or checkouts never loads a foreign build
    (and a changed header, which cpp_extension does not track, rebuilds)."""
    h = hashlib.sha1(platform.machine().encode())
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                h.update(line.encode())
                break
    except OSError:
        pass
    for src in sorted(p for p in _CSRC.iterdir() if p.suffix in (".cpp", ".h")):
        h.update(src.name.encode() + src.read_bytes())
    return f"radixserve_cpu_{h.hexdigest()[:12]}"


def _ninja_on_path() -> None:
    """cpp_extension runs ``ninja`` from PATH: where only the PyPI package (a dependency) has
    it, e.g. a venv not on PATH, put that package's bin directory on PATH."""
    if shutil.which("ninja") is None:
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _staged_sources(name: str) -> list[str]:
    """The sources and headers, copied once into build ``name``'s directory; the paths of the
    copied sources. Checkouts of the same sources then share one build: ninja's commands name
    the same paths from every one (compiled where they lie, a load from one checkout rebuilt
    what another had built, and two running at once, a CI clone beside a working copy,
    rebuilt in turn under the build lock until their distributed tests timed out). The name
    digests the contents, so a copy already there is this one (each lands whole: a rename)."""
    from torch.utils import cpp_extension

    staged = Path(cpp_extension._get_build_directory(name, verbose=False)) / "src"
    staged.mkdir(exist_ok=True)
    for src in _CSRC.iterdir():
        dest = staged / src.name
        if src.suffix in (".cpp", ".h") and not dest.exists():
            partial = dest.with_name(f".{src.name}.{os.getpid()}")
            shutil.copyfile(src, partial)
            partial.replace(dest)
    return [str(staged / src.name) for src in _SOURCES]


@contextlib.contextmanager
def _build_lock(name: str) -> Iterator[None]:
    """Hold an advisory lock on build ``name`` while cpp_extension builds or loads it, and clear
    a stale ``lock`` file of cpp_extension's own: a process killed mid-build (Ctrl-C during a
    first start, a killed CI run) leaves that file behind, and every later start then waited
    for it forever, silently. The kernel drops a flock when its process dies, so while this
    one is held no other build of ``name`` runs, and a ``lock`` file there is stale."""
    from torch.utils import cpp_extension

    build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
    with open(build_dir.parent / f"{name}.flock", "a") as f:  # beside, not cpp_extension's file
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@functools.cache
def load() -> bool:
    """Build (once per machine) and register ``torch.ops.radixserve_cpu``; False where unavailable."""
    if os.environ.get("RADIXSERVE_CPU_KERNELS", "1") == "0":
        return False
    try:
        from torch.utils import cpp_extension

        _ninja_on_path()
        name = _build_name()
        with _build_lock(name):
            cpp_extension.load(
                name=name,
                sources=_staged_sources(name),
                extra_cflags=CFLAGS,
                extra_ldflags=LDFLAGS,
                is_python_module=False,
                verbose=False,
            )
    except Exception as e:  # no compiler, no ninja, a failed build: the torch paths still work
        log.warning("CPU kernels unavailable, using the torch paths: %s", e)
        return False
    return True


def enabled(x: torch.Tensor) -> bool:
    """Whether the fused elementwise ops apply to ``x``: a CPU tensor, the kernels built."""
    # is_cpu, not device.type: this runs ~150 times a decode step, and building a device
    # object per call was most of its cost.
    return x.is_cpu and x.dtype in _DTYPES and load()


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """RoPE in place on ``x`` ``[T, heads, D]`` (rows of D contiguous; transformers'
    rotate_half convention) with float32 ``cos``/``sin`` of each row's position, ``[T, 1, D]``
    or ``[T, D]`` contiguous."""
    torch.ops.radixserve_cpu.rotary_(x, cos, sin)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a contiguous ``[T, 2n]`` ``gate_up`` (gate first): ``[T, n]``."""
    out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    torch.ops.radixserve_cpu.silu_mul(gate_up, out)
    return out


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm of the rows of ``x`` ``[T, n]`` scaled by ``weight`` (``x``'s dtype), float32
    inside and rounded once. With ``residual`` (like ``x``), first ``residual += x`` in place
    (the sum rounded to the dtype, as a torch add would) and the norm is of that sum."""
    out = torch.empty_like(x)
    torch.ops.radixserve_cpu.rms_norm(x, weight, eps, residual, out)
    return out


def supported(
    q_dtype: torch.dtype, kv_dtype: torch.dtype, device: torch.device, head_dim: int
) -> bool:
    """Whether the attention kernel takes queries and (unquantized) pages of these dtypes and
    head size on ``device``. Head sizes are those of the models served, each compiled
    unrolled: 16 (the tests' tiny models), 32, 64, 80, 96, 128, 256.
    """
    return (
        device.type == "cpu"
        and q_dtype in _DTYPES
        and kv_dtype in _DTYPES
        and head_dim in _HEAD_DIMS
    )


def supported_quantized(
    q_dtype: torch.dtype, page_dtype: torch.dtype, device: torch.device, head_dim: int
) -> bool:
    """Whether the attention kernel reads quantized pages of ``page_dtype`` (int8, int4 as
    uint8, fp8; see :data:`QUANT_PAGE_DTYPES`) for queries of ``q_dtype`` and this head size on
    ``device`` (int4: a power of two, its rows Hadamard-rotated)."""
    return (
        device.type == "cpu"
        and q_dtype in _DTYPES
        and page_dtype in QUANT_PAGE_DTYPES
        and head_dim in _HEAD_DIMS
        and (page_dtype != torch.uint8 or head_dim & (head_dim - 1) == 0)
    )


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

    def tensors(self) -> list[torch.Tensor]:
        """The eight index tensors in the kernel's argument order."""
        return [
            self.q_start,
            self.new_len,
            self.group_start,
            self.shared_pages,
            self.shared_start,
            self.own_pages,
            self.own_start,
            self.own_len,
        ]

    @staticmethod
    def build(groups: list[tuple[list[Member], list[int]]]) -> AttentionPlan:
        """``groups``: (members, shared pages) each, a member's own pages following the shared ones.

        Python does O(members + groups) here, whatever the pages: the page lists (a decode
        step's whole context) are joined and converted in C (``itertools.chain`` into an
        ``array``, which the tensor views), never walked page by page in Python (issue 44).
        """
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
            shared_pages=_joined([pages for _, pages in groups]),
            shared_start=t(offsets([len(pages) for _, pages in groups])),
            own_pages=_joined([m.pages for m in members]),
            own_start=t(offsets([len(m.pages) for m in members])),
            own_len=t([m.own_len for m in members]),
        )


def _joined(lists: list[list[int]]) -> torch.Tensor:
    """``lists`` end to end as one int64 tensor, joined and converted in C (a view of an
    ``array``, which it keeps alive)."""
    joined = array.array("q", itertools.chain.from_iterable(lists))
    if not joined:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(joined, dtype=torch.int64)


@dataclass
class Member:
    """One sequence of the plan: its new rows and its own pages (those after its group's)."""

    q_start: int  # first row of its new tokens in q
    new_len: int  # new tokens (1 for a decode)
    pages: list[int]  # own pages, in order
    own_len: int  # keys in its own pages, its new tokens the last new_len of them


def int8_attention_in_integers(head_dim: int) -> bool:
    """Whether bf16 queries of ``head_dim`` over int8 pages take the kernel's integer path on
    this machine (AVX-512 VNNI and BF16, no AMX): not the decoded values' bits, but closer to
    exact attention over the codes (``csrc/paged_attention_int8.h``). Call :func:`load` first."""
    return bool(torch.ops.radixserve_cpu.int8_attention_in_integers(head_dim))


def paged_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    out: torch.Tensor,
    plan: AttentionPlan,
    sm_scale: float,
    store: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    window: int | None = None,
    softcap: float | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Write into ``out`` (like ``q``: ``[T, Hq, D]``) the attention of the planned rows.

    ``k_pages``/``v_pages``: one layer's pool, ``[num_pages, page_size, Hkv, D]``. The new
    tokens' K/V are already stored there, or ``store`` = ``(k, v, slots)`` has the kernel
    store them first (``k``/``v`` ``[len(slots), Hkv, D]`` in ``q``'s dtype, rows of D
    contiguous; ``slots`` int64 flat slots ``page * page_size + offset``). Rows of ``q`` not
    in the plan are left as they are. ``window``: each row sees only the last ``window``
    keys up to its own (the plan must share no pages; ``attention/torch_paged.py`` builds
    one per window, each member's pages from the first its window reaches). Call
    :func:`load` first. ``softcap``: scores become ``softcap * tanh(score / softcap)``
    before the softmax (Gemma 2). ``sinks`` (``[Hq]`` float32): each query head's sink logit
    joins every row's softmax denominator (gpt-oss), added once per row after the keys, so a
    decode row and the prefill row of its position agree as without sinks.
    ``scales`` = ``(k_scale, v_scale)``: the pages are quantized (int8 codes, or int4 codes
    two a byte ``[.., Hkv, D // 2]``, with per-token scales ``[num_pages, page_size, Hkv]``,
    or fp8 codes with per-head scales ``[Hkv]``,
    float32; ``radixkernels/kv_format.py``): ``store``'s rows are quantized as
    ``store_kv_ref`` does, bit for bit (int8 and int4 writing their scales), and each chunk
    of keys is decoded to ``q``'s dtype as the torch path's dequantize does (``x.float() *
    s``, rounded once) and attended as such pages are; but bf16 queries over int8 pages, where
    :func:`int8_attention_in_integers` says so, take integer products over the codes with the
    scales applied after (``csrc/paged_attention_int8.h``). int4 rows are Hadamard-rotated:
    their codes decode to the rotated rows, over which the kernel attends with each query
    row rotated, rotating each output row back (``csrc/paged_attention_quant.h``,
    ``hadamard_rotate``): the torch path's attention in another basis, not its bits.
    """
    k_new, v_new, slots = store if store is not None else (None, None, None)
    if scales is not None:  # quantized pages
        torch.ops.radixserve_cpu.paged_attention_quant(
            q,
            k_pages,
            v_pages,
            out,
            *plan.tensors(),
            sm_scale,
            scales[0],
            scales[1],
            k_new,
            v_new,
            slots,
            window or 0,
            softcap or 0.0,
            sinks,
        )
        return
    torch.ops.radixserve_cpu.paged_attention(
        q,
        k_pages,
        v_pages,
        out,
        *plan.tensors(),
        sm_scale,
        k_new,
        v_new,
        slots,
        window or 0,
        softcap or 0.0,
        sinks,
    )
