"""``@program``: a Python function ``f(s, ...)`` becomes a prompt program you can run and batch.

```python
@program
def qa(s, question):
    s += system("You answer in one word.")
    s += user(question)
    s += assistant(gen("answer", max_tokens=8, temperature=0))

state = qa.run(question="Capital of France?", backend=backend)
state["answer"], state.usage.hit_rate
states = qa.run_batch([{"question": q} for q in questions], concurrency=16, progress_bar=True)
```

Each run gets a fresh program id (shared by its forks) that its backend calls carry as
their session, so a router keeps the run on one worker and the engine keeps the run's
context leased between its calls; the run's end closes that session (releases the lease).
A run given ``program_id=`` leaves its session open for a later run with the same id:
``backend.close_session(id)`` ends it, and closing the backend ends every one still open.
``run_batch`` lets the first program's first call reach the engine before starting the
others, so the prefix they share (a system prompt, few-shot examples) is computed once and
found in the radix cache by everyone else.
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
import uuid
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from frontend_dsl.backend import Backend, BackendError
from frontend_dsl.chat_template import RoleFormat
from frontend_dsl.ir import normalize_sampling
from frontend_dsl.state import ProgramState, RunContext
from frontend_dsl.usage import ProgramUsage, total_usage

__all__ = [
    "Program",
    "program",
    "function",
    "set_default_backend",
    "get_default_backend",
    "batch_usage",
]

_default_backend: Backend | None = None
_roles_cache: weakref.WeakKeyDictionary[Backend, RoleFormat] = weakref.WeakKeyDictionary()
_roles_lock = threading.Lock()


def set_default_backend(backend: Backend | None) -> None:
    """The backend programs use when ``run`` is given none."""
    global _default_backend
    _default_backend = backend


def get_default_backend() -> Backend:
    if _default_backend is None:
        raise RuntimeError(
            "no backend: pass backend=... or call frontend_dsl.set_default_backend(...)"
        )
    return _default_backend


def roles_for(backend: Backend) -> RoleFormat:
    """The role markers of ``backend``'s model, derived once per backend from its chat template."""
    with _roles_lock:
        roles = _roles_cache.get(backend)
    if roles is None:
        info = backend.model_info()
        roles = RoleFormat.from_template(info.chat_template, info.special_tokens)
        with _roles_lock:
            _roles_cache[backend] = roles
    return roles


def batch_usage(states: Iterable[ProgramState]) -> ProgramUsage:
    """Total tokens sent / reused over many program runs."""
    return total_usage(s.usage for s in states)


class Program:
    """A prompt program: call ``run`` (or the object itself), ``run_batch``."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        functools.update_wrapper(self, fn)

    def __repr__(self) -> str:
        return f"<program {getattr(self.fn, '__qualname__', self.fn)}>"

    def _new_state(
        self, backend: Backend | None, defaults: Mapping[str, Any] | None, program_id: str | None
    ) -> ProgramState:
        backend = backend or get_default_backend()
        ctx = RunContext(
            backend=backend,
            program_id=program_id or uuid.uuid4().hex,
            roles=roles_for(backend),
            defaults=normalize_sampling(defaults or {}),
            owns_session=program_id is None,
        )
        return ProgramState(ctx)

    def _execute(
        self, state: ProgramState, args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> ProgramState:
        try:
            state.ret_value = self.fn(state, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - surfaced on the state
            state._fail(exc)
        finally:
            state._sync_tree()
            state._ctx.first_output.set()
            _end_session(state)
            state._finish()
        return state

    def run(
        self,
        *args: Any,
        backend: Backend | None = None,
        stream: bool = False,
        defaults: Mapping[str, Any] | None = None,
        program_id: str | None = None,
        **kwargs: Any,
    ) -> ProgramState:
        """Run the program once and return its state.

        ``defaults``: sampling parameters for every ``gen`` that does not set them (e.g.
        ``{"temperature": 0}``). ``stream=True`` returns at once while the program runs in
        a thread; read it with ``state.text_iter()`` and ``state.wait()``. Errors do not
        raise here: they are on ``state.error`` (``state.raise_for_error()`` raises them).
        """
        state = self._new_state(backend, defaults, program_id)
        if stream:
            threading.Thread(
                target=self._execute,
                args=(state, args, kwargs),
                daemon=True,
                name=f"dsl-program-{state.program_id[:8]}",
            ).start()
            return state
        return self._execute(state, args, kwargs)

    __call__ = run

    def run_batch(
        self,
        batch: Sequence[Mapping[str, Any] | Sequence[Any]],
        *,
        backend: Backend | None = None,
        concurrency: int = 16,
        progress_bar: bool = False,
        defaults: Mapping[str, Any] | None = None,
        warmup: bool = True,
    ) -> list[ProgramState]:
        """Run the program on each item of ``batch`` (a kwargs dict or an args tuple).

        At most ``concurrency`` programs run at once (their backend calls batch together in
        the engine). ``warmup``: start with the first item alone until its first call has
        produced output, so the prefix the batch shares is cached before the others ask
        for it. Returns the states in input order; failures are on each state's ``error``.
        """
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        if any(
            isinstance(item, (str, bytes)) for item in batch
        ):  # tuple("q1") would be two arguments
            raise TypeError(
                "run_batch items are kwargs dicts or args tuples; wrap a single argument as (arg,)"
            )
        items = [
            (dict(item), ()) if isinstance(item, Mapping) else ({}, tuple(item)) for item in batch
        ]
        states = [self._new_state(backend, defaults, None) for _ in items]
        if not states:
            return []
        bar = None
        if progress_bar:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(states), desc=getattr(self.fn, "__name__", "program"), unit="prog")
        with concurrent.futures.ThreadPoolExecutor(
            max_workers=concurrency, thread_name_prefix="dsl-batch"
        ) as pool:
            futures = []

            done: list[ProgramState] = []
            lock = threading.Lock()

            def finished(state: ProgramState) -> None:
                assert bar is not None
                with lock:  # the bar shows the batch's reuse so far
                    done.append(state)
                    bar.set_postfix(hit_rate=f"{batch_usage(done).hit_rate:.2f}", refresh=False)
                    bar.update(1)

            def launch(i: int) -> None:
                kwargs, args = items[i]
                fut = pool.submit(self._execute, states[i], args, kwargs)
                if bar is not None:
                    fut.add_done_callback(lambda f: finished(f.result()))
                futures.append(fut)

            launch(0)
            if warmup and len(states) > 1:
                states[0]._ctx.first_output.wait()
            for i in range(1, len(states)):
                launch(i)
            for fut in futures:
                fut.result()
        if bar is not None:
            bar.close()
        return states


def _end_session(state: ProgramState) -> None:
    """The run is over: release its session's lease now rather than when it runs out (a
    failure to reach the backend leaves the lease to expire; the run's result stands)."""
    ctx = state._ctx
    if not ctx.owns_session:
        return
    try:
        ctx.backend.close_session(ctx.program_id)
    except BackendError:
        pass


def program(fn: Callable[..., Any]) -> Program:
    """Decorator: turn ``fn(s, ...)`` into a ``Program``."""
    return Program(fn)


# SGLang spells it `function`; both names work.
function = program
