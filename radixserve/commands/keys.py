"""``radixserve keys DIR``: CURVE key files for the router, its workers and its clients."""

from __future__ import annotations

import argparse

from radixserve.cli import register


def _keys_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "directory", help="where to write the keys (router/, worker/ and client/ below it)"
    )
    p.add_argument("--force", action="store_true", help="replace keys already there")


@register(
    "keys",
    help="generate CURVE keys that authenticate workers and clients to the router over tcp",
    arguments=_keys_arguments,
)
def keys(args: argparse.Namespace) -> int:
    from radixserve.serving.wire.security import generate_keys

    try:
        roles = generate_keys(args.directory, force=args.force)
    except FileExistsError as e:
        raise ValueError(str(e)) from e
    print(
        f"router:  radixserve serve --keys {roles['router']} ...   (keep {roles['router']}/router.key_secret on "
        "the router host)"
    )
    print(f"workers: radixserve worker --keys {roles['worker']} --connect tcp://ROUTER:PORT ...")
    print(
        f"clients: radixserve client --keys {roles['client']} ...   (also radixserve gateway --keys, "
        "Client(curve=load_peer_keys(DIR)))"
    )
    print(
        f"allowed keys: {roles['router']}/workers/*.key and {roles['router']}/clients/*.key "
        "(add or remove public keys there, then restart the router)"
    )
    return 0
