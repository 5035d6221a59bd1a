"""`serve --disaggregation prefill:N,decode:M`: each local worker's mode, the worker count."""

from __future__ import annotations

import argparse

import pytest

from radixserve.commands.serve import disaggregation_overrides
from radixserve.serving.router.disagg_dispatch import parse_roles


def test_roles_and_worker_counts() -> None:
    assert parse_roles("prefill:1,decode:2") == ["prefill", "decode", "decode"]
    assert parse_roles(" decode:1 , prefill:2") == ["prefill", "prefill", "decode"]
    for bad in ("prefill:1", "prefill:0,decode:1", "prefill:1,decode:x", "p:1,decode:1", ""):
        with pytest.raises(ValueError):
            parse_roles(bad)
    args = argparse.Namespace(disaggregation="prefill:1,decode:2", workers=1)
    assert disaggregation_overrides(args) == [
        {"disaggregation_mode": "prefill"},
        {"disaggregation_mode": "decode"},
        {"disaggregation_mode": "decode"},
    ]
    assert args.workers == 3
    assert disaggregation_overrides(argparse.Namespace(disaggregation=None, workers=2)) is None
    remote = argparse.Namespace(disaggregation="prefill:1,decode:1", workers=0)
    assert disaggregation_overrides(remote) is None and remote.workers == 0
    with pytest.raises(ValueError, match="--workers 2"):
        disaggregation_overrides(argparse.Namespace(disaggregation="prefill:1,decode:2", workers=2))
