"""Process-wide test settings. Runs before any test module imports torch or triton."""

from __future__ import annotations

import os

# Triton kernels run under the interpreter on CPU; this must be set before they are defined.
os.environ.setdefault("TRITON_INTERPRET", "1")
# With 2 cores, OpenMP spin-waiting makes CPU runs swing wildly.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
