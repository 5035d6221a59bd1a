"""The Triton compiler (not just the interpreter) accepts the kernels: compile for sm_90 to a cubin.

Runs ``python -m radixkernels.compile_check`` in a subprocess with the interpreter off (this
process defined the kernels for the interpreter). No GPU is needed: ptxas ships with triton.
A representative subset (~8 variants, ~20 s on one core); ``--all`` compiles every
kernel x KV dtype x activation dtype.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.timeout(300)
def test_kernels_compile_for_sm90() -> None:
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run(
        [sys.executable, "-m", "radixkernels.compile_check", "--arch", "90"],
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("ok ") >= 8, proc.stdout
