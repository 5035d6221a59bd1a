"""The CPU kernels' sources compile for a CPU without AVX-512 (x86-64-v3: AVX2) as well.

There ``RADIXSERVE_GEMV`` is 0: the small-batch linear kernels are left out and the Python
side keeps torch's, while attention, the elementwise ops and the decoder stack are still
built. A source that used an AVX-512-only name outside its ``#if`` would fail the whole
library on such machines, and this project's own CI machine has AVX-512, so it would not
notice: this checks every source with the compiler's syntax pass for that target.
"""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[2] / "radixserve" / "model" / "csrc"


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("source", sorted(p.name for p in CSRC.glob("*.cpp")))
def test_compiles_without_avx512(source: str) -> None:
    from torch.utils.cpp_extension import include_paths

    includes = [f"-I{p}" for p in [*include_paths(), sysconfig.get_paths()["include"]]]
    out = subprocess.run(
        [
            "g++",
            "-fsyntax-only",
            "-std=c++17",
            "-march=x86-64-v3",
            "-fopenmp",
            *includes,
            str(CSRC / source),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
