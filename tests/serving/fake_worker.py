"""A worker process running the real worker loop around :class:`FakeEngine` (no model)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fake_engine import FakeEngine  # noqa: E402

from radixserve.serving.shutdown import exit_now  # noqa: E402
from radixserve.serving.worker import main  # noqa: E402

if __name__ == "__main__":
    exit_now(main(sys.argv[1:], engine_factory=FakeEngine))  # ends like the real worker
