"""The GPU machine's wheels (benchmarks/gpu_wheels.txt) install offline for CPython 3.12.

Downloads them from PyPI (``network``: run with ``RADIXSERVE_NETWORK_TESTS=1``; about 20 MB,
a few seconds; the suite itself stays on loopback) exactly
as ``gpu_check.sh --download-wheels`` does, then resolves the set with
``pip install --dry-run --no-index --find-links wheels --python-version 3.12
--only-binary=:all: --target ...`` beside empty stand-ins of the image's packages
(benchmarks/gpu_image.txt): any dependency the list misses fails here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_wheels  # noqa: E402


@pytest.mark.network
def test_wheels_install_offline_for_python_312(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    gpu_wheels.download(wheels, "3.12")
    names = {p.name for p in wheels.glob("*.whl")}
    assert any(n.startswith("xgrammar-") and "cp312" in n for n in names)
    assert any(n.startswith("pyzmq-") for n in names) and any("manylinux" in n for n in names)
    line = gpu_wheels.check(wheels, "3.12")
    assert line.startswith("Would install") and "fastapi" in line and "uvloop" in line


def test_a_missing_dependency_fails_the_check(tmp_path: Path) -> None:
    """The check itself: a folder lacking msgspec (and everything else) cannot resolve."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(RuntimeError, match="do not install for Python 3.12"):
        gpu_wheels.check(tmp_path / "empty", "3.12")
