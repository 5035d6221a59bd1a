"""The router's client side: what becomes of each message a client sends.

A frame is checked against the request limits (:mod:`~radixserve.serving.wire.limits`) before
it is decoded; then a :class:`GenerateRequest` is tracked by
:class:`~radixserve.serving.router.inflight.InFlight` at once (an abort or a client leaving finds
it), its prompt is encoded by the tokenizer processes
(:class:`~radixserve.serving.router.tokenizer_pool.TokenizerPool`, off the router's loop; on the
loop where there are none) and, once its token ids fit the workers' context, dispatched.
Health, model info and tokenize requests are answered here; stats and cache flushes go to
:class:`~radixserve.serving.router.control.ControlOps`, LoRA adapter loads and unloads to
:class:`~radixserve.serving.router.lora_ops.LoraOps`, pauses and memory releases to
``PauseOps`` and ``MemoryOps``, aborts to ``InFlight``.

Sending stays with the router (``send`` and ``reply_error``): a failed send means the
client is gone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec

from radixserve.prefix import MAX_ADAPTER_PATH_CHARS as MAX_PATH
from radixserve.prefix import check_adapter_name
from radixserve.serving.prompts import PromptCodec, PromptError, encode_text
from radixserve.serving.router.control import ControlOps
from radixserve.serving.router.inflight import ClientError, ClientSend, InFlight, context_error
from radixserve.serving.router.lora_ops import LoraOps
from radixserve.serving.router.memory_ops import MemoryOps
from radixserve.serving.router.pause_ops import PauseOps
from radixserve.serving.router.requests import RouterRequest
from radixserve.serving.router.tokenizer_pool import TokenizerPool
from radixserve.serving.router.weight_ops import WeightOps
from radixserve.serving.router.worker_pool import WorkerPool
from radixserve.serving.wire import protocol as p
from radixserve.serving.wire.limits import RequestLimits, prompt_chars
from radixserve.serving.wire.security import cache_namespace

log = logging.getLogger("radixserve.security")  # refusals go to the audit log
# What only an authenticated client may ask: every tenant's cache, every worker's adapters.
ADMIN_MESSAGES = (
    p.FlushCache,
    p.LoadLoraAdapter,
    p.UnloadLoraAdapter,
    p.UpdateWeights,
    p.PauseGeneration,
    p.ContinueGeneration,
    p.ReleaseMemory,
    p.ResumeMemory,
)
AdminMessage = (
    p.FlushCache
    | p.LoadLoraAdapter
    | p.UnloadLoraAdapter
    | p.UpdateWeights
    | p.PauseGeneration
    | p.ContinueGeneration
    | p.ReleaseMemory
    | p.ResumeMemory
)


def error_code(message: str) -> p.ErrorCode:
    """The error code of an encoding failure: ``internal`` for the tokenizer's own (its message
    says so), else the prompt was invalid (bad chat roles, no template)."""
    return (
        "internal"
        if message.startswith("internal")
        else "shutdown"
        if message.startswith("shutdown")
        else "invalid_params"
    )


class ClientSide:
    """Handles the messages of a router's clients (see the module doc).

    ``tokenizers``: the router's tokenizer processes, ``None`` to encode on the loop (also
    used once the pool reports itself ``broken``). ``started`` (when it was built, with the
    router) is what health replies count uptime from."""

    def __init__(
        self,
        limits: RequestLimits,
        codec: PromptCodec,
        tokenizers: TokenizerPool | None,
        pool: WorkerPool,
        inflight: InFlight,
        control: ControlOps,
        lora: LoraOps,
        weights: WeightOps,
        pauses: PauseOps,
        memory: MemoryOps,
        *,
        send: ClientSend,
        reply_error: ClientError,
        trusted: Callable[[Any], bool],
    ) -> None:
        self._limits, self._codec, self._tokenizers = limits, codec, tokenizers
        self._trusted = trusted
        self._pool, self._inflight, self._control, self._lora = pool, inflight, control, lora
        self._weights, self._pauses, self._memory = weights, pauses, memory
        self._send, self._reply_error = send, reply_error
        self.started = time.monotonic()

    def on_frames(self, raw: list[Any]) -> None:
        """Handle one message from a client: ``[identity, frame]`` as ``zmq.Frame`` objects
        (the last one's metadata says whether the client may ask what :data:`ADMIN_MESSAGES`
        ask)."""
        frames: list[bytes] = [f.bytes for f in raw]
        client = frames[0]
        refused = self._frame_error(frames)
        if refused is not None:
            self._reply_error(client, refused)
            return
        msg = p.decode_client(frames[1])
        if isinstance(msg, p.Error):
            self._reply_error(client, msg)
        elif isinstance(msg, p.GenerateRequest):
            self._on_generate(client, msg)
        elif isinstance(msg, p.Abort):
            self._inflight.abort(client, msg.request_id)
        elif isinstance(msg, p.Health):
            self._on_health(client, msg.request_id)
        elif isinstance(msg, p.ModelInfoRequest):
            self._on_model_info(client, msg.request_id)
        elif isinstance(msg, ADMIN_MESSAGES) and not self._trusted(raw[-1]):
            self._refuse_admin(client, msg)
        elif isinstance(msg, (p.StatsRequest, p.FlushCache)):
            self._control.start(client, msg)
        elif isinstance(msg, (p.LoadLoraAdapter, p.UnloadLoraAdapter)):
            self._on_lora(client, msg)
        elif isinstance(msg, p.UpdateWeights):
            self._on_update_weights(client, msg)
        elif isinstance(msg, (p.PauseGeneration, p.ContinueGeneration)):
            self._pauses.start(client, msg)
        elif isinstance(msg, (p.ReleaseMemory, p.ResumeMemory)):
            self._memory.start(client, msg)
        elif isinstance(msg, p.CloseSession):
            self._on_close_session(client, msg)
        elif isinstance(msg, p.TokenizeRequest):
            self._on_tokenize(client, msg)
        elif isinstance(msg, p.DetokenizeRequest):
            self._on_detokenize(client, msg)

    def _frame_error(self, frames: list[bytes]) -> p.Error | None:
        """Why ``[identity, frame]`` is refused before it is decoded, or None."""
        if len(frames) != 2:
            return p.Error(
                code="malformed", message=f"expected 1 frame per message, got {len(frames) - 1}"
            )
        too_large = self._limits.request_bytes_error(len(frames[1]))
        if too_large is not None:
            return p.Error(
                code="request_too_large",
                message=too_large,
                request_id=p.request_id_of(frames[1]),
            )
        return None

    def _on_health(self, client: bytes, request_id: str) -> None:
        self._send(
            client,
            p.HealthReply(
                request_id=request_id,
                ok=bool(self._pool.routable),
                workers_alive=len(self._pool.routable),
                uptime_s=time.monotonic() - self.started,
            ),
        )

    def _refuse_admin(self, client: bytes, msg: AdminMessage) -> None:
        """Every tenant's cached prefixes at once, or what every worker serves (and reads
        from its disk): only this process's clients (the HTTP gateway, whose admin key
        guards these paths) or a keyed client may ask."""
        what, asked = (
            ("flushing the cache", "cache flush")
            if isinstance(msg, p.FlushCache)
            else ("updating the weights", "weight update")
            if isinstance(msg, p.UpdateWeights)
            else ("pausing generation", "pause")
            if isinstance(msg, (p.PauseGeneration, p.ContinueGeneration))
            else ("releasing memory", "memory release")
            if isinstance(msg, (p.ReleaseMemory, p.ResumeMemory))
            else ("loading LoRA adapters", "LoRA adapter change")
        )
        log.warning("%s from client %s refused: not authenticated", asked, client.hex())
        self._reply_error(
            client,
            p.Error(
                code="forbidden",
                message=f"{what} needs an authenticated client (the server's --keys, or its "
                "own HTTP gateway with an admin key)",
                request_id=msg.request_id,
            ),
        )

    def _on_lora(self, client: bytes, msg: p.LoadLoraAdapter | p.UnloadLoraAdapter) -> None:
        """Check the adapter's name and path before any worker is asked."""
        try:
            check_adapter_name(msg.name)
            if isinstance(msg, p.LoadLoraAdapter) and not 0 < len(msg.path) <= MAX_PATH:
                raise ValueError(f"a LoRA adapter's path is 1 to {MAX_PATH} characters")
        except ValueError as exc:
            error = p.Error(code="invalid_params", message=str(exc), request_id=msg.request_id)
            self._reply_error(client, error)
            return
        self._lora.start(client, msg)

    def _on_update_weights(self, client: bytes, msg: p.UpdateWeights) -> None:
        """Check the path and version before any worker is asked."""
        bad = None
        if not 0 < len(msg.model_path) <= MAX_PATH:
            bad = f"a checkpoint's path is 1 to {MAX_PATH} characters"
        elif msg.weight_version is not None and not 0 < len(msg.weight_version) <= 256:
            bad = "a weight version is 1 to 256 characters"
        if bad is not None:
            error = p.Error(code="invalid_params", message=bad, request_id=msg.request_id)
            self._reply_error(client, error)
            return
        self._weights.start(client, msg)

    def _on_close_session(self, client: bytes, msg: p.CloseSession) -> None:
        if len(msg.session_id) > 256 or len(msg.cache_salt or "") > p.MAX_CACHE_SALT_CHARS:
            self._reply_error(
                client,
                p.Error(
                    code="invalid_params",
                    message="session_id is at most 256 characters, cache_salt "
                    f"{p.MAX_CACHE_SALT_CHARS}",
                    request_id=msg.request_id,
                ),
            )
            return
        self._control.start(client, msg)

    def _on_tokenize(self, client: bytes, msg: p.TokenizeRequest) -> None:
        def error(code: Any, message: str) -> None:
            self._reply_error(
                client, p.Error(code=code, message=message, request_id=msg.request_id)
            )

        chat = msg.chat()
        if chat is not None and msg.texts:
            return error("invalid_params", "tokenize either texts or messages, not both")
        bad = p.validate_generate(chat) if chat is not None else None  # as a generate's
        if bad is not None:
            return self._reply_error(client, bad)
        refused = self._limits.chat_template_error(msg.chat_template, chat is not None)
        if refused is not None:
            return error("invalid_params", refused)
        longest = prompt_chars(chat) if chat is not None else max(map(len, msg.texts), default=0)
        too_long = self._limits.prompt_chars_error(longest, self._pool.context_length())
        if too_long is not None:
            return error("context_length", too_long)
        self._tokenize(client, msg, chat)

    def _on_detokenize(self, client: bytes, msg: p.DetokenizeRequest) -> None:
        """Decode on the loop: a context's worth of ids is a millisecond's work, and the
        frame's size (the request byte limit) bounds how many come."""
        tok = self._codec.tokenizer
        size = len(tok)
        if any(not 0 <= t < size for t in msg.token_ids):
            self._reply_error(
                client,
                p.Error(
                    code="invalid_params",
                    message=f"token ids must be in [0, {size}), the tokenizer's vocabulary",
                    request_id=msg.request_id,
                ),
            )
            return
        text = tok.decode(msg.token_ids, skip_special_tokens=msg.skip_special_tokens)
        self._send(client, p.DetokenizeReply(request_id=msg.request_id, text=str(text)))

    def _tokenize(
        self, client: bytes, msg: p.TokenizeRequest, chat: p.GenerateRequest | None
    ) -> None:
        """Encode ``msg``'s texts, or its chat prompt (``chat``), as prompts are encoded."""

        def reply(ids: list[list[int]] | None, err: str | None) -> None:
            if err is not None:
                self._reply_error(
                    client, p.Error(code=error_code(err), message=err, request_id=msg.request_id)
                )
            else:
                self._send(client, p.TokenizeReply(request_id=msg.request_id, input_ids=ids or []))

        if chat is not None:
            self._encode_prompt(chat, reply)
        elif self._tokenizers is not None and not self._tokenizers.broken:
            self._tokenizers.submit(
                reply, texts=msg.texts, add_special_tokens=msg.add_special_tokens
            )
        else:
            tok, special = self._codec.tokenizer, msg.add_special_tokens
            reply([encode_text(tok, t, special) for t in msg.texts], None)

    def _encode_prompt(
        self, req: p.GenerateRequest, done: Callable[[list[list[int]] | None, str | None], None]
    ) -> None:
        """Encode ``req``'s prompt as every prompt is (and its prediction after it), then
        ``done(ids, error)``: in the tokenizer pool, or on the loop when there is none (or it
        broke, or the prompt is token ids already)."""
        pool = self._tokenizers
        if req.input_ids is None and pool is not None and not pool.broken:
            pool.submit(
                done,
                text=req.text,
                messages=req.messages,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                tools=req.tools,
                chat_template_kwargs=req.chat_template_kwargs,
                prediction=req.prediction,
                chat_template=req.chat_template,
            )
            return
        try:
            ids = self._codec.encode_with_prediction(req)
        except PromptError as exc:
            done(None, str(exc))
        else:
            done(ids, None)

    def _on_generate(self, client: bytes, req: p.GenerateRequest) -> None:
        def error(code: Any, message: str) -> None:
            self._reply_error(
                client, p.Error(code=code, message=message, request_id=req.request_id)
            )

        if self._inflight.has(client, req.request_id):
            return error("duplicate_request", f"request id {req.request_id!r} is already in flight")
        ctx = self._pool.context_length()
        # A prompt to be truncated may hold more than the context (the request's byte limit
        # still bounds what is tokenized).
        truncates = req.params.truncate_prompt_tokens is not None
        too_long = None if truncates else self._limits.prompt_chars_error(prompt_chars(req), ctx)
        if too_long is None and req.prediction is not None:
            too_long = self._limits.prompt_chars_error(len(req.prediction), ctx, "the prediction")
        if too_long is not None:
            return error("context_length", too_long)
        bad = p.validate_generate(req, vocab_size=self._pool.vocab_size())
        if bad is not None:
            return self._reply_error(client, bad)
        refused = self._limits.chat_template_error(req.chat_template, req.messages is not None)
        if refused is not None:
            return error("invalid_params", refused)
        adapters = self._pool.lora_adapters()
        if req.lora is not None and adapters is not None and req.lora not in adapters:
            served = ", ".join(sorted(adapters)) or "none"
            return error("invalid_params", f"unknown LoRA adapter {req.lora!r} (served: {served})")
        st = RouterRequest(
            self._inflight.new_rid(),
            client,
            req.request_id,
            [],
            req.params,
            req.stream,
            req.session_id,
            cache_namespace(req.namespace, req.cache_salt),
            None,
            time.monotonic(),
            priority=req.priority,
            lora=req.lora,
            lora_key=None if req.lora is None or adapters is None else adapters[req.lora],
        )
        # Tracked from now on (an abort, a client leaving or a shutdown finds it), dispatched
        # once its token ids are known.
        self._inflight.track(st)
        self._encode_prompt(req, lambda ids, err: self._encoded(st, ids, err))

    def _encoded(self, st: RouterRequest, ids: list[list[int]] | None, err: str | None) -> None:
        """The prompt of ``st`` is encoded (or failed to): check its length, dispatch it."""
        if self._inflight.get(st.rid) is not st:
            return  # aborted, or its client left, while it was being encoded
        if err is not None or not ids:
            return self._inflight.fail(st, error_code(err or ""), err or "no token ids")
        ctx = self._pool.context_length()
        prompt = st.params.truncated(ids[0], ctx)
        if not prompt:
            return self._inflight.fail(st, "invalid_params", "the prompt encodes to zero tokens")
        too_long = context_error(len(prompt), ctx)
        if too_long:
            return self._inflight.fail(st, "context_length", too_long)
        if len(ids) > 1:  # the prediction's, encoded with the prompt
            if ctx is not None and len(ids[1]) > ctx:
                msg = f"the prediction has {len(ids[1])} tokens, more than the context's {ctx}"
                return self._inflight.fail(st, "context_length", msg)
            st.params = msgspec.structs.replace(st.params, prediction=ids[1])
        st.prompt_ids = prompt
        st.detok = self._codec.detokenizer(st.params, prompt)
        self._inflight.dispatch(st)

    def _on_model_info(self, client: bytes, request_id: str) -> None:
        live = self._pool.routable
        if not live:
            self._reply_error(
                client,
                p.Error(code="no_workers", message="no live worker yet", request_id=request_id),
            )
            return
        h = live[0].hello
        self._send(
            client,
            p.ModelInfo(
                request_id=request_id,
                model=h.model,
                context_length=self._pool.context_length() or h.context_length,
                vocab_size=h.vocab_size,
                eos_token_ids=h.eos_token_ids,
                bos_token_id=h.bos_token_id,
                chat_template=self._codec.chat_template,
                page_size=h.page_size,
                num_workers=len(live),
                special_tokens=self._codec.special_tokens,
                model_path=live[0].model_path,
                lora_adapters=sorted(self._pool.lora_adapters() or ()),
                weight_version=live[0].weight_version,
                paused=self._pauses.mode,
                memory_released=self._memory.released,
                labels=h.labels,
                problem_type=h.problem_type,
            ),
        )
