"""CPU tensors' memory given back to the operating system while they stay allocated (what
SGLang's ``release_memory_occupation`` and vLLM's ``sleep`` do around an RL training step on
a machine shared with the trainer).

``madvise(MADV_DONTNEED)`` over the whole pages strictly inside a tensor's bytes drops them
from the process: its resident memory falls at once, and the next write faults fresh pages
in. Private anonymous memory (torch's CPU allocator, the huge-page buffers of
:mod:`~radixserve.memory.hugepages`) reads back as zeros afterwards, so a tensor released
this way needs no reallocation to be used again, and anything that holds it (views, the CPU
kernels' pointers) stays valid. The partial pages at its two ends hold other objects' bytes
too: they are zeroed with torch instead, so the whole tensor reads as zeros either way.

Only contiguous CPU tensors are advised (a strided view's span covers bytes it does not
own); others are zeroed in place, freeing nothing (:func:`discard` says how many bytes it
gave back).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os

import torch

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.madvise.restype = ctypes.c_int


def madvise_available() -> bool:
    """Whether this platform can drop pages (``MADV_DONTNEED``: Linux and the BSDs)."""
    return hasattr(mmap, "MADV_DONTNEED")


def discard(t: torch.Tensor) -> int:
    """Give ``t``'s memory back to the OS, leaving it reading as zeros (see the module
    docstring); the bytes given back (0 for a tensor not advised, which is only zeroed)."""
    nbytes = t.numel() * t.element_size()
    if not nbytes:
        return 0
    flat = t.view(torch.uint8).view(-1) if t.is_contiguous() else None
    if t.device.type != "cpu" or flat is None or not madvise_available():
        with torch.no_grad():
            (t.view(torch.uint8) if t.element_size() == 1 else t).zero_()
        return 0
    start = t.data_ptr()
    lo = -start % PAGE  # the first whole page, in bytes from the tensor's start
    hi = nbytes - (start + nbytes) % PAGE  # past the last whole page
    if hi - lo < PAGE:
        flat.zero_()
        return 0
    flat[:lo].zero_()
    flat[hi:].zero_()
    if _libc.madvise(ctypes.c_void_p(start + lo), hi - lo, mmap.MADV_DONTNEED) != 0:
        # Refused (locked or special memory): the contract still holds, nothing is freed.
        log.warning("madvise(MADV_DONTNEED) refused: %s", os.strerror(ctypes.get_errno()))
        flat[lo:hi].zero_()
        return 0
    return hi - lo
