"""`serve`'s local mooncake_master: started only for a Mooncake L3 whose config names no
master, listening on loopback, the workers' store config pointed at it, reaped on stop."""

from __future__ import annotations

import json
import socket

from mooncake_helpers import mooncake_or_skip

from radixserve.commands.serve import start_local_master


def test_a_local_master_only_when_none_is_given() -> None:
    assert start_local_master({}) is None
    given = {"master_server_address": "10.0.0.1:50051"}
    cfg = {
        "hicache_storage_backend": "mooncake",
        "hicache_storage_backend_extra_config": json.dumps(given),
    }
    assert start_local_master(cfg) is None
    mooncake_or_skip()
    cfg = {
        "hicache_storage_backend": "mooncake",
        "hicache_storage_backend_extra_config": json.dumps({"global_segment_size": "32mb"}),
    }
    master = start_local_master(cfg)
    try:
        extra = json.loads(cfg["hicache_storage_backend_extra_config"])
        assert extra["global_segment_size"] == "32mb"  # the user's fields are kept
        host, port = extra["master_server_address"].split(":")
        assert host == "127.0.0.1" and extra["metadata_server"].startswith("http://127.0.0.1:")
        socket.create_connection((host, int(port)), timeout=5).close()
    finally:
        master.stop()
    assert master.proc.returncode is not None
