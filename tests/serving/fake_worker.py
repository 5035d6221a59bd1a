"""A worker process running the real worker loop around :class:`FakeEngine` (no model)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fake_engine import FakeEngine  # noqa: E402

from radixserve.cli import build_parser  # noqa: E402
from radixserve.commands.serve import worker  # noqa: E402

if __name__ == "__main__":
    # The arguments `serve` gives a local worker, run as `radixserve worker` runs them.
    worker(build_parser().parse_args(["worker", *sys.argv[1:]]), engine_factory=FakeEngine)
