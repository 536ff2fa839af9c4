"""What a program sees as `s`: ProgramState, and the ProgramStateGroup that `s.fork(n)` returns."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

from .interpreter import StreamExecutor
from .ir import Expr, ExprLike, RoleBegin, RoleEnd, VarScopeBegin, VarScopeEnd, as_expr
from .ir import assistant as _assistant
from .ir import system as _system
from .ir import user as _user


class ProgramState:
    """`s += text | expr`; `s["name"]` waits for a value; roles, var scopes, fork, streaming."""

    def __init__(self, executor: StreamExecutor):
        self._executor = executor
        self.ret_value: Any = None  # what the program function returned

    # ---- building ----------------------------------------------------------------------------

    def __iadd__(self, other: ExprLike) -> "ProgramState":
        self._executor.submit(as_expr(other))
        return self

    def system(self, expr: ExprLike | None = None) -> Any:
        return self._role("system", expr, _system)

    def user(self, expr: ExprLike | None = None) -> Any:
        return self._role("user", expr, _user)

    def assistant(self, expr: ExprLike | None = None) -> Any:
        return self._role("assistant", expr, _assistant)

    def _role(self, role: str, expr: ExprLike | None, build: Callable[[ExprLike], Expr]) -> Any:
        """`s.user("hi")` adds a whole turn; `with s.user(): ...` wraps what the block adds."""
        if expr is not None:
            self += build(expr)
            return None
        return self._role_scope(role)

    @contextmanager
    def _role_scope(self, role: str) -> Iterator[None]:
        self._executor.submit(RoleBegin(role))
        yield
        self._executor.submit(RoleEnd(role))

    @contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        """Everything the block adds becomes variable `name` too."""
        self._executor.submit(VarScopeBegin(name))
        yield
        self._executor.submit(VarScopeEnd(name))

    def fork(self, size: int = 1) -> "ProgramStateGroup":
        """`size` copies of this state that continue independently (and concurrently). The text
        so far is first computed into the server's cache, so the branches share its KV."""
        return ProgramStateGroup([ProgramState(e) for e in self._executor.fork(size)], self)

    # ---- reading -----------------------------------------------------------------------------

    def __getitem__(self, name: str) -> Any:
        return self._executor.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self._executor.set_var(name, value)

    def __contains__(self, name: str) -> bool:
        return self._executor.has_var(name)

    def get_var(self, name: str) -> Any:
        return self._executor.get_var(name)

    def set_var(self, name: str, value: Any) -> None:
        self._executor.set_var(name, value)

    def get_meta_info(self, name: str) -> Any:
        """The server's meta_info of the gen/select that set `name` (waits for it)."""
        return self._executor.get_meta_info(name)

    def text(self) -> str:
        self._executor.sync()
        return self._executor.text_

    def messages(self) -> list[dict[str, Any]]:
        """The complete chat turns so far, as OpenAI-style {"role", "content"} dicts."""
        self._executor.sync()
        return [dict(m) for m in self._executor.messages_]

    def sync(self) -> None:
        self._executor.sync()

    def error(self) -> BaseException | None:
        """The exception that stopped the program, or None (waits for a streaming run to end)."""
        self._executor.settle()
        return self._executor.error_

    def text_iter(self, var: str | None = None) -> Iterator[str]:
        """With `run(stream=True)`: the text (or one variable's) piece by piece as it is
        generated, ending when it is final. Without streaming: the final text in one piece."""
        if not self._executor.stream:
            yield self.text() if var is None else self[var]
            return
        yield from self._executor.text_iter(var)

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"


class ProgramStateGroup:
    """The branches of a fork: `+=` (one expr for all, a list with one per branch, or
    `lambda i: ...`), indexing, iteration, and `join()`."""

    def __init__(self, states: list[ProgramState], parent: ProgramState):
        self.states = states
        self._parent = parent
        self._names_at_fork = set(parent._executor.variables)

    def __iadd__(self, other: Any) -> "ProgramStateGroup":
        if callable(other) and not isinstance(other, Expr):
            items = [other(i) for i in range(len(self.states))]
        elif isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(f"fork group: got {len(other)} items for {len(self.states)} branches")
            items = list(other)
        else:
            items = [other] * len(self.states)
        exprs = [as_expr(item) for item in items]  # check all before submitting any
        for state, expr in zip(self.states, exprs):
            state += expr
        return self

    def __getitem__(self, index: int) -> ProgramState:
        return self.states[index]

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __len__(self) -> int:
        return len(self.states)

    def join(self) -> None:
        """Waits for every branch, then sets each variable the branches created in the parent
        as a list with one value per branch. A branch's error is raised here."""
        for state in self.states:
            state._executor.end()
        for state in self.states:
            state._executor.wait_finished()
        errors = [s._executor.error_ for s in self.states if s._executor.error_ is not None]
        if errors:
            raise errors[0]
        new_names: list[str] = []
        for state in self.states:
            new_names += [n for n in state._executor.variables if n not in self._names_at_fork and n not in new_names]
        for name in new_names:
            self._parent[name] = [s._executor.variables.get(name) for s in self.states]
