"""A pool of tokenizer processes, so that the router's loop never encodes a prompt itself.

Encoding is the one piece of router work that grows with a request's size (a chat
template render plus a BPE pass over every character), so it runs in separate processes,
as SGLang's tokenizer manager does: the router sends an :class:`EncodeJob` and goes on
serving; the answer comes back on a socket its poller watches, and the request is
dispatched then. A huge or slow prompt delays only itself (and the jobs queued behind it
on the same process; jobs go to the process with the fewest outstanding).

::

    Router loop ──EncodeJob──> ROUTER (ipc) ──> tokenizer process 0 … N-1 (DEALER)
                <──Encoded────                <──  PromptCodec.encode (chat template, BPE)

Each process loads the same tokenizer (the router's own, pickled into the pool's private
directory: a new process unpickles it several times faster than transformers' AutoTokenizer
loads it, which spends most of its time importing the model's config classes; from its
directory when it does not pickle), says :class:`PoolReady`, and serves jobs until
its parent goes (``PR_SET_PDEATHSIG`` and a ``getppid`` check) or it is told to stop. A
process that dies fails its outstanding jobs (an ``internal`` error for those requests)
and is started again (after ``restart_limit`` deaths the router encodes on its own loop
rather than serve nothing). Incremental detokenizing stays in the router: its cost per step is
a window of a few tokens, whatever the request's size.

Run as ``python -m radixserve.serving.router.tokenizer_pool ENDPOINT TOKENIZER PARENT_PID``
(by :class:`TokenizerPool`, never by hand).
"""

from __future__ import annotations

import logging
import os
import pickle
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import zmq

from radixserve.serving.wire import protocol as p

log = logging.getLogger("radixserve.serving.tokenizer_pool")


class EncodeJob(msgspec.Struct, tag="encode", forbid_unknown_fields=True):
    """Encode one prompt (``text`` or chat ``messages``) or a list of ``texts`` (tokenize)."""

    job: int
    text: str | None = None
    messages: list[p.ChatMessage] | None = None
    add_generation_prompt: bool = True
    texts: list[str] | None = None
    tools: str | None = None
    chat_template_kwargs: str | None = None
    add_special_tokens: bool = True  # texts only (encode_text's)
    continue_final_message: bool = False
    prediction: str | None = None  # a prompt's: encoded after it (a second list of ids)
    chat_template: str | None = None  # the request's own, for messages


class PoolStop(msgspec.Struct, tag="stop"):
    """Exit now."""


class PoolReady(msgspec.Struct, tag="ready"):
    """A tokenizer process is loaded and takes jobs; ``secret`` proves it is the pool's own
    child (handed to it at spawn, see :data:`SECRET_ENV`)."""

    pid: int
    secret: str


class Encoded(msgspec.Struct, tag="encoded"):
    """A job's token ids (one list per text; a prompt's, then its prediction's), or why it
    failed (``error``)."""

    job: int
    ids: list[list[int]] = []
    error: str | None = None


SECRET_ENV = "RADIXSERVE_POOL_SECRET"  # a pool process's proof, read and removed at its start

_to_pool = msgspec.msgpack.Decoder(EncodeJob | PoolStop)
_from_pool = msgspec.msgpack.Decoder(PoolReady | Encoded)
_encoder = msgspec.msgpack.Encoder()

Done = Callable[[list[list[int]] | None, str | None], None]  # (ids, error)


@dataclass
class _Proc:
    index: int
    proc: subprocess.Popen[bytes]
    secret: str  # what its PoolReady must carry
    identity: bytes | None = None  # set by its PoolReady
    outstanding: dict[int, Done] = field(default_factory=dict)


class TokenizerPool:
    """The router's side of the pool (see the module doc): submit jobs, handle answers.

    Single-threaded like the router: :meth:`submit`, :meth:`on_frames` and :meth:`check`
    run on the router's loop; ``socket`` is registered in its poller.
    """

    def __init__(
        self, tokenizer: Any, num_procs: int, context: zmq.Context, *, restart_limit: int = 20
    ) -> None:
        if num_procs < 1:
            raise ValueError("a tokenizer pool needs at least one process")
        # mkdtemp's directory is its owner's alone (0700): no other user reaches the socket;
        # a process of the same user that does still cannot pass for a pool process (secrets).
        self._tmp = tempfile.mkdtemp(prefix="radixserve-tok-")
        try:
            self._source = self._tokenizer_source(tokenizer)
        except BaseException:
            shutil.rmtree(self._tmp, ignore_errors=True)
            raise
        self.socket = context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, 0)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.bind(f"ipc://{self._tmp}/pool.sock")
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._procs = [self._spawn(i) for i in range(num_procs)]
        self._queue: deque[tuple[EncodeJob, Done]] = deque()  # until a process is ready
        self._next_job = 0
        self._restarts_left = restart_limit
        self.jobs = 0
        self.broken = False  # the processes kept dying: the router encodes itself (see check)

    def _tokenizer_source(self, tokenizer: Any) -> str:
        """What the processes load: ``tokenizer`` pickled into the pool's directory (its
        owner's alone, so no one else can put a pickle of theirs there), else a copy saved
        there (it may carry a chat template set since it was loaded: ``--chat-template``),
        else its own directory, where that holds the same chat template."""
        out = Path(self._tmp) / "tokenizer.pickle"
        try:
            out.write_bytes(pickle.dumps(tokenizer))
            return str(out)
        except Exception as exc:  # pickle raises what the object's reducers raise
            log.info("the tokenizer does not pickle (%s): the processes load a saved copy", exc)
            out.unlink(missing_ok=True)
        copy = Path(self._tmp) / "tokenizer"
        try:
            tokenizer.save_pretrained(str(copy))
            return str(copy)
        except Exception as exc:  # its state does not copy either (save_pretrained deep-copies)
            log.info("the tokenizer does not save (%s): the processes load its directory", exc)
        path = getattr(tokenizer, "name_or_path", None)
        if not (isinstance(path, str) and (Path(path) / "tokenizer_config.json").is_file()):
            raise ValueError("the tokenizer neither pickles, saves, nor names its directory")
        if _load_tokenizer(path).chat_template != getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "the tokenizer neither pickles nor saves: its processes would render chats "
                "with its directory's template, not the one given (--chat-template)"
            )
        return path

    def _spawn(self, index: int) -> _Proc:
        secret = secrets.token_hex(16)
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", **{SECRET_ENV: secret})
        cmd = [
            sys.executable,
            "-m",
            "radixserve.serving.router.tokenizer_pool",
            self.endpoint,
            self._source,
            str(os.getpid()),
        ]
        proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdin=subprocess.DEVNULL)
        return _Proc(index, proc, secret)

    @property
    def ready(self) -> bool:
        """Every process has loaded its tokenizer and said so."""
        return all(pp.identity is not None for pp in self._procs)

    @property
    def pids(self) -> list[int]:
        return [pp.proc.pid for pp in self._procs]

    # ------------------------------------------------------------------ jobs
    def submit(
        self,
        done: Done,
        *,
        text: str | None = None,
        messages: list[p.ChatMessage] | None = None,
        add_generation_prompt: bool = True,
        texts: list[str] | None = None,
        tools: str | None = None,
        chat_template_kwargs: str | None = None,
        add_special_tokens: bool = True,
        continue_final_message: bool = False,
        prediction: str | None = None,
        chat_template: str | None = None,
    ) -> None:
        """Encode in a pool process; ``done(ids, error)`` runs on the router's loop later."""
        job = EncodeJob(
            self._next_job,
            text,
            messages,
            add_generation_prompt,
            texts,
            tools,
            chat_template_kwargs,
            add_special_tokens,
            continue_final_message,
            prediction,
            chat_template,
        )
        self._next_job += 1
        self.jobs += 1
        self._queue.append((job, done))
        self._send_queued()

    def _send_queued(self) -> None:
        while self._queue:
            ready = [pp for pp in self._procs if pp.identity is not None]
            if not ready:
                return
            target = min(ready, key=lambda pp: len(pp.outstanding))
            job, done = self._queue[0]
            try:
                self.socket.send_multipart([target.identity, _encoder.encode(job)], zmq.NOBLOCK)
            except zmq.ZMQError:  # gone since it said ready: check() restarts it
                target.identity = None
                continue
            self._queue.popleft()
            target.outstanding[job.job] = done

    def on_frames(self, frames: list[bytes]) -> None:
        """One message from a pool process."""
        if len(frames) != 2:
            return
        identity, data = frames
        try:
            msg = _from_pool.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.error("bad frame from a tokenizer process: %s", exc)
            return
        if isinstance(msg, PoolReady):
            self._on_ready(identity, msg)
            return
        # Only the process the job was sent to may answer it.
        pp = next((pp for pp in self._procs if pp.identity == identity), None)
        done = pp.outstanding.pop(msg.job, None) if pp is not None else None
        if done is None:
            log.warning(
                "an answer for job %d from an unknown peer %s ignored", msg.job, identity.hex()
            )
            return
        done(msg.ids if msg.error is None else None, msg.error)
        self._send_queued()

    def _on_ready(self, identity: bytes, msg: PoolReady) -> None:
        pp = next((pp for pp in self._procs if pp.proc.pid == msg.pid), None)
        if pp is None or not secrets.compare_digest(pp.secret, msg.secret):
            log.warning(
                "a tokenizer-pool hello from peer %s (claimed pid %d) refused: not a pool process",
                identity.hex(),
                msg.pid,
            )
            return
        pp.identity = identity
        self._send_queued()

    def check(self) -> None:
        """Restart processes that died; their outstanding jobs fail (the router's timer calls this)."""
        if self.broken:
            return
        for i, pp in enumerate(self._procs):
            code = pp.proc.poll()
            if code is None:
                continue
            log.error(
                "tokenizer process %d (pid %d) exited with code %s; %d job(s) failed",
                pp.index,
                pp.proc.pid,
                code,
                len(pp.outstanding),
            )
            for done in pp.outstanding.values():
                done(None, f"internal: the tokenizer process died (exit code {code})")
            if self._restarts_left <= 0:
                # Something is wrong with the tokenizer itself: stop the crash loop, and let
                # the router encode on its own loop rather than serve nothing.
                log.error(
                    "tokenizer processes keep dying: encoding on the router's loop from now on"
                )
                self.broken = True
                self.fail_all("internal: the tokenizer processes keep dying")
                return
            self._restarts_left -= 1
            self._procs[i] = self._spawn(pp.index)

    def fail_all(self, message: str) -> None:
        """Fail every queued and outstanding job (the router is shutting down)."""
        pending = [done for _, done in self._queue] + [
            d for pp in self._procs for d in pp.outstanding.values()
        ]
        self._queue.clear()
        for pp in self._procs:
            pp.outstanding.clear()
        for done in pending:
            done(None, message)

    def close(self, grace_s: float = 5.0) -> None:
        """Stop every process and reap it; remove the socket and any saved tokenizer."""
        for pp in self._procs:
            if pp.identity is not None:
                try:
                    self.socket.send_multipart(
                        [pp.identity, _encoder.encode(PoolStop())], zmq.NOBLOCK
                    )
                except zmq.ZMQError:
                    pass
            if pp.proc.poll() is None:
                pp.proc.terminate()
        deadline = time.monotonic() + grace_s
        for pp in self._procs:
            try:
                pp.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pp.proc.kill()
                pp.proc.wait()
        self.socket.close(linger=0)
        shutil.rmtree(self._tmp, ignore_errors=True)


# ---------------------------------------------------------------------------- the process


def _encode(codec: Any, job: EncodeJob) -> Encoded:
    from radixserve.serving.prompts import PromptError, encode_text

    try:
        if job.texts is not None:
            tok, special = codec.tokenizer, job.add_special_tokens
            return Encoded(job.job, [encode_text(tok, t, special) for t in job.texts])
        req = p.GenerateRequest(
            request_id="-",
            text=job.text,
            messages=job.messages,
            add_generation_prompt=job.add_generation_prompt,
            continue_final_message=job.continue_final_message,
            tools=job.tools,
            chat_template_kwargs=job.chat_template_kwargs,
            prediction=job.prediction,
            chat_template=job.chat_template,
        )
        return Encoded(job.job, codec.encode_with_prediction(req))
    except PromptError as exc:
        return Encoded(job.job, error=str(exc))
    except Exception as exc:  # the tokenizer's own failure: this request's, not the process's
        return Encoded(job.job, error=f"internal: tokenizing failed: {type(exc).__name__}: {exc}")


def _load_tokenizer(source: str) -> Any:
    """The pool's tokenizer: unpickled from the pool's own ``.pickle`` file, or loaded from a
    directory."""
    from radixserve.serving.prompts import load_tokenizer

    if source.endswith(".pickle"):
        with open(source, "rb") as f:
            return pickle.load(f)  # written by the router into its 0700 directory
    return load_tokenizer(source)


def run_tokenizer_process(connect: str, tokenizer: str, parent_pid: int) -> int:
    """A pool process: load the tokenizer from ``tokenizer`` (a pickle or a directory), then
    encode the jobs of the pool at ``connect`` until told to stop or until ``parent_pid`` (the
    router) is gone."""
    logging.basicConfig(level="WARNING", format="[tokenizer] %(levelname)s %(message)s")
    import signal

    from radixserve.serving.prompts import PromptCodec
    from radixserve.serving.shutdown import die_with_parent, freeze_startup_objects

    secret = os.environ.pop(SECRET_ENV, "")
    die_with_parent()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # holds no state worth a clean exit
    if os.getppid() != parent_pid:
        return 1
    codec = PromptCodec(_load_tokenizer(tokenizer))
    # The first encode builds the chat template and the tokenizer's lazy state: pay for
    # it before saying ready, not in the first request's time to first token.
    for warm in (
        EncodeJob(-1, messages=[p.ChatMessage(role="user", content="Hello.")]),
        EncodeJob(-1, text="Hello."),
        EncodeJob(-1, texts=["Hello."]),
    ):
        _encode(codec, warm)
    freeze_startup_objects()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(connect)
    sock.send(_encoder.encode(PoolReady(os.getpid(), secret)))
    while True:
        if not sock.poll(1000):
            if os.getppid() != parent_pid:
                return 0
            continue
        try:
            job = _to_pool.decode(sock.recv())
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.error("bad job: %s", exc)
            continue
        if isinstance(job, PoolStop):
            return 0
        sock.send(_encoder.encode(_encode(codec, job)))


if __name__ == "__main__":
    from radixserve.serving.shutdown import exit_now

    # Started by TokenizerPool only (not a user command): ENDPOINT TOKENIZER PARENT_PID.
    endpoint, tokenizer, parent_pid = sys.argv[1:4]
    exit_now(run_tokenizer_process(endpoint, tokenizer, int(parent_pid)))
