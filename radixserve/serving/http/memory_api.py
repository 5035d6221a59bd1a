"""Memory given back to the OS between uses and taken again, in SGLang's and vLLM's shapes
(what RL frameworks such as verl, OpenRLHF and slime call around a training step on a
machine shared with the trainer):

* SGLang: ``POST /release_memory_occupation`` and ``POST /resume_memory_occupation``
  ``{"tags": ["kv_cache", "weights"]}`` (no body, or no tags: both; ``[]``: none), answering
  ``{"message", "status"}``;
* vLLM: ``POST /sleep?level=1|2`` (1: the KV cache; 2: the weights too; vLLM's level 1
  offloads the weights to host memory, where a CPU engine's already are, so it keeps them),
  ``POST /wake_up`` with optional repeated ``tags`` (``?tags=weights&tags=kv_cache``; none:
  both), each answering an empty 200 as vLLM does; ``GET /is_sleeping``.

Admin paths but ``/is_sleeping`` (:data:`~radixserve.serving.http.auth.ADMIN_PATHS`): a
release stops every tenant's requests, which wait until the memory is resumed. Refused
(400, with the workers' reasons; 503 with no worker) while a request runs: pause with
``retract`` or ``abort`` first. Released weights are undefined until
``/update_weights_from_disk`` after the resume (docs/http-api.md).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from radixserve.serving.http.errors import fan_out_status, invalid
from radixserve.serving.http.gateway import Gateway
from radixserve.serving.wire import protocol as p

router = APIRouter()

# vLLM's sleep levels: what each gives back.
LEVELS: dict[int, list[p.MemoryTag]] = {1: ["kv_cache"], 2: ["kv_cache", "weights"]}
MAX_TAGS = 8  # more names than tags exist: a list this long repeats itself


class MemoryOccupationInput(BaseModel):
    """SGLang's body (unknown keys ignored, as SGLang grows new ones)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    tags: list[str] | None = Field(default=None, max_length=MAX_TAGS)


def _gw(request: Request) -> Gateway:
    return request.app.state.gateway


# SGLang's third tag: its captured CUDA graphs' memory. The CPU engine captures none, so a
# client that names it (verl's rollout does) releases and resumes nothing more by it.
NO_OP_TAGS = ("cuda_graph",)


def _tags(raw: list[str] | None) -> list[p.MemoryTag] | None:
    """The tags asked (None: every one; an empty list none, as SGLang's); a 400 naming the
    known ones for any other."""
    if raw is None:
        return None
    if len(raw) > MAX_TAGS:
        raise invalid(f"at most {MAX_TAGS} tags", param="tags")
    unknown = sorted({t for t in raw if t not in (*p.MEMORY_TAGS, *NO_OP_TAGS)})
    if unknown:
        known = ", ".join((*p.MEMORY_TAGS, *NO_OP_TAGS))
        raise invalid(f"unknown memory tags {unknown[:MAX_TAGS]}: the tags are {known}", "tags")
    return [t for t in p.MEMORY_TAGS if t in raw]


def _sglang(reply: p.MemoryReply, done: str) -> JSONResponse:
    message = done if reply.ok else reply.error or "failed"
    body = {"message": message, "status": "ok" if reply.ok else "error"}
    return JSONResponse(body, status_code=fan_out_status(reply.ok, reply.code))


def _vllm(reply: p.MemoryReply) -> Response:
    if not reply.ok:
        status = fan_out_status(reply.ok, reply.code)
        return JSONResponse({"error": reply.error or "failed"}, status_code=status)
    return Response(status_code=200)


@router.post("/release_memory_occupation")
async def release_memory_occupation(
    request: Request, body: MemoryOccupationInput | None = None
) -> JSONResponse:
    reply = await _gw(request).release_memory(_tags(body.tags if body is not None else None))
    return _sglang(reply, "Memory released successfully.")


@router.post("/resume_memory_occupation")
async def resume_memory_occupation(
    request: Request, body: MemoryOccupationInput | None = None
) -> JSONResponse:
    reply = await _gw(request).resume_memory(_tags(body.tags if body is not None else None))
    return _sglang(reply, "Memory resumed successfully.")


@router.post("/sleep")
async def sleep(request: Request, level: int = Query(1)) -> Response:
    if level not in LEVELS:
        raise invalid("level must be 1 (the KV cache) or 2 (the weights too)", "level")
    return _vllm(await _gw(request).release_memory(LEVELS[level]))


@router.post("/wake_up")
async def wake_up(request: Request, tags: Annotated[list[str] | None, Query()] = None) -> Response:
    return _vllm(await _gw(request).resume_memory(_tags(tags)))


@router.get("/is_sleeping")
async def is_sleeping(request: Request) -> dict[str, bool]:
    return {"is_sleeping": bool((await _gw(request).fresh_info()).memory_released)}
