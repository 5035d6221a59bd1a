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


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_start(tmp_path: Path) -> None:
    name = native._build_name()
    built = Path(cpp_extension._get_build_directory(name, verbose=False))
    copy = tmp_path / name
    shutil.copytree(built, copy)  # times kept: ninja finds the build up to date
    (copy / "lock").unlink(missing_ok=True)
    (copy / "lock").touch()  # as a killed build leaves it
    out = subprocess.run(
        [sys.executable, "-c", "from radixserve.model import native; print(native.load())"],
        env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.stdout.strip() == "True", out.stderr
    assert not (copy / "lock").exists()
