"""``python -m radixserve``: the same as the ``radixserve`` console command."""

from __future__ import annotations

import sys

from radixserve.cli import main

sys.exit(main())
