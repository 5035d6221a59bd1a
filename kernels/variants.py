"""Which compiled variant each Triton launch selects, and a log of them: "nothing compiles after warm-up".

Triton compiles one binary per *specialization* of a kernel: its constexpr values, the dtype
of every pointer, and for every non-constexpr int whether it equals 1 (it then becomes a
constant) or is divisible by 16, and for every pointer whether it is 16-byte aligned (unless
the kernel opts out with ``do_not_specialize`` / ``do_not_specialize_on_alignment``). A
launch whose specialization was not seen before compiles, which takes seconds in the middle
of serving.

:class:`LaunchLog` records, for every launch of the radixkernels kernels inside its ``with``
block, the key Triton's own launcher computes for it (Triton's generated argument binder and
``compute_cache_key``, for a CUDA sm_90 backend). It works with the kernels compiled (GPU) and
under ``TRITON_INTERPRET=1`` (CPU), where nothing is ever compiled but the key a GPU launch
*would* use is still computed from the same code. So a test on the CPU proves: every launch
made while serving has a key that some warm-up launch already had, i.e. on a GPU with these
Triton rules the serving launches hit the cache. What it cannot prove on the CPU: that the
GPU's own cache (``device_caches``) agrees, which :func:`compiled_variants` reads on a GPU
(benchmarks/gpu_check.sh runs the same test there).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
from collections import Counter
from collections.abc import Iterator
from typing import Any, NamedTuple

from triton.runtime.jit import JITFunction, KernelInterface

try:  # Triton's launcher internals (3.3+); older releases get the same rules re-stated below
    from triton.runtime.jit import compute_cache_key, create_function_from_signature
except ImportError:  # pragma: no cover - depends on the installed Triton
    compute_cache_key = create_function_from_signature = None

# Modules whose jitted kernels the server launches.
KERNEL_MODULES = (
    "radixkernels.kv_store",
    "radixkernels.decode",
    "radixkernels.extend",
    "radixkernels.fused",
    "radixkernels.int8_gemv",
)


class Launch(NamedTuple):
    """One recorded launch: the kernel's name and Triton's cache key for its specialization."""

    kernel: str
    key: str


def launched_kernels() -> list[KernelInterface]:
    """Every ``@triton.jit`` kernel (grid-launched ``_*_kernel``) of :data:`KERNEL_MODULES`."""
    out: list[KernelInterface] = []
    for name in KERNEL_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError:
            continue
        out += [
            v
            for k, v in vars(mod).items()
            if isinstance(v, KernelInterface) and k.endswith("_kernel")
        ]
    return out


@functools.cache
def _binder(kernel: KernelInterface) -> Any:
    """Triton's argument binder for ``kernel``, generated for a CUDA (sm_90) backend."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    if isinstance(kernel, JITFunction):
        jf = kernel
    else:  # InterpretedFunction: same function and specialization options, seen by the JIT
        opts = getattr(kernel, "kwargs", {})
        jf = JITFunction(
            kernel.fn,
            do_not_specialize=opts.get("do_not_specialize"),
            do_not_specialize_on_alignment=opts.get("do_not_specialize_on_alignment"),
        )
    return create_function_from_signature(
        jf.signature, jf.params, make_backend(GPUTarget("cuda", 90, 32))
    )


def variant_key(kernel: KernelInterface, args: tuple, kwargs: dict[str, Any]) -> str:
    """The cache key Triton's launcher computes for ``kernel[grid](*args, **kwargs)``."""
    if create_function_from_signature is None or compute_cache_key is None:
        return _restated_key(kernel, args, kwargs)
    try:
        _, specialization, options = _binder(kernel)(*args, **kwargs)
    except TypeError:  # pragma: no cover - a Triton whose binder takes other arguments
        return _restated_key(kernel, args, kwargs)
    return compute_cache_key({}, specialization, options)


def _restated_key(kernel: KernelInterface, args: tuple, kwargs: dict[str, Any]) -> str:
    """Triton's specialization rules, re-stated for releases whose launcher internals differ:
    constexpr values, pointer dtypes and 16-byte alignment, ints equal to 1 or divisible by 16
    (minus the kernel's ``do_not_specialize*`` names), and the launch options."""
    fn = getattr(kernel, "fn", kernel)
    opts = (
        getattr(kernel, "kwargs", {})
        if not isinstance(kernel, JITFunction)
        else {
            "do_not_specialize": kernel.do_not_specialize,
            "do_not_specialize_on_alignment": kernel.do_not_specialize_on_alignment,
        }
    )
    no_spec = set(opts.get("do_not_specialize") or ())
    no_align = set(opts.get("do_not_specialize_on_alignment") or ())
    params = list(inspect.signature(fn).parameters.values())
    bound = dict(zip((p.name for p in params), args))
    bound.update({k: v for k, v in kwargs.items() if k in {p.name for p in params}})
    parts = []
    for p in params:
        v = bound.get(p.name, p.default)
        if "constexpr" in str(p.annotation):
            parts.append(f"{p.name}={v!r}")
        elif hasattr(v, "data_ptr"):
            aligned = p.name not in no_align and v.data_ptr() % 16 == 0
            parts.append(f"{p.name}:*{v.dtype}{'D' if aligned else ''}")
        elif isinstance(v, bool) or not isinstance(v, int) or p.name in no_spec:
            parts.append(f"{p.name}:{type(v).__name__}")
        else:
            parts.append(f"{p.name}:{'1' if v == 1 else 'D' if v % 16 == 0 else ''}")
    launch = sorted((k, v) for k, v in kwargs.items() if k not in bound)
    return ";".join(parts) + repr(launch)


class LaunchLog:
    """Records every kernel launch's variant key while active (see the module docstring)."""

    def __init__(self) -> None:
        self.launches: list[Launch] = []

    @property
    def variants(self) -> set[Launch]:
        return set(self.launches)

    def counts(self) -> Counter[str]:
        """Launches per kernel name."""
        return Counter(launch.kernel for launch in self.launches)

    @contextlib.contextmanager
    def recording(self) -> Iterator[LaunchLog]:
        """Wrap each kernel's ``run`` so that a launch records its key, then runs as before."""
        kernels = launched_kernels()
        saved = [k.__dict__.get("run") for k in kernels]
        for k in kernels:
            inner = k.run

            def run(
                *args: Any,
                _k: KernelInterface = k,
                _inner: Any = inner,
                grid: Any,
                warmup: bool,
                **kw: Any,
            ) -> Any:
                self.launches.append(Launch(_k.__name__, variant_key(_k, args, kw)))
                return _inner(*args, grid=grid, warmup=warmup, **kw)

            k.run = run  # type: ignore[method-assign]
        try:
            yield self
        finally:
            for k, s in zip(kernels, saved):
                if s is None:
                    del k.run
                else:
                    k.run = s  # type: ignore[method-assign]


def compiled_variants() -> int:
    """Binaries in the compiled kernels' in-process caches, all devices (0 under the interpreter)."""
    total = 0
    for k in launched_kernels():
        if isinstance(k, JITFunction):
            total += sum(len(cache[0]) for cache in k.device_caches.values())
    return total
