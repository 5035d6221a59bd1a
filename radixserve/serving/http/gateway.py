"""The gateway core: one :class:`~radixserve.serving.client.AsyncClient` to the router,
shared by every HTTP request, plus what both APIs need around it.

The gateway never touches an engine: it sends text, token ids or chat messages to the
router and gets chunks and a final message back. Every generate call streams from the
router (whatever the HTTP client asked), so time-to-first-token and inter-token latency
are measured the same way for every request. Leaving a stream early (client gone,
handler cancelled) aborts the request in the router, which frees its KV in the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar, Unpack

import msgspec
from starlette.requests import Request

from radixserve.memory.units import format_bytes
from radixserve.sampling_params import SamplingParams
from radixserve.serving.client import DEFAULT_ENDPOINT, AsyncClient, ServerError
from radixserve.serving.client.common import ChatRendering
from radixserve.serving.http.aborts import AbortScope, InFlightIds
from radixserve.serving.http.errors import APIError, from_server_error, from_timeout
from radixserve.serving.http.metrics import GatewayMetrics
from radixserve.serving.http.tokens import TokenNames
from radixserve.serving.wire import protocol as p
from radixserve.serving.wire.limits import RequestLimits
from radixserve.serving.wire.security import PeerKeys

log = logging.getLogger("radixserve.serving.http")
T = TypeVar("T")
Event = p.GenerateChunk | p.GenerateFinal


@dataclass(frozen=True)
class GatewayConfig:
    """Where the router is and how the gateway presents it.

    ``served_model_name``: the model name clients must use (default: the router's model
    name; ``"default"`` is always accepted too). ``tokenizer``: a model directory whose
    tokenizer turns token ids into the token strings of logprob results (``None``: the
    default model's when that is what the router serves; else ids are shown as
    ``token_id:N``). ``memory_log_interval_s``: period of the memory log line (0: off).
    ``api_keys`` / ``admin_api_keys``: bearer keys the HTTP clients must send (empty: none;
    see :mod:`~radixserve.serving.http.auth`). ``router_keys``: CURVE keys for a router
    that takes only authenticated clients. ``tool_call_parser`` / ``reasoning_parser``:
    how answers are split into calls and reasoning (see
    :mod:`~radixserve.serving.http.chat_tools`). ``context``: the router's ZeroMQ context, for a
    gateway in the router's process that reaches it at its ``inproc://`` endpoint.
    """

    router: str = DEFAULT_ENDPOINT
    served_model_name: str | None = None
    tokenizer: str | None = None
    request_timeout_s: float = 600.0
    control_timeout_s: float = 15.0
    lora_timeout_s: float = 150.0  # a LoRA adapter load (the router's own limit is 120 s)
    weights_timeout_s: float = 660.0  # a weight update (the router's own limit is 600 s)
    memory_log_interval_s: float = 60.0
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    admin_api_keys: tuple[str, ...] = field(default=(), repr=False)
    router_keys: PeerKeys | None = field(default=None, repr=False)
    limits: RequestLimits = RequestLimits()
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    context: Any = field(default=None, repr=False, compare=False)


def _adapter_named(name: str, served: str, adapters: list[str]) -> str | None:
    """The adapter a request's ``model`` names among ``adapters``: its name (vLLM's way) or
    ``base:adapter`` (SGLang's); None: none."""
    if name in adapters:
        return name
    base, sep, adapter = name.rpartition(":")
    if sep and base in (served, "default") and adapter in adapters:
        return adapter
    return None


def memory_line(w: p.WorkerStats) -> str:
    """One worker's device memory snapshot and KV page states, as one log line."""
    e, mem = w.engine, w.engine.get("memory") or {}
    total = e.get("num_pages", w.load.num_pages) or 0
    in_use = e.get("pages_in_use", w.load.in_use_pages)
    parts = [f"worker {w.worker_id}"]
    if mem:
        parts.append(
            f"{mem.get('device', '?')}: allocated {format_bytes(mem.get('allocated_bytes', 0))}, "
            f"reserved {format_bytes(mem.get('reserved_bytes', 0))} of {format_bytes(mem.get('total_bytes', 0))}, "
            f"rss {format_bytes(mem.get('rss_bytes', 0))}, kv pool {format_bytes(mem.get('pool_bytes', 0))}"
        )
    parts.append(
        f"kv pages free/evictable/in-use {e.get('pages_free', w.load.free_pages)}/"
        f"{e.get('pages_evictable', w.load.evictable_pages)}/{in_use} of {total} "
        f"({100.0 * in_use / total if total else 0.0:.1f}% in use); "
        f"running {e.get('running', w.load.running)}, waiting {e.get('waiting', w.load.waiting)}"
    )
    return f"memory: {parts[0]} " + "; ".join(parts[1:])


async def _wait_disconnect(request: Request) -> None:
    # Once the body is read, the next ASGI message can only be the client going away.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the HTTP client disconnects first, cancel it (its generate
    requests are aborted, freeing their KV) and raise a 499 :class:`APIError`."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        raise APIError(499, "client closed the request", code="client_closed")
    finally:
        for t in (task, watch):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)


@contextlib.contextmanager
def router_errors() -> Iterator[None]:
    """Answer the router client's errors as API errors (their HTTP status and shape)."""
    try:
        yield
    except ServerError as exc:
        raise from_server_error(exc) from exc
    except TimeoutError as exc:
        raise from_timeout(exc) from exc


class Gateway:
    """State shared by the HTTP handlers: the router client, model info, metrics."""

    def __init__(self, config: GatewayConfig = GatewayConfig(), tokenizer: Any = None) -> None:
        self.config = config
        self.metrics = GatewayMetrics()
        self.client: AsyncClient | None = None
        self.started = time.time()
        # True while ``serve`` sends its warm-up request (commands/gateway.py): /health says
        # 503 until then, so that "ready" means the first request's one-off costs are paid.
        self.warming_up = False
        self._info: p.ModelInfo | None = None
        self.tokens = TokenNames(tokenizer)
        self._tokenizer_looked_up = tokenizer is not None
        self._tasks: list[asyncio.Task[None]] = []
        self._on_close: list[Callable[[], Awaitable[None]]] = []
        self.last_stats: p.StatsReply | None = None
        # Generate requests by the ids their clients know, for /abort_request (http/aborts.py).
        self.in_flight = InFlightIds()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Connect to the router (inside the serving event loop) and start the memory log."""
        self.client = AsyncClient(
            self.config.router,
            timeout=self.config.request_timeout_s,
            curve=self.config.router_keys,
            context=self.config.context,
        )
        if self.config.memory_log_interval_s > 0:
            self._tasks.append(asyncio.create_task(self._memory_log_loop()))

    def on_close(self, stop: Callable[[], Awaitable[None]]) -> None:
        """Have :meth:`close` await ``stop()`` first (work the gateway runs on its own:
        background responses)."""
        self._on_close.append(stop)

    async def close(self) -> None:
        """Stop background tasks; abort this gateway's requests in flight; close the socket."""
        for stop in self._on_close:
            await stop()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.client is not None:
            await self.client.close()

    def _client(self) -> AsyncClient:
        if self.client is None:
            raise APIError(503, "the gateway is not started", type="service_unavailable")
        return self.client

    def check_chat_template(self, template: str | None) -> None:
        """Refuse (400) a request's own chat template where this server does not take them
        (``--trust-request-chat-template``), or one of no size a template has."""
        bad = self.config.limits.chat_template_error(template, True)
        if bad is not None:
            raise APIError(400, bad, param="chat_template")

    def check_batch(self, size: int) -> None:
        """Refuse (400) a request that would start more than the batch limit of generations."""
        bad = self.config.limits.batch_error(size)
        if bad is not None:
            raise APIError(400, bad, param="n", code="batch_too_large")

    # ------------------------------------------------------------------ model
    async def info(self) -> p.ModelInfo:
        """The router's :class:`ModelInfo` (fetched once a worker has joined, then cached)."""
        if self._info is None:
            with router_errors():
                self._info = await self._client().model_info(timeout=self.config.control_timeout_s)
            if not self._tokenizer_looked_up:
                self._tokenizer_looked_up = True
                # A tokenizer load takes a while: off the event loop.
                tokens = await asyncio.to_thread(self._find_tokenizer, self._info.model)
                if tokens is not None:
                    self.tokens = tokens
        return self._info

    @property
    def tokenizer(self) -> Any:
        """The tokenizer naming logprob tokens, or ``None``."""
        return self.tokens.tokenizer

    def _find_tokenizer(self, model: str) -> TokenNames | None:
        """``config.tokenizer``, else the default model's when the router serves it."""
        from radixserve.serving.prompts import load_tokenizer

        path: Any = self.config.tokenizer
        if path is None:
            from radixserve.model_store import (
                DEFAULT_MODEL_ALIASES,
                default_model_path,
                is_complete_model_dir,
            )

            if model.lower() not in DEFAULT_MODEL_ALIASES or not is_complete_model_dir(
                default_model_path()
            ):
                log.warning(
                    "no tokenizer for %r: logprob tokens are shown as token_id:N (see --tokenizer)",
                    model,
                )
                return None
            path = default_model_path()
        try:
            return TokenNames(load_tokenizer(path))
        except Exception as exc:  # a bad path must not take the gateway down
            log.warning(
                "could not load the tokenizer from %s (%s): logprob tokens are shown as token_id:N",
                path,
                exc,
            )
            return None

    async def model_name(self) -> str:
        return self.config.served_model_name or (await self.info()).model

    async def check_model(self, name: str) -> str:
        """Accept the served model's name (or ``"default"``), or a served LoRA adapter's;
        else a 404. Returns the name replies carry."""
        return (await self.resolve_model(name))[0]

    async def resolve_model(self, name: str) -> tuple[str, str | None]:
        """What a request's ``model`` names: ``(name replies carry, LoRA adapter or None)``.
        The served model (or ``"default"``), a served adapter's name (vLLM's way), or
        ``base:adapter`` (SGLang's); else a 404."""
        served = await self.model_name()
        if name in (served, "default"):
            return served, None
        adapters = (await self.info()).lora_adapters
        adapter = _adapter_named(name, served, adapters)
        if adapter is None:  # loaded since this gateway last asked, perhaps by another client
            adapters = await self.refresh_adapters()
            adapter = _adapter_named(name, served, adapters)
        if adapter is not None:
            return name, adapter
        listed = "".join(f", {a!r}" for a in adapters)
        raise APIError(
            404,
            f"the model {name!r} does not exist; this server serves {served!r}{listed}",
            param="model",
            code="model_not_found",
        )

    async def model_and_adapter(self, model: str, lora_path: str | None) -> tuple[str, str | None]:
        """The name replies carry and the LoRA adapter to run with: the one ``model`` names,
        or SGLang's ``lora_path`` beside the base model's name (both naming different ones:
        a 400)."""
        name, adapter = await self.resolve_model(model)
        if lora_path is None or lora_path == adapter:
            return name, adapter
        if adapter is not None:
            raise APIError(
                400, f"model names the LoRA adapter {adapter!r} and lora_path {lora_path!r}"
            )
        if lora_path not in (await self.info()).lora_adapters:
            raise APIError(404, f"no LoRA adapter {lora_path!r} is served", param="lora_path")
        return name, lora_path

    def token_text(self, token_id: int) -> str:
        """The text of one token (for logprobs); ``token_id:N`` without a tokenizer."""
        return self.tokens.text(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes of one token (OpenAI's ``bytes`` field)."""
        return self.tokens.bytes(token_id)

    # ------------------------------------------------------------------ control
    async def stats(self) -> p.StatsReply:
        """The router's stats (per worker, with engine stats and memory); feeds /metrics."""
        with router_errors():
            st = await self._client().stats(timeout=self.config.control_timeout_s)
        self.last_stats = st
        self.metrics.update(st)
        return st

    async def health(self) -> p.HealthReply:
        with router_errors():
            return await self._client().health(timeout=self.config.control_timeout_s)

    async def flush_cache(self) -> bool:
        with router_errors():
            return await self._client().flush_cache(timeout=self.config.control_timeout_s)

    async def load_lora_adapter(self, name: str, path: str) -> p.LoraAdapterReply:
        """Have every worker serve the PEFT adapter at ``path`` as ``name``; the model list
        and ``model`` names follow the reply's adapters."""
        with router_errors():
            reply = await self._client().load_lora_adapter(
                name, path, timeout=self.config.lora_timeout_s
            )
        self._served_adapters(reply)
        return reply

    async def unload_lora_adapter(self, name: str) -> p.LoraAdapterReply:
        """Have every worker stop serving adapter ``name``."""
        with router_errors():
            reply = await self._client().unload_lora_adapter(
                name, timeout=self.config.lora_timeout_s
            )
        self._served_adapters(reply)
        return reply

    async def refresh_adapters(self) -> list[str]:
        """The LoRA adapters served, asked of the router again (:meth:`fresh_info`)."""
        return (await self.fresh_info()).lora_adapters

    async def fresh_info(self) -> p.ModelInfo:
        """:meth:`info` with what changes while serving asked of the router again (the LoRA
        adapters, the weights' path and version): another client, or a worker's restart,
        may have changed them since. (The router answers from memory: a request naming an
        unknown model costs it no more than one it serves.)"""
        info = await self.info()
        with router_errors():
            fresh = await self._client().model_info(timeout=self.config.control_timeout_s)
        self._info = msgspec.structs.replace(
            info,
            lora_adapters=fresh.lora_adapters,
            model_path=fresh.model_path,
            weight_version=fresh.weight_version,
            paused=fresh.paused,
            memory_released=fresh.memory_released,
        )
        return self._info

    async def update_weights(self, path: str, weight_version: str | None) -> p.UpdateWeightsReply:
        """Have every worker serve the weights at ``path`` (each finishes its running
        requests first); :meth:`info` follows the reply."""
        with router_errors():
            reply = await self._client().update_weights_from_disk(
                path, weight_version, timeout=self.config.weights_timeout_s
            )
        if reply.ok and self._info is not None:
            self._info = msgspec.structs.replace(
                self._info, model_path=reply.model_path, weight_version=reply.weight_version
            )
        return reply

    async def pause(self, mode: p.PauseMode, clear_cache: bool) -> p.PauseReply:
        """Have every worker stop generating (worker/pausing.py); ``wait`` answers once the
        running requests finished, so it may take as long as a weight update."""
        with router_errors():
            return await self._client().pause_generation(
                mode, clear_cache, timeout=self.config.weights_timeout_s
            )

    async def resume(self) -> p.PauseReply:
        """Have every worker generate again."""
        with router_errors():
            return await self._client().continue_generation(timeout=self.config.control_timeout_s)

    async def release_memory(self, tags: list[p.MemoryTag] | None) -> p.MemoryReply:
        """Have every worker give the memory of ``tags`` back (worker/sleeping.py; None:
        every tag); the weights' release may take as long as an update."""
        with router_errors():
            return await self._client().release_memory_occupation(
                tags, timeout=self.config.weights_timeout_s
            )

    async def resume_memory(self, tags: list[p.MemoryTag] | None) -> p.MemoryReply:
        """Have every worker take the memory of ``tags`` again (None: every tag)."""
        with router_errors():
            return await self._client().resume_memory_occupation(
                tags, timeout=self.config.weights_timeout_s
            )

    def _served_adapters(self, reply: p.LoraAdapterReply) -> None:
        if self._info is not None:
            adapters = sorted(reply.adapters)
            self._info = msgspec.structs.replace(self._info, lora_adapters=adapters)

    async def close_session(self, session_id: str, cache_salt: str | None) -> bool:
        """Release ``session_id``'s lease in the tenant's namespace (``cache_salt``: the
        tenant's, :func:`~radixserve.serving.http.auth.tenant_cache_salt`)."""
        with router_errors():
            return await self._client().close_session(
                session_id, cache_salt=cache_salt, timeout=self.config.control_timeout_s
            )

    async def tokenize(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each text, exactly as the router encodes a text prompt."""
        with router_errors():
            return await self._client().tokenize(
                texts, timeout=self.config.control_timeout_s, add_special_tokens=add_special_tokens
            )

    async def detokenize(self, token_ids: list[int]) -> str:
        """The text of ``token_ids``: decoded here by the gateway's tokenizer when it has one
        (off the event loop), else by the router's."""
        if self.tokenizer is not None:
            return str(await asyncio.to_thread(self.tokenizer.decode, token_ids))
        with router_errors():
            return await self._client().detokenize(token_ids, timeout=self.config.control_timeout_s)

    async def tokenize_chat(
        self, messages: list[p.ChatMessage], **rendering: Unpack[ChatRendering]
    ) -> list[int]:
        """Token ids of a chat prompt, exactly as the router encodes one it generates for."""
        with router_errors():
            return await self._client().tokenize_chat(
                messages, timeout=self.config.control_timeout_s, **rendering
            )

    async def _memory_log_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.memory_log_interval_s)
            try:
                st = await self.stats()
            except APIError as exc:
                log.info("memory: router stats unavailable (%s)", exc.message)
                continue
            for w in st.workers:
                if w.alive:
                    log.info("%s", memory_line(w))

    # ------------------------------------------------------------------ generation
    async def stream(
        self,
        *,
        arrival: float,
        text: str | None = None,
        input_ids: list[int] | None = None,
        messages: list[p.ChatMessage] | list[dict[str, str]] | None = None,
        params: SamplingParams,
        session_id: str | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        tools: str | None = None,
        chat_template_kwargs: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        prediction: str | None = None,
        lora: str | None = None,
        chat_template: str | None = None,
        abort_scope: AbortScope | None = None,
    ) -> AsyncGenerator[Event, None]:
        """One generate request: its chunks, then its final message. Router errors become
        :class:`APIError`; closing the iterator early aborts the request. ``cache_salt``:
        the tenant's (:func:`~radixserve.serving.http.auth.tenant_cache_salt`);
        ``prediction``: the answer expected (drafted from); ``lora``: the served LoRA
        adapter to run with (:meth:`resolve_model`); ``chat_template``: the request's own
        (:meth:`check_chat_template`); ``abort_scope``: whose the request is and the ids
        :meth:`abort` finds it by while it runs (None: it cannot be aborted by id)."""
        first: float | None = None
        last = 0.0
        gaps: list[float] = []
        client = self._client()
        request_id = client.new_request_id()
        events = client.stream(
            text,
            request_id=request_id,
            input_ids=input_ids,
            messages=messages,
            params=params,
            session_id=session_id,
            cache_salt=cache_salt,
            priority=priority,
            stream=True,
            timeout=self.config.request_timeout_s,
            tools=tools,
            chat_template_kwargs=chat_template_kwargs,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            prediction=prediction,
            lora=lora,
            chat_template=chat_template,
        )
        with router_errors(), self.in_flight.track(abort_scope, request_id):
            # aclosing: leaving early closes the client stream now (it sends the abort), not at GC.
            async with contextlib.aclosing(events):
                async for ev in events:
                    now = time.monotonic()
                    if isinstance(ev, p.GenerateChunk):
                        n = len(ev.token_ids)
                        if n:
                            if first is None:
                                first = now
                            else:  # tokens that arrive together share the gap
                                gaps.extend([(now - last) / n] * n)
                            last = now
                    else:
                        self.metrics.observe_request(
                            ev, None if first is None else first - arrival, gaps, now - arrival
                        )
                    yield ev

    async def generate(self, **kwargs: Any) -> p.GenerateFinal:
        """Run one request to its final message (same arguments as :meth:`stream`)."""
        return await final_of(self.stream(**kwargs))

    async def abort(self, owner: str | None, client_id: str | None) -> int:
        """Abort ``owner``'s requests in flight known by ``client_id`` (None: all of them;
        ``owner`` None: every tenant's, an operator's); each then ends with finish reason
        ``abort`` and what it had generated. Returns how many were asked to stop."""
        found = self.in_flight.matching(owner, client_id)
        with router_errors():
            for request_id in found:
                await self._client().abort(request_id)
        return len(found)


async def final_of(stream: AsyncGenerator[Any, None]) -> p.GenerateFinal:
    """Run a request's event stream to its final message (closing it on the way out)."""
    async with contextlib.aclosing(stream) as events:
        async for ev in events:
            if isinstance(ev, p.GenerateFinal):
                return ev
    raise APIError(500, "the router ended a request without a final message", type="internal_error")


async def merge(
    streams: list[AsyncGenerator[T, None]],
) -> AsyncGenerator[tuple[int, T], None]:
    """Interleave several async iterators as ``(index, item)``; the first error is raised.
    Closing the merged iterator cancels (and so aborts) every stream still running."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | None, bool]] = asyncio.Queue()

    async def pump(i: int, it: AsyncGenerator[T, None]) -> None:
        try:
            async with contextlib.aclosing(it) as items:
                async for item in items:
                    await queue.put((i, item, None, False))
        except Exception as exc:  # forwarded to the consumer
            await queue.put((i, None, exc, True))
            return
        await queue.put((i, None, None, True))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, item, exc, done = await queue.get()
            if exc is not None:
                raise exc
            if done:
                left -= 1
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def to_builtins(obj: Any) -> Any:
    """msgspec structs to JSON-ready builtins."""
    return msgspec.to_builtins(obj)
