"""A non-editable install imports every package and module: pyproject.toml lists its
packages explicitly (``kernels/`` installs as ``radixkernels``), and a folder missing from
that list works in the editable checkout but is absent from the wheel.

The wheel is built from a copy of the source (no stale ``build/`` can hide a missing
package), installed with ``pip install --no-deps --target`` into a temporary folder, and
imported from there by a fresh interpreter that runs outside the checkout; the dependencies
come from the test's own environment.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"radixserve": "radixserve", "frontend_dsl": "frontend_dsl", "radixkernels": "kernels"}

IMPORT_ALL = r"""
import importlib, json, pkgutil
names, where = [], {}
for top in ("radixserve", "frontend_dsl", "radixkernels"):
    pkg = importlib.import_module(top)
    where[top] = pkg.__file__
    names.append(top)
    for info in pkgutil.walk_packages(pkg.__path__, top + "."):
        if info.name.endswith(".__main__"):  # importing it runs the CLI
            continue
        importlib.import_module(info.name)
        names.append(info.name)
print(json.dumps({"names": names, "where": where}))
"""


def _source_modules() -> set[str]:
    """Every module of the source's packages (folders with an ``__init__.py``; the DSL's
    examples are scripts run from the checkout, not installed)."""
    found = set()
    for top, folder in SOURCES.items():
        for f in (ROOT / folder).rglob("*.py"):
            if not (f.parent / "__init__.py").exists():
                continue
            parts = [top, *f.relative_to(ROOT / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if parts[-1] != "__main__":
                found.add(".".join(parts))
    return found


@pytest.mark.slow
def test_a_built_wheel_imports_every_module(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.o", "build")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for folder in SOURCES.values():
        shutil.copytree(ROOT / folder, src / folder, ignore=ignore)
    wheels = tmp_path / "wheels"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    build = [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(src)]
    subprocess.run(build, check=True, timeout=300)
    (wheel,) = wheels.glob("radixserve-*.whl")
    target = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)], check=True)

    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    # Imported from the install, not from the checkout.
    for top, file in report["where"].items():
        assert Path(file).is_relative_to(target), (top, file)
    assert set(report["names"]) == _source_modules()
