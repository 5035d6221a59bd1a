"""Updating the served weights while serving, in SGLang's shape (what RL frameworks such
as verl and OpenRLHF call after each training step):

* ``POST /update_weights_from_disk`` ``{"model_path", "weight_version",
  "abort_all_requests", "load_format", "flush_cache"}``, answering ``{"success",
  "message", "model_path", "weight_version", "num_aborted_requests"}`` (200, else 400 or
  503 with the same body);
* ``GET /get_weight_version``: ``{"weight_version"}``.

An admin path (:data:`~radixserve.serving.http.auth.ADMIN_PATHS`): it changes what every
tenant is served and reads the workers' disks. ``model_path`` is a checkpoint directory on
the workers' hosts, of the served architecture. Each worker finishes the requests it runs
with the old weights, holds the ones that come meanwhile, then serves the new weights
(docs/http-api.md); ``abort_all_requests`` first ends the requests in flight through this
server instead, as aborted. Every cached prefix is dropped with the
old weights, so ``flush_cache: false`` is refused, as is a ``load_format`` other than the
checkpoint's own (``auto``).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from radixserve.prefix import MAX_ADAPTER_PATH_CHARS
from radixserve.serving.http.errors import fan_out_status, invalid
from radixserve.serving.http.gateway import Gateway

router = APIRouter()


class UpdateWeightsFromDiskInput(BaseModel):
    """SGLang's body (unknown keys ignored: SGLang grows new ones often)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model_path: str = Field(min_length=1, max_length=MAX_ADAPTER_PATH_CHARS)
    weight_version: str | None = Field(default=None, min_length=1, max_length=256)
    abort_all_requests: bool = False
    load_format: str | None = None
    flush_cache: bool = True


def _gw(request: Request) -> Gateway:
    return request.app.state.gateway


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(
    body: UpdateWeightsFromDiskInput, request: Request
) -> JSONResponse:
    if body.load_format not in (None, "auto"):
        raise invalid("load_format: the checkpoint is read as at start-up (auto)", "load_format")
    if not body.flush_cache:
        raise invalid(
            "flush_cache: the cached prefixes are always dropped with the old weights",
            "flush_cache",
        )
    g = _gw(request)
    aborted = await g.abort(None, None) if body.abort_all_requests else 0
    reply = await g.update_weights(body.model_path, body.weight_version)
    status = fan_out_status(reply.ok, reply.code)
    out = {
        "success": reply.ok,
        "message": "Succeeded to update model weights." if reply.ok else reply.error or "failed",
        "model_path": reply.model_path,
        "weight_version": reply.weight_version,
        "num_aborted_requests": aborted,
    }
    return JSONResponse(out, status_code=status)


@router.get("/get_weight_version")
async def get_weight_version(request: Request) -> dict[str, str]:
    return {"weight_version": (await _gw(request).fresh_info()).weight_version}
