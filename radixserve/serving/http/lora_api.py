"""Loading and unloading LoRA adapters while serving, in SGLang's and vLLM's shapes:

* SGLang's ``POST /load_lora_adapter`` ``{"lora_name", "lora_path", "pinned"}`` and
  ``POST /unload_lora_adapter`` ``{"lora_name"}``, answering ``{"success",
  "error_message", "loaded_adapters"}`` (200, else 400, 404 or 503 with the same body);
* vLLM's ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` with the same
  bodies, answering ``Success: ...`` as text, else an OpenAI-shaped error.

Admin paths (:data:`~radixserve.serving.http.auth.ADMIN_PATHS`): they change what every
tenant is served and read the workers' disks. ``lora_path`` is a directory on the
workers' hosts; the server must serve adapters at all (``--enable-lora`` or
``--lora-paths``). Loading the same files under the same name again succeeds and changes
nothing; other files under a served name are refused until it is unloaded. An adapter
unloaded while its requests run serves them to the end. The model list (``/v1/models``)
and the names a request's ``model`` may take follow at once.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from radixserve.prefix import MAX_ADAPTER_NAME_CHARS, MAX_ADAPTER_PATH_CHARS
from radixserve.serving.http.errors import APIError
from radixserve.serving.http.gateway import Gateway
from radixserve.serving.wire import protocol as p

router = APIRouter()

# A failed reply's code -> its HTTP status and OpenAI error type.
_STATUS = {
    "not_found": (404, "not_found_error"),
    "unavailable": (503, "service_unavailable"),
}


class LoadLoraAdapterInput(BaseModel):
    """SGLang's and vLLM's load body."""

    model_config = ConfigDict(strict=True, extra="ignore")

    lora_name: str = Field(min_length=1, max_length=MAX_ADAPTER_NAME_CHARS)
    lora_path: str = Field(min_length=1, max_length=MAX_ADAPTER_PATH_CHARS)
    # SGLang's: never evicted from its device pool. Every adapter here stays loaded.
    pinned: bool = False


class UnloadLoraAdapterInput(BaseModel):
    """SGLang's and vLLM's unload body."""

    model_config = ConfigDict(strict=True, extra="ignore")

    lora_name: str = Field(min_length=1, max_length=MAX_ADAPTER_NAME_CHARS)


def _gw(request: Request) -> Gateway:
    return request.app.state.gateway


def _status(reply: p.LoraAdapterReply) -> tuple[int, str]:
    return _STATUS.get(reply.code or "", (400, "invalid_request_error"))


def _sglang(reply: p.LoraAdapterReply) -> JSONResponse:
    body = {
        "success": reply.ok,
        "error_message": reply.error or "",
        "loaded_adapters": reply.adapters,
    }
    return JSONResponse(body, status_code=200 if reply.ok else _status(reply)[0])


def _vllm(reply: p.LoraAdapterReply, name: str, done: str) -> Response:
    if not reply.ok:
        status, type_ = _status(reply)
        raise APIError(status, reply.error or "failed", type=type_, param="lora_name")
    return PlainTextResponse(f"Success: LoRA adapter '{name}' {done} successfully.")


@router.post("/load_lora_adapter")
async def load_sglang(body: LoadLoraAdapterInput, request: Request) -> Response:
    return _sglang(await _gw(request).load_lora_adapter(body.lora_name, body.lora_path))


@router.post("/unload_lora_adapter")
async def unload_sglang(body: UnloadLoraAdapterInput, request: Request) -> Response:
    return _sglang(await _gw(request).unload_lora_adapter(body.lora_name))


@router.post("/v1/load_lora_adapter")
async def load_vllm(body: LoadLoraAdapterInput, request: Request) -> Response:
    reply = await _gw(request).load_lora_adapter(body.lora_name, body.lora_path)
    return _vllm(reply, body.lora_name, "added")


@router.post("/v1/unload_lora_adapter")
async def unload_vllm(body: UnloadLoraAdapterInput, request: Request) -> Response:
    reply = await _gw(request).unload_lora_adapter(body.lora_name)
    return _vllm(reply, body.lora_name, "removed")
