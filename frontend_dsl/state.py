"""``ProgramState``: the ``s`` of a program — its text, variables, messages and streams.

``s += expr`` queues the expression and returns at once; a runner thread owned by the
state evaluates queued expressions in order (cheap ones — text and role markers — run
inline when nothing is queued). So ``for f in s.fork(4): f += gen("x")`` starts four
generations that the engine batches together, and reading ``s["x"]`` or ``s.text()``
waits for what it needs. An exception in any expression is stored on the state
(``s.error``), drops what is still queued, and re-surfaces as ``ProgramError`` when the
program reads a value that was never produced — it is never lost in a thread.

```
 program thread:  s += "Q: ..."   s += gen("a")   s += "\n"   ... s["a"] (waits)
                        │               │              │
 state runner:     [Text] ──────> [Gen: backend.generate(text so far) ─ stream ─> text, var a] ─> [Text]
```
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from frontend_dsl.calls import RunContext, markers_of, run_gen, run_select
from frontend_dsl.ir import (
    Expr,
    Gen,
    Role,
    RoleBegin,
    RoleEnd,
    Select,
    Seq,
    Text,
    ToolResult,
    to_expr,
)
from frontend_dsl.usage import ProgramUsage

__all__ = ["ForkGroup", "ProgramError", "ProgramState", "RunContext"]


class ProgramError(RuntimeError):
    """Raised when a program reads a result its state failed to produce; ``__cause__`` is why."""


@dataclass(frozen=True)
class _SetVars(Expr):
    """Internal: assign variables in queue order (``join`` uses it)."""

    values: dict[str, Any]


@dataclass(frozen=True)
class _Concat(Expr):
    """Internal: append a fork's text and the role messages it completed (``join("concat")``)."""

    text: str
    messages: tuple[dict[str, str], ...]


def _flatten(expr: Expr, out: list[Expr]) -> list[Expr]:
    if isinstance(expr, Seq):
        for item in expr.items:
            _flatten(item, out)
    elif isinstance(expr, Role):
        out.append(RoleBegin(expr.role, expr.tools))
        _flatten(expr.body, out)
        out.append(RoleEnd(expr.role, expr.tools))
    else:
        out.append(expr)
    return out


def _produces(op: Expr) -> list[str]:
    """The variable names ``op`` assigns when it runs."""
    if isinstance(op, (Gen, Select)):
        return [op.name] if op.name is not None else []
    if isinstance(op, _SetVars):
        return list(op.values)
    return []


def _is_cheap(op: Expr) -> bool:
    return not isinstance(op, (Gen, Select))


class ProgramState:
    """The state of one running program (or of one fork of it)."""

    def __init__(self, ctx: RunContext, parent: ProgramState | None = None) -> None:
        self._ctx = ctx
        self._cv = threading.Condition()
        self._queue: collections.deque[Expr] = collections.deque()
        self._busy = False
        self._error: BaseException | None = None
        self._finished = False
        self._children: list[ProgramState] = []
        self._events: list[tuple[str | None, str]] = []
        self._assigned: list[str] = []  # names assigned since this state was created (for join)
        # Queued expressions that will (re)assign each name: a read waits for them, so that a
        # name reused in a loop, or inherited by a fork, never returns its previous value.
        self._pending: collections.Counter[str] = collections.Counter()
        self.ret_value: Any = None
        if parent is None:
            self._text = ""
            self._vars: dict[str, Any] = {}
            self._meta: dict[str, dict[str, Any]] = {}
            self._messages: list[dict[str, str]] = []
            self._open: tuple[str, int] | None = None
            self._sent_upto = 0  # text length covered by the last backend call
            self._tools: str | None = None  # the tools a system turn declared (JSON text)
        else:
            self._text, self._vars, self._meta = (
                parent._text,
                dict(parent._vars),
                dict(parent._meta),
            )
            self._messages, self._open = [dict(m) for m in parent._messages], parent._open
            self._sent_upto, self._error = parent._sent_upto, parent._error
            self._tools = parent._tools
        # Where this state began (a fork): join("concat") carries over what came after.
        self._fork_len, self._fork_msgs, self._fork_open = (
            len(self._text),
            len(self._messages),
            self._open,
        )

    # ---------------------------------------------------------------- appending
    def __iadd__(self, expr: Any) -> ProgramState:
        self._submit(_flatten(to_expr(expr), []))
        return self

    def _submit(self, ops: list[Expr]) -> None:
        with self._cv:
            if self._error is not None:
                return  # a failed state ignores further work; the error is already recorded
            self._queue.extend(ops)
            for op in ops:
                self._pending.update(_produces(op))
            if self._busy:
                return
            self._busy = True
        self._drain(inline=True)

    def _drain(self, inline: bool) -> None:
        """Run queued ops in order; ``inline`` hands off to a thread at the first expensive op."""
        while True:
            with self._cv:
                if not self._queue:
                    self._busy = False
                    self._cv.notify_all()
                    return
                if inline and not _is_cheap(self._queue[0]):
                    threading.Thread(
                        target=self._drain,
                        args=(False,),
                        daemon=True,
                        name=f"dsl-{self._ctx.program_id[:8]}",
                    ).start()
                    return
                op = self._queue.popleft()
            try:
                self._execute(op)
            except BaseException as exc:  # noqa: BLE001 - stored on the state, re-raised on read
                self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        with self._cv:
            if self._error is None:
                self._error = exc
            self._queue.clear()
            self._pending.clear()
            self._cv.notify_all()

    def _append(self, text: str, var: str | None = None) -> None:
        if not text:
            return
        with self._cv:
            self._text += text
            self._events.append((var, text))
            self._cv.notify_all()

    def _assign(self, name: str | None, value: Any, meta: dict[str, Any] | None = None) -> None:
        if name is None:
            return
        with self._cv:
            self._vars[name] = value
            if self._pending[name] > 0:
                self._pending[name] -= 1
            if meta is not None:
                self._meta[name] = meta
            if name not in self._assigned:
                self._assigned.append(name)
            self._cv.notify_all()

    # ---------------------------------------------------------------- evaluation
    def _execute(self, op: Expr) -> None:
        if isinstance(op, Text):
            self._append(op.text)
        elif isinstance(op, RoleBegin):
            if self._open is not None:
                raise ValueError(
                    f"cannot open role {op.role!r}: role {self._open[0]!r} is still open"
                )
            if op.tools is not None:
                self._tools = op.tools
                self._append(markers_of(self._ctx, op.tools).system_prefix)
            else:
                self._append(self._ctx.roles.open(op.role, first=not self._text))
            self._open = (op.role, len(self._text))
        elif isinstance(op, RoleEnd):
            if self._open is None or self._open[0] != op.role:
                raise ValueError(
                    f"cannot close role {op.role!r}: open role is {self._open and self._open[0]!r}"
                )
            self._messages.append({"role": op.role, "content": self._text[self._open[1] :]})
            self._open = None
            if op.tools is not None:
                self._append(markers_of(self._ctx, op.tools).system_suffix)
            else:
                self._append(self._ctx.roles.close(op.role))
        elif isinstance(op, ToolResult):
            self._append_tool_result(op)
        elif isinstance(op, Gen):
            run_gen(self, op)
        elif isinstance(op, Select):
            run_select(self, op)
        elif isinstance(op, _SetVars):
            for name, value in op.values.items():
                self._assign(name, value)
        elif isinstance(op, _Concat):
            self._append(op.text)
            self._messages.extend(dict(m) for m in op.messages)
        else:
            raise TypeError(f"unknown expression {op!r}")

    def _append_tool_result(self, op: ToolResult) -> None:
        if self._open is not None:
            raise ValueError(f"cannot append a tool result: role {self._open[0]!r} is open")
        if self._tools is None:
            raise ValueError("a tool result needs tools declared first: system(..., tools=[...])")
        marks = markers_of(self._ctx, self._tools)
        self._append(marks.result_prefix + op.content + marks.result_suffix)
        msg = {"role": "tool", "content": op.content}
        if op.call_id is not None:
            msg["tool_call_id"] = op.call_id
        self._messages.append(msg)

    # ---------------------------------------------------------------- reading
    def sync(self) -> ProgramState:
        """Wait until every queued expression has run (or the state failed)."""
        with self._cv:
            self._cv.wait_for(lambda: not self._busy and not self._queue)
        return self

    def _sync_tree(self) -> None:
        self.sync()
        for child in list(self._children):
            child._sync_tree()

    def __getitem__(self, name: str) -> Any:
        """The value of variable ``name``, waiting for the expression that produces it."""
        with self._cv:
            self._cv.wait_for(
                lambda: (
                    (name in self._vars and not self._pending[name])
                    or self._error is not None
                    or (not self._busy and not self._queue)
                )
            )
            if name in self._vars:
                return self._vars[name]
            if self._error is not None:
                raise ProgramError(
                    f"variable {name!r} was not produced: {self._error!r}"
                ) from self._error
        raise KeyError(name)

    def get(self, name: str, default: Any = None) -> Any:
        try:
            return self[name]
        except (KeyError, ProgramError):
            return default

    def get_meta(self, name: str) -> dict[str, Any]:
        """Details of how ``name`` was produced: finish_reason and usage; for select, scores."""
        self[name]
        with self._cv:
            return dict(self._meta.get(name, {}))

    def set_var(self, name: str, value: Any) -> None:
        """Assign a variable in program order (after what is already queued)."""
        self._submit([_SetVars({name: value})])

    def variables(self) -> dict[str, Any]:
        self.sync()
        with self._cv:
            return dict(self._vars)

    def text(self) -> str:
        """The whole text so far (waits for queued expressions)."""
        self.sync()
        return self._text

    def __str__(self) -> str:
        return self.text()

    def messages(self) -> list[dict[str, str]]:
        """The completed role messages, as ``apply_chat_template`` takes them."""
        self.sync()
        with self._cv:
            return [dict(m) for m in self._messages]

    @property
    def error(self) -> BaseException | None:
        """The first exception the program or one of its expressions raised (None if none)."""
        return self._error

    @property
    def ok(self) -> bool:
        return self._error is None

    def raise_for_error(self) -> ProgramState:
        if self._error is not None:
            raise ProgramError(
                f"program {self._ctx.program_id} failed: {self._error!r}"
            ) from self._error
        return self

    @property
    def program_id(self) -> str:
        return self._ctx.program_id

    @property
    def usage(self) -> ProgramUsage:
        """Tokens sent / reused by the whole program run, forks included."""
        return self._ctx.meter.snapshot()

    # ---------------------------------------------------------------- roles as scopes
    def role(self, name: str) -> _RoleScope:
        """``with s.role("user"): ...`` — everything appended inside is the message's content."""
        return _RoleScope(self, name)

    def system(self) -> _RoleScope:
        return _RoleScope(self, "system")

    def user(self) -> _RoleScope:
        return _RoleScope(self, "user")

    def assistant(self) -> _RoleScope:
        return _RoleScope(self, "assistant")

    # ---------------------------------------------------------------- fork / join
    def fork(self, n: int = 1) -> ForkGroup:
        """``n`` states that continue from this one's text; their calls share its cached prefix."""
        if n < 1:
            raise ValueError(f"fork needs n >= 1, got {n}")
        self.sync()
        children = [ProgramState(self._ctx, parent=self) for _ in range(n)]
        with self._cv:
            self._children.extend(children)
        return ForkGroup(self, children)

    # ---------------------------------------------------------------- streaming
    def text_iter(self, var: str | None = None) -> Iterator[str]:
        """Yield text as it is appended (only variable ``var``'s if given) until the program ends."""
        index = 0
        while True:
            with self._cv:
                # wait_for calls the predicate before this iteration ends.
                self._cv.wait_for(lambda: len(self._events) > index or self._finished)  # noqa: B023
                new, index = self._events[index:], len(self._events)
                done = self._finished and not new
            for name, text in new:
                if var is None or name == var:
                    yield text
            if done:
                return

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the program (run with ``stream=True``) has finished; False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: self._finished, timeout)

    def _finish(self) -> None:
        """Called by the runner once the program function returned and every state is idle."""
        for child in list(self._children):
            child._finish()
        with self._cv:
            self._finished = True
            self._cv.notify_all()

    def __repr__(self) -> str:
        status = "failed" if self._error else ("finished" if self._finished else "running")
        return f"ProgramState(id={self._ctx.program_id[:8]}, {status}, vars={list(self._vars)})"


class _RoleScope:
    def __init__(self, state: ProgramState, role: str) -> None:
        self._state, self._role = state, role

    def __enter__(self) -> ProgramState:
        self._state._submit([RoleBegin(self._role)])
        return self._state

    def __exit__(self, *exc: object) -> None:
        self._state._submit([RoleEnd(self._role)])


class ForkGroup(list):
    """The states ``fork(n)`` returned; ``group["x"]`` lists each fork's ``x``."""

    def __init__(self, parent: ProgramState, states: list[ProgramState]) -> None:
        super().__init__(states)
        self._parent = parent

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            return [state[key] for state in self]
        return super().__getitem__(key)

    def join(self, mode: str = "gather") -> ProgramState:
        """Wait for every fork, then bring their results into the parent.

        ``mode="gather"``: each variable the forks assigned becomes, in the parent, the list
        of the forks' values (in fork order). ``mode="concat"``: the text each fork added is
        appended to the parent's, fork after fork. A fork's error becomes the parent's.
        """
        if mode not in ("gather", "concat"):
            raise ValueError(f"unknown join mode {mode!r}; use 'gather' or 'concat'")
        for state in self:
            state._sync_tree()
        errors = [s.error for s in self if s.error is not None]
        if errors:
            self._parent._fail(errors[0])
            return self._parent
        if mode == "gather":
            names: list[str] = []
            for state in self:
                names.extend(n for n in state._assigned if n not in names)
            self._parent._submit([_SetVars({n: [s._vars.get(n) for s in self] for n in names})])
        else:
            for s in self:
                if s._open != s._fork_open:
                    raise ValueError(
                        f"cannot concat a fork whose role {s._open and s._open[0]!r} is still open"
                    )
            self._parent._submit(
                [_Concat(s._text[s._fork_len :], tuple(s._messages[s._fork_msgs :])) for s in self]
            )
        return self._parent
