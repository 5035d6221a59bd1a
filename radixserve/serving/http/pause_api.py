"""Pausing generation and continuing it, in SGLang's and vLLM's shapes (what RL frameworks
such as slime, verl and SkyRL call around a weight update):

* SGLang: ``POST /pause_generation`` ``{"mode": "abort" | "retract" | "in_place"}`` and
  ``POST /continue_generation``, answering ``{"message", "status"}``;
* vLLM: ``POST /pause?mode=abort|wait|keep&clear_cache=true`` (``keep`` is SGLang's
  ``in_place``; the old ``wait_for_inflight_requests=true`` means ``wait``) and
  ``POST /resume``, answering ``{"status": "paused" | "resumed"}``; ``GET /is_paused``.

Admin paths but ``/is_paused`` (:data:`~radixserve.serving.http.auth.ADMIN_PATHS`): a pause
stops every tenant's requests. While paused every request that comes waits for the
continue; what becomes of the running ones is the mode's (docs/http-api.md); a weight
update applies at once unless requests are kept in place with KV of the weights served.
A refusal is a 400 (503 with no worker) with the workers' reasons.
"""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from radixserve.serving.http.errors import fan_out_status
from radixserve.serving.http.gateway import Gateway
from radixserve.serving.wire import protocol as p

router = APIRouter()

VLLM_MODES: dict[str, p.PauseMode] = {"abort": "abort", "wait": "wait", "keep": "in_place"}


class PauseGenerationInput(BaseModel):
    """SGLang's body (unknown keys ignored, as SGLang grows new ones)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    mode: Literal["abort", "retract", "in_place"] = "abort"


def _gw(request: Request) -> Gateway:
    return request.app.state.gateway


def _status(reply: p.PauseReply) -> int:
    return fan_out_status(reply.ok, reply.code)


@router.post("/pause_generation")
async def pause_generation(
    request: Request, body: PauseGenerationInput | None = None
) -> JSONResponse:
    reply = await _gw(request).pause(body.mode if body is not None else "abort", False)
    message = "Generation paused successfully." if reply.ok else reply.error or "failed"
    return JSONResponse(
        {"message": message, "status": "ok" if reply.ok else "error"}, status_code=_status(reply)
    )


@router.post("/continue_generation")
async def continue_generation(request: Request) -> JSONResponse:
    reply = await _gw(request).resume()
    message = "Generation continued successfully." if reply.ok else reply.error or "failed"
    return JSONResponse(
        {"message": message, "status": "ok" if reply.ok else "error"}, status_code=_status(reply)
    )


@router.post("/pause")
async def pause(
    request: Request,
    mode: Literal["abort", "wait", "keep"] = Query("abort"),
    clear_cache: bool = Query(True),
    wait_for_inflight_requests: bool = Query(False),
) -> JSONResponse:
    chosen = "wait" if wait_for_inflight_requests else VLLM_MODES[mode]
    reply = await _gw(request).pause(chosen, clear_cache)
    if not reply.ok:
        return JSONResponse({"error": reply.error or "failed"}, status_code=_status(reply))
    return JSONResponse({"status": "paused"})


@router.post("/resume")
async def resume(request: Request) -> JSONResponse:
    reply = await _gw(request).resume()
    if not reply.ok:
        return JSONResponse({"error": reply.error or "failed"}, status_code=_status(reply))
    return JSONResponse({"status": "resumed"})


@router.get("/is_paused")
async def is_paused(request: Request) -> dict[str, bool]:
    return {"is_paused": (await _gw(request).fresh_info()).paused is not None}
