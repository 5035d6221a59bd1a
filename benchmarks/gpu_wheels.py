"""The wheels the GPU machine needs (benchmarks/gpu_wheels.txt), fetched for its Python and
proved to install there offline, beside the image it already has (benchmarks/gpu_image.txt).

    python benchmarks/gpu_wheels.py download wheels          # pip download for CPython 3.12 manylinux x86_64
    python benchmarks/gpu_wheels.py check wheels             # pip install --dry-run --no-index, 3.12

``check`` stands the image's packages in as empty wheels of their pinned versions (their
names and versions are all a resolver reads), so a missing dependency of any wheel fails it
here rather than on the GPU machine, where nothing can be fetched.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REQS = HERE / "gpu_wheels.txt"
IMAGE = HERE / "gpu_image.txt"
PY_VERSION = "3.12"
# pip expands a manylinux tag to the older ones it implies; 2_28 is what the wheels above need.
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux2014_x86_64", "any")
MAX_BYTES = 64 << 20  # what travels with the working tree


def requirements(path: Path = REQS) -> list[str]:
    """The requirement lines of ``path`` (comments and blanks dropped)."""
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def project_name(req: str) -> str:
    """The normalized distribution name of a requirement line (PEP 503)."""
    m = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", req)
    assert m, req
    return re.sub(r"[-_.]+", "-", m.group(0)).lower()


def target_args(py_version: str = PY_VERSION) -> list[str]:
    plats = [a for p in PLATFORMS for a in ("--platform", p)]
    return ["--only-binary=:all:", "--python-version", py_version, "--implementation", "cp", *plats]


def download(dest: Path, py_version: str = PY_VERSION) -> None:
    """Every wheel of gpu_wheels.txt for ``py_version`` (no dependencies: the list is complete)."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest)]
    subprocess.run([*cmd, *target_args(py_version), "-r", str(REQS)], check=True)


def stub_wheel(dest: Path, name: str, version: str) -> Path:
    """An empty wheel that says it is ``name`` ``version`` (no dependencies)."""
    dist = f"{re.sub(r'[-.]+', '_', name)}-{version}"
    path = dest / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(
            f"{dist}.dist-info/METADATA",
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        )
        z.writestr(
            f"{dist}.dist-info/WHEEL",
            "Wheel-Version: 1.0\nGenerator: gpu_wheels\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        z.writestr(f"{dist}.dist-info/RECORD", "")
    return path


def check(wheels: Path, py_version: str = PY_VERSION) -> str:
    """Resolve gpu_wheels.txt and the image offline for ``py_version``; returns pip's last line,
    raises with pip's output when something is missing. Also bounds the folder's size."""
    size = sum(p.stat().st_size for p in wheels.glob("*.whl"))
    if size > MAX_BYTES:
        raise RuntimeError(f"{wheels}: {size / 2**20:.1f} MiB of wheels, over {MAX_BYTES >> 20}")
    with tempfile.TemporaryDirectory(prefix="gpu_wheels_") as tmp:
        image, target = Path(tmp, "image"), Path(tmp, "target")
        image.mkdir()
        pins = [line.split("==") for line in requirements(IMAGE)]
        for name, version in pins:
            stub_wheel(image, name, version)
        cmd = [sys.executable, "-m", "pip", "--isolated", "install", "--dry-run", "--no-index"]
        cmd += ["--find-links", str(wheels), "--find-links", str(image)]
        cmd += ["--target", str(target), *target_args(py_version)]
        cmd += ["-r", str(REQS), *(f"{n}=={v}" for n, v in pins)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"the wheels do not install for Python {py_version}:\n{proc.stderr}")
    return proc.stdout.strip().splitlines()[-1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("action", choices=("download", "check"))
    ap.add_argument("wheels", type=Path)
    ap.add_argument("--python-version", default=PY_VERSION)
    args = ap.parse_args(argv)
    if args.action == "download":
        download(args.wheels, args.python_version)
    print(check(args.wheels, args.python_version))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
