"""Shared command line of the examples: talk to `radixserve serve`, or run the engine in process."""

from __future__ import annotations

import argparse

from frontend_dsl import Backend


def parse_args(description: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument(
        "--endpoint",
        default="tcp://127.0.0.1:5555",
        help="router of a running `radixserve serve` (default: %(default)s)",
    )
    ap.add_argument(
        "--local",
        action="store_true",
        help="run the engine in this process instead of connecting to a server",
    )
    ap.add_argument(
        "--model",
        default=None,
        help="with --local: a local HF checkpoint dir (default: SmolLM2-135M-Instruct)",
    )
    return ap.parse_args()


def make_backend(args: argparse.Namespace) -> Backend:
    """A RemoteBackend on --endpoint, or with --local an EngineBackend on --model."""
    if args.local:
        from frontend_dsl.engine_backend import EngineBackend

        return EngineBackend(model=args.model, page_size=16, max_num_tokens=2048)
    from frontend_dsl.remote_backend import RemoteBackend

    backend = RemoteBackend(args.endpoint, timeout=120)
    try:
        backend.health(timeout=5.0)  # fail fast with a clear message when no server is there
    except Exception as exc:
        backend.close()
        raise SystemExit(
            f"cannot reach a radixserve router at {args.endpoint} ({exc}).\n"
            "Start one with `radixserve serve`, or run this example with --local."
        ) from exc
    return backend
