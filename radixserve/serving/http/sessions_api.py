"""Closing a session over HTTP: its lease is released on every worker and the router
forgets where it ran.

* SGLang's ``POST /close_session`` with ``{"session_id": ..., "cache_salt": ...}``;
* ``DELETE /v1/sessions/{key}`` (``?cache_salt=``) for a chat's ``prompt_cache_key``
  (or ``session_id``).

Both answer ``{"session_id": key, "released": bool}``: whether some worker held a lease
for it. The session is looked up in the caller's namespace (its API key and cache salt,
as its requests were), so a tenant can only close its own sessions. Closing is optional:
an unclosed session's lease runs out by itself (its length learned from its pauses).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from radixserve.serving.http.auth import request_key, tenant_cache_salt
from radixserve.serving.http.gateway import Gateway

router = APIRouter()


class CloseSessionReqInput(BaseModel):
    """SGLang's ``/close_session`` body."""

    model_config = ConfigDict(strict=True, extra="ignore")

    session_id: str = Field(min_length=1, max_length=256)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)


async def _close(request: Request, session_id: str, cache_salt: str | None) -> dict[str, Any]:
    g: Gateway = request.app.state.gateway
    salt = tenant_cache_salt(request_key(request.scope), cache_salt)
    return {"session_id": session_id, "released": await g.close_session(session_id, salt)}


@router.post("/close_session")
async def close_session(body: CloseSessionReqInput, request: Request) -> dict[str, Any]:
    return await _close(request, body.session_id, body.cache_salt)


@router.delete("/v1/sessions/{session_id}")
async def delete_session(
    session_id: str, request: Request, cache_salt: str | None = None
) -> dict[str, Any]:
    if not 1 <= len(session_id) <= 256 or (cache_salt is not None and len(cache_salt) > 256):
        from radixserve.serving.http.errors import invalid

        raise invalid("session ids and cache salts are 1 to 256 characters", param="session_id")
    return await _close(request, session_id, cache_salt)
