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


SOURCES = sorted(p.name for p in CSRC.glob("*.cpp"))


@pytest.fixture(scope="module")
def syntax_checks() -> dict[str, subprocess.CompletedProcess[str]]:
    """Every source's syntax pass for x86-64-v3, all started at once: each one spends its
    time parsing torch's headers, so the module takes about one source's time per core
    rather than the sum."""
    from torch.utils.cpp_extension import include_paths

    includes = [f"-I{p}" for p in [*include_paths(), sysconfig.get_paths()["include"]]]
    procs = {
        source: subprocess.Popen(
            [
                "g++",
                "-fsyntax-only",
                "-std=c++17",
                "-march=x86-64-v3",
                "-fopenmp",
                *includes,
                str(CSRC / source),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for source in SOURCES
    }
    done = {}
    try:
        for source, proc in procs.items():
            out, err = proc.communicate(timeout=300)
            done[source] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return done


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("source", SOURCES)
def test_compiles_without_avx512(
    source: str, syntax_checks: dict[str, subprocess.CompletedProcess[str]]
) -> None:
    out = syntax_checks[source]
    assert out.returncode == 0, out.stderr[-3000:]
