"""Python clients of the router, run in the user's process: synchronous :class:`Client`,
asyncio :class:`AsyncClient` (the HTTP gateway and the DSL's remote backend use it too).

What crosses its border: text-level requests out and streamed replies in, as
:mod:`radixserve.serving.wire.protocol` messages on one DEALER socket per client.

Torch-free (pyzmq + msgspec only), and imports nothing of the router or the workers. This
package is the clients' public import path (``from radixserve.serving.client import
Client``); the classes live in :mod:`.sync_client`, :mod:`.async_client` and
:mod:`.common`.
"""

from __future__ import annotations

from radixserve.serving.client.async_client import AsyncClient
from radixserve.serving.client.common import Event, ServerError
from radixserve.serving.client.sync_client import Client, stream_demo
from radixserve.serving.wire.base import DEFAULT_ENDPOINT

__all__ = ["DEFAULT_ENDPOINT", "AsyncClient", "Client", "Event", "ServerError", "stream_demo"]
