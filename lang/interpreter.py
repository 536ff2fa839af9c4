"""The interpreter: executes a program state's expressions in order on a backend.

Each state has one worker thread (started on first use) that runs its expressions in the
order they were added, so `s += gen(...)` returns at once and the program's Python code runs
ahead until it reads a value (`s["x"]` waits for it). Fork branches have their own workers,
which is what runs them concurrently. The first failure stops a state: later expressions are
skipped and every reader of a value not yet set gets the exception.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Iterator

from .backend import Backend, BackendError, Generation, Prompt
from .chat_template import ChatRenderer
from .choices import ChoiceDecision
from .ir import (CommitPrefix, Constant, Expr, ExprList, Gen, Image, RoleBegin, RoleEnd, Select,
                 VarScopeBegin, VarScopeEnd, names_in, reasoning_name)
from .sampling import SglSamplingParams

_END = object()  # the worker's stop signal


class StreamExecutor:
    def __init__(self, backend: Backend, defaults: SglSamplingParams, stream: bool = False,
                 chat: ChatRenderer | None = None, threaded: bool = True):
        self.backend = backend
        self.defaults = defaults
        self.stream = stream
        self.threaded = threaded  # False: run each expression inline (the tracer)
        self.text_ = ""
        self.messages_: list[dict[str, Any]] = []
        self.images_: list[str] = []  # the text's images in order (data URLs)
        self.variables: dict[str, Any] = {}
        self.meta_info: dict[str, Any] = {}
        self.partial: dict[str, str] = {}  # streaming gens' text so far
        self.error_: BaseException | None = None
        self.finished = False
        self.children: list[StreamExecutor] = []
        self._chat = chat
        self._role: str | None = None
        self._role_start = self._content_start = 0
        self._calls: list[tuple[int, int, str | None, list[dict[str, Any]]]] = []  # see _gen_set
        self._scopes: dict[str, int] = {}
        self._pending: dict[str, int] = {}  # submitted names -> how many sets are still to come
        self._cond = threading.Condition()
        self._queue: queue.Queue = queue.Queue()
        self._worker: threading.Thread | None = None
        self._ended = False
        self.program_thread: threading.Thread | None = None  # the thread running the program function
        self.session_id: str | None = None  # the server session this state's calls keep warm

    # ---- submitting and waiting -------------------------------------------------------------

    def submit(self, expr: Expr) -> None:
        with self._cond:
            if self._ended:
                raise RuntimeError("this program state has ended; it takes no more expressions")
            for name in names_in(expr):
                self._pending[name] = self._pending.get(name, 0) + 1
        if not self.threaded:
            self._execute(expr)
            return
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, name="radixlm-program", daemon=True)
            self._worker.start()
        self._queue.put(expr)

    def sync(self) -> None:
        """Waits until every expression submitted so far has run (or been skipped by an error)."""
        self._queue.join()

    def end(self) -> None:
        """No more expressions; the worker stops after the queued ones. Ends fork branches too."""
        for child in self.children:
            child.end()
        with self._cond:
            if self._ended:
                return
            self._ended = True
            if self._worker is None:
                self.finished = True
                self._cond.notify_all()
                return
        self._queue.put(_END)

    def settle(self) -> None:
        """From the program's own thread: waits for what it submitted so far. From any other
        thread (a caller of a streaming run): waits for the whole program to end."""
        if self.program_thread is None or threading.current_thread() is self.program_thread:
            self.sync()
        else:
            self.wait_finished()

    def sessions(self) -> list[str]:
        """The session ids of this state and its fork branches, to end when the program ends."""
        own = [self.session_id] if self.session_id else []
        return own + [sid for child in self.children for sid in child.sessions()]

    def wait_finished(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self.finished)

    def record_error(self, error: BaseException) -> None:
        with self._cond:
            if self.error_ is None:
                self.error_ = error
            self._cond.notify_all()

    def get_var(self, name: str) -> Any:
        with self._cond:
            self._cond.wait_for(lambda: not self._pending.get(name) or self.error_ is not None)
            if self._pending.get(name) and self.error_ is not None:
                raise self.error_
            if name not in self.variables:
                raise KeyError(f"no variable {name!r} in this program state (known: {sorted(self.variables)})")
            return self.variables[name]

    def set_var(self, name: str, value: Any) -> None:
        with self._cond:
            self.variables[name] = value
            self._cond.notify_all()

    def has_var(self, name: str) -> bool:
        with self._cond:
            return name in self.variables or bool(self._pending.get(name))

    def get_meta_info(self, name: str) -> Any:
        self.get_var(name)
        with self._cond:
            return self.meta_info.get(name)

    def text_iter(self, var: str | None) -> Iterator[str]:
        """New text as it arrives (of the whole state, or of one variable) until it is final."""
        sent = 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._current(var) is not None and len(self._current(var)) > sent
                                    or self._var_done(var))
                done = self._var_done(var)
                current = self._current(var) or ""
            if len(current) > sent:
                yield current[sent:]
                sent = len(current)
            if done:
                return

    def _current(self, var: str | None) -> str | None:
        if var is None:
            return self.text_
        if var in self.partial and self._pending.get(var):
            return self.partial[var]
        value = self.variables.get(var)
        return value if isinstance(value, str) else None

    def _var_done(self, var: str | None) -> bool:
        if self.finished or self.error_ is not None:
            return True
        return var is not None and var in self.variables and not self._pending.get(var)

    # ---- fork --------------------------------------------------------------------------------

    def fork(self, size: int) -> list["StreamExecutor"]:
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"fork: size must be an integer >= 1, got {size!r}")
        if size > 1:
            self.submit(CommitPrefix())  # the worker knows the final trunk text; this thread may not yet
        self.sync()
        if self.error_ is not None:
            raise self.error_
        branches = []
        for _ in range(size):
            child = StreamExecutor(self.backend, self.defaults, self.stream, self._chat, self.threaded)
            child.program_thread = self.program_thread
            child.session_id = self.backend.session_id() if self.session_id else None  # branches diverge
            child.text_, child.messages_, child.images_ = self.text_, list(self.messages_), list(self.images_)
            child.variables, child.meta_info = dict(self.variables), dict(self.meta_info)
            child._role, child._role_start, child._content_start = self._role, self._role_start, self._content_start
            child._calls = list(self._calls)
            branches.append(child)
        self.children.extend(branches)
        return branches

    # ---- execution ---------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            expr = self._queue.get()
            try:
                if expr is _END:
                    with self._cond:
                        self.finished = True
                        self._cond.notify_all()
                    return
                if self.error_ is None:
                    self._execute(expr)
            except BaseException as e:  # stored and raised to readers; never kills the program silently
                self.record_error(e)
            finally:
                self._queue.task_done()

    def _execute(self, expr: Expr) -> None:
        if isinstance(expr, Constant):
            self._append(expr.value)
        elif isinstance(expr, ExprList):
            for item in expr.items:
                self._execute(item)
        elif isinstance(expr, Gen):
            self._gen(expr)
        elif isinstance(expr, Select):
            self._select(expr)
        elif isinstance(expr, RoleBegin):
            self._role_begin(expr.role, expr.call_id)
        elif isinstance(expr, RoleEnd):
            self._role_end(expr.role, expr.call_id)
        elif isinstance(expr, VarScopeBegin):
            self._scopes[expr.name] = len(self.text_)
        elif isinstance(expr, VarScopeEnd):
            start = self._scopes.pop(expr.name, None)
            if start is None:
                raise ValueError(f"var_scope {expr.name!r} ended without beginning")
            self._set(expr.name, self.text_[start:], None)
        elif isinstance(expr, Image):
            self._append_image(expr.data_url)
        elif isinstance(expr, CommitPrefix):
            if self.text_:
                self.backend.cache_prefix(self.text_, *self.prefix_images())
        else:
            raise TypeError(f"unknown expression {expr!r}")

    def _append(self, text: str) -> None:
        with self._cond:
            self.text_ += text
            self._cond.notify_all()

    def prefix_images(self) -> tuple:
        """cache_prefix's extra argument: the images, only when there are any (so a backend
        written before images, with cache_prefix(text), keeps working)."""
        return (tuple(self.images_),) if self.images_ else ()

    def _append_image(self, data_url: str) -> None:
        token = self.backend.image_token()
        with self._cond:
            self.images_.append(data_url)
            self.text_ += token
            self._cond.notify_all()

    def _set(self, name: str | None, value: Any, meta: Any) -> None:
        if name is None:
            return
        with self._cond:
            self.variables[name] = value
            self.meta_info[name] = meta
            self.partial.pop(name, None)
            if self._pending.get(name):
                self._pending[name] -= 1
            self._cond.notify_all()

    def _prompt(self, lora_path: str | None = None) -> Prompt:
        content = self.text_[self._content_start:] if self._role else ""
        return Prompt(self.text_, tuple(self.messages_), self._role, content, lora_path, self.session_id,
                      tuple(self.images_))

    # A gen is three steps: its request (prompt and parameters), the backend call (sync here,
    # awaited in aio.py), and its result into the text and variables.

    def _gen(self, expr: Gen) -> None:
        prompt, params = self._gen_request(expr)
        if self._streams(params):
            self._gen_streamed(expr, self.backend.generate_stream(prompt, params))
        else:
            self._gen_finish(expr, params, self.backend.generate(prompt, params))

    def _gen_request(self, expr: Gen) -> tuple[Prompt, SglSamplingParams]:
        params = self.defaults.merged(expr.params)
        if expr.reader is not None:
            if expr.reader.tools is not None:
                self._render_tools(expr.reader.chat(self.backend))
            params = expr.reader.constrain(params)
        return self._prompt(params.lora_path), params

    def _render_tools(self, chat: ChatRenderer) -> None:
        """The conversation so far, rendered with the gen's tools as /v1/chat/completions renders
        it (the tools change earlier text, e.g. the system message); later turns render so too."""
        if self._role != "assistant":
            raise ValueError("gen(tools=...) generates an assistant turn: s += assistant(gen(\"call\", tools=[...]))")
        if self.text_[:self._role_start] != self._renderer().render(self.messages_):
            raise ValueError("gen(tools=...) renders the conversation again with the tools, so the program's text "
                             "before this turn must be chat turns only")
        before = chat.render(self.messages_)
        opening = before + chat.begin(self.messages_, "assistant")
        with self._cond:
            self.text_ = opening + self.text_[self._content_start:]
            self._role_start, self._content_start, self._chat = len(before), len(opening), chat
            self._cond.notify_all()

    def _streams(self, params: SglSamplingParams) -> bool:
        return self.stream and (params.n or 1) == 1

    def _gen_finish(self, expr: Gen, params: SglSamplingParams, result: Generation) -> None:
        self._append(result.texts[0])
        one = len(result.texts) == 1 and (params.n or 1) == 1
        value = result.texts[0] if one else result.texts
        meta = result.meta_infos[0] if one and result.meta_infos else result.meta_infos
        self._gen_set(expr, value, meta)

    def _gen_streamed(self, expr: Gen, chunks: Iterator[tuple[str, dict[str, Any]]]) -> None:
        value, meta = "", None
        self._stream_begin(expr.name)
        for delta, meta in chunks:
            value = self._stream_delta(expr.name, value, delta)
        self._gen_set(expr, value, meta)

    def _gen_set(self, expr: Gen, value: Any, meta: Any) -> None:
        """Sets a gen's variable (its output ends the text by now). With separate_reasoning it
        holds the answer, the think block going to `<name>_reasoning_content`; with tools, the
        calls ([] when the model answered in text: that text stays the turn's content). Calls are
        kept with the output's place in the turn, which its message replaces by the content."""
        if expr.reader is None:
            self._set(expr.name, value, meta)
            return
        start = len(self.text_) - len(value)
        value, message = expr.reader.read(value, self.text_[:start], self._chat)
        if expr.reader.reasoning is not None:
            self._set(reasoning_name(expr.name), message["reasoning_content"], meta)
        if message.get("tool_calls"):
            self._calls.append((start - self._content_start, len(self.text_) - self._content_start,
                                message["content"], message["tool_calls"]))
        self._set(expr.name, value, meta)

    def _stream_begin(self, name: str | None) -> None:
        if name is not None:
            with self._cond:
                self.partial[name] = ""

    def _stream_delta(self, name: str | None, value: str, delta: str) -> str:
        value += delta
        with self._cond:
            self.text_ += delta
            if name is not None:
                self.partial[name] = value
            self._cond.notify_all()
        return value

    def _select(self, expr: Select) -> None:
        self._select_finish(expr, self.backend.select(self._select_prompt(expr), expr.choices, expr.temperature,
                                                      expr.method))

    def _select_prompt(self, expr: Select) -> Prompt:
        return self._prompt(expr.lora_path if expr.lora_path is not None else self.defaults.lora_path)

    def _select_finish(self, expr: Select, decision: ChoiceDecision) -> None:
        if decision.decision not in expr.choices:  # a backend bug must not leak a non-choice
            raise BackendError(f"select: the backend decided {decision.decision!r}, not one of the choices")
        self._append(decision.decision)
        self._set(expr.name, decision.decision, decision.meta_info)

    # ---- roles -------------------------------------------------------------------------------

    def _renderer(self) -> ChatRenderer:
        if self._chat is None:
            self._chat = self.backend.get_chat_template()
        return self._chat

    def _role_begin(self, role: str, call_id: str | None = None) -> None:
        if self._role is not None:
            raise ValueError(f"a {role} turn cannot begin inside the open {self._role} turn (roles do not nest)")
        if call_id is not None and call_id not in {c["id"] for m in self.messages_ for c in m.get("tool_calls", ())}:
            raise ValueError(f"tool(call_id={call_id!r}): no earlier assistant turn made a call with this id")
        prefix = self._renderer().begin(self.messages_, role, {"tool_call_id": call_id} if call_id else None)
        self._role_start = len(self.text_)
        self._append(prefix)
        self._role, self._content_start, self._calls = role, len(self.text_), []

    def _role_end(self, role: str, call_id: str | None = None) -> None:
        if self._role != role:
            raise ValueError(f"{role}_end() without a matching {role}_begin() (open turn: {self._role})")
        message = self._turn_message(role, self.text_[self._content_start:], call_id)
        keep, tail = self._renderer().end(self.messages_, message, self.text_[self._role_start:])
        with self._cond:
            self.text_ = self.text_[:self._role_start] + keep + tail
            self.messages_.append(message)
            self._role = None
            self._cond.notify_all()

    def _turn_message(self, role: str, content: str, call_id: str | None) -> dict[str, Any]:
        """A tool result names the call it answers; an assistant turn that made calls holds
        them, its content being the turn's text with each calling output replaced by what the
        model wrote besides the calls (as /v1/chat/completions returns the message)."""
        if call_id is not None:
            return {"role": role, "content": content, "tool_call_id": call_id}
        if not self._calls:
            return {"role": role, "content": content}
        for start, end, text, _ in reversed(self._calls):
            content = content[:start] + (text or "") + content[end:]
        return {"role": role, "content": content or None, "tool_calls": [c for *_, calls in self._calls for c in calls]}
