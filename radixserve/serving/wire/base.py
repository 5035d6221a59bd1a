"""The ground every protocol message stands on: the version, the error codes, the two base
structs (tagged messages, untagged parts) and the part both directions share (a worker's
load). The messages themselves are in :mod:`~radixserve.serving.wire.client_messages` and
:mod:`~radixserve.serving.wire.worker_messages`; :mod:`~radixserve.serving.wire.protocol` names them
all and encodes and decodes them.
"""

from __future__ import annotations

from typing import Literal

import msgspec

PROTOCOL_VERSION = 1
"""Bumped on any incompatible change; a message with another version gets an Error."""

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5555"
"""Where the router takes clients unless told otherwise (loopback), and where clients look."""

ErrorCode = Literal[
    "malformed",  # not msgpack / not a map / wrong frame count
    "unknown_type",  # the "type" tag names no message
    "version_mismatch",  # the "version" field is not PROTOCOL_VERSION
    "invalid_message",  # wrong field types, missing or unknown fields
    "invalid_params",  # values out of range (SamplingParams.validate, token ids, ...)
    "forbidden",  # the client may not send this message (e.g. a cache flush, unauthenticated)
    "duplicate_request",  # a request id already in flight on this connection
    "context_length",  # the prompt does not fit the model's context
    "request_too_large",  # the frame is larger than the router's request-size limit
    "no_workers",  # no live worker to run the request
    "worker_died",  # the worker running the request went away
    "shutdown",  # the server is stopping
    "overloaded",  # the server holds as much of something as it may (retry later)
    "timeout",  # the server gave up waiting (e.g. for workers to answer)
    "internal",  # a bug; the message says what
]


# What a pause does with the requests the workers run (SGLang's and vLLM's modes): "abort"
# ends them as aborted, "retract" sends them back to the queue with their KV cached
# (recomputed when they run again, with whatever weights are served then), "in_place" keeps
# them where they are, KV and all, and "wait" lets them finish first.
PauseMode = Literal["abort", "retract", "in_place", "wait"]
PAUSE_MODES: tuple[str, ...] = ("abort", "retract", "in_place", "wait")


class Msg(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, kw_only=True):
    """Base of every tagged message. ``version`` is always encoded (no omit_defaults)."""

    version: int = PROTOCOL_VERSION


class Part(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Base of nested (untagged) structs."""


class WorkerLoad(Part):
    """A worker's load, piggybacked on its outputs and heartbeats."""

    running: int = 0
    waiting: int = 0
    num_pages: int = 0
    free_pages: int = 0
    evictable_pages: int = 0
    in_use_pages: int = 0
