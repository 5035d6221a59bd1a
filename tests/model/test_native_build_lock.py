"""A start after a start that was killed while building the CPU kernels.

cpp_extension marks a build in progress with a ``lock`` file in the build directory and
removes it when the build ends; a process killed mid-build (Ctrl-C during a first start, a
killed CI run) leaves it behind, and every later start waited for it forever, printing
nothing. ``native.load`` holds a flock of its own around the build (dropped by the kernel
when its process dies) and clears such a file under it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from torch.utils import cpp_extension

from radixserve.model import native

pytestmark = pytest.mark.skipif(
    not native.load(), reason="the CPU kernel did not build here (see the log)"
)


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_start() -> None:
    name = native._build_name()
    built = Path(cpp_extension._get_build_directory(name, verbose=False))
    (built / "lock").unlink(missing_ok=True)
    (built / "lock").touch()  # as a killed build leaves it (the build itself is up to date)
    out = subprocess.run(
        [sys.executable, "-c", "from radixserve.model import native; print(native.load())"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.stdout.strip() == "True", out.stderr
    assert not (built / "lock").exists()


def test_checkouts_of_the_same_sources_share_one_build(tmp_path: Path) -> None:
    """The sources are compiled from a copy in the build's directory, so another checkout of
    them (a CI clone beside a working copy) loads the same build without rebuilding it: ninja's
    commands name the same paths from either."""
    name = native._build_name()
    built = Path(cpp_extension._get_build_directory(name, verbose=False))
    library = built / f"{name}.so"
    stamp = library.stat().st_mtime_ns
    clone = tmp_path / "clone" / "radixserve"
    shutil.copytree(
        Path(native.__file__).parents[1], clone, ignore=shutil.ignore_patterns("__pycache__")
    )
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "from radixserve.model import native; print(native.__file__, native.load())",
        ],
        cwd=clone.parent,
        env={**os.environ, "PYTHONPATH": str(clone.parent)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.stdout.split() == [str(clone / "model" / "native.py"), "True"], out.stderr
    assert library.stat().st_mtime_ns == stamp  # loaded as built, not rebuilt
