"""`.ci/run` inside a virtual environment: the SGLang-frontend venv it makes sees that environment.

The bug this guards: `python -m venv --system-site-packages`, run from inside a venv, links
the new venv to the *base* interpreter's site-packages, so the frontend venv missed what the
user's venv had installed (psutil) and the frontend test failed. Here a real venv stands in for
the user's active environment, with a module only it has; `.ci/sglang-frontend-venv` runs with
that venv's interpreter as `$PYTHON`, and the frontend venv it makes must import that module.

No network: the active venv carries a minimal `sglang` package (the modules the setup imports
to check itself), so the setup finds the frontend present and skips its pip install; the
install itself is what `.ci/run` does on a real machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SETUP = ROOT / ".ci" / "sglang-frontend-venv"


def _site_packages(python: Path) -> Path:
    out = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(out.stdout.strip())


def _active_venv(tmp_path: Path) -> Path:
    """A venv like a user's: its own site-packages, with packages the base interpreter lacks."""
    venv = tmp_path / "user-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = _site_packages(venv / "bin" / "python")
    (site / "only_in_user_venv.py").write_text("VALUE = 42\n")
    for name in ("psutil", "aiohttp", "pybase64", "PIL", "IPython"):
        if not (site / name).exists():
            (site / name).mkdir()
            (site / name / "__init__.py").write_text("")
    lang = site / "sglang" / "lang"
    lang.mkdir(parents=True)
    (site / "sglang" / "__init__.py").write_text("")
    (lang / "__init__.py").write_text("")
    (lang / "api.py").write_text("import only_in_user_venv\n")
    return venv


@pytest.mark.slow  # makes two venvs (one with pip: a few seconds)
def test_frontend_venv_sees_the_active_environment(tmp_path: Path) -> None:
    user = _active_venv(tmp_path)
    frontend = tmp_path / "frontend-venv"
    env = {**os.environ, "PYTHON": str(user / "bin" / "python"), "PIP_NO_INDEX": "1"}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        ["bash", str(SETUP), str(frontend)], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    python = proc.stdout.strip().splitlines()[-1]
    assert python == str(frontend / "bin" / "python")
    probe = subprocess.run(
        [
            python,
            "-c",
            "import only_in_user_venv, sglang; print(only_in_user_venv.VALUE, sglang.__file__)",
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    assert probe.returncode == 0, probe.stderr
    value, sglang_file = probe.stdout.split()
    assert value == "42" and sglang_file.startswith(str(user))
    # A second run (the cached venv, as on the next .ci/run) keeps working and adds nothing twice.
    again = subprocess.run(
        ["bash", str(SETUP), str(frontend)], capture_output=True, text=True, env=env, timeout=300
    )
    assert again.returncode == 0, again.stderr[-3000:]
    pth = _site_packages(frontend / "bin" / "python") / "radixserve-active-env.pth"
    lines = pth.read_text().split()
    assert str(_site_packages(user / "bin" / "python")) in lines and len(lines) == len(set(lines))


def test_empty_collection_fails_in_words(tmp_path: Path) -> None:
    """pytest's exit 5 (nothing collected) fails `.ci/pytest` (.ci/run's last step) with a sentence."""
    (tmp_path / "test_one.py").write_text("def test_one():\n    pass\n")
    env = {**os.environ, "PYTHON": sys.executable}
    args = ["bash", str(ROOT / ".ci" / "pytest"), "--noconftest", "-p", "no:cacheprovider"]
    empty = subprocess.run(
        [*args, str(tmp_path), "-k", "no_such_test"], capture_output=True, text=True, env=env
    )
    assert empty.returncode == 5
    assert "collected no tests (exit 5)" in empty.stderr and "no_such_test" in empty.stderr
    ok = subprocess.run([*args, str(tmp_path)], capture_output=True, text=True, env=env)
    assert ok.returncode == 0 and "collected no tests" not in ok.stderr
    assert (ROOT / ".ci" / "run").read_text().rstrip().endswith('.ci/pytest "$@"')
