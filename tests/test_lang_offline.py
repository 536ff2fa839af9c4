"""The language without a server: a scripted backend stands in for the model, so these check
the interpreter's semantics (ordering, overrides, fork/join, errors, tracing, batches)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from typing import Any, Iterator

import pytest

import radixlm as sgl
from radixlm.backend import Backend, BackendError, Generation, Prompt
from radixlm.chat_template import ChatRenderer
from radixlm.choices import ChoiceDecision
from radixlm.sampling import SglSamplingParams


def chatml(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


class ScriptedBackend(Backend):
    """Answers gens with `reply(prompt, params)`; records every call."""

    def __init__(self, reply: Any = None, delay: float = 0.0):
        self.reply = reply or (lambda prompt, params: "X")
        self.delay = delay
        self.calls: list[tuple[str, Any]] = []
        self.lock = threading.Lock()

    def _record(self, kind: str, value: Any) -> None:
        with self.lock:
            self.calls.append((kind, value))

    def generate(self, prompt: Prompt, params: SglSamplingParams) -> Generation:
        self._record("generate", (prompt, params))
        time.sleep(self.delay)
        text = self.reply(prompt, params)
        if isinstance(text, Exception):
            raise text
        n = params.n or 1
        return Generation([text] * n, [{"prompt_tokens": len(prompt.text)}] * n)

    def generate_stream(self, prompt: Prompt, params: SglSamplingParams) -> Iterator[tuple[str, dict[str, Any]]]:
        self._record("stream", (prompt, params))
        text = self.reply(prompt, params)
        if isinstance(text, Exception):
            raise text
        for ch in text:
            time.sleep(self.delay)
            yield ch, {}

    def select(self, prompt: Prompt, choices: list[str], temperature: float, method: Any) -> ChoiceDecision:
        self._record("select", (prompt, choices))
        return method(choices, [[(-float(len(c)), 0)] for c in choices])  # shortest choice wins

    def cache_prefix(self, text: str) -> None:
        self._record("cache_prefix", text)

    def get_chat_template(self) -> ChatRenderer:
        return ChatRenderer(chatml)


def test_import_is_cheap_and_exports_sglang_names():
    code = "import sys, radixlm; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
    for name in ["function", "gen", "gen_int", "gen_string", "select", "system", "user", "assistant", "user_begin",
                 "user_end", "assistant_begin", "assistant_end", "system_begin", "system_end",
                 "set_default_backend", "Runtime", "RuntimeEndpoint", "OpenAI", "flush_cache", "__version__"]:
        assert hasattr(sgl, name), name


def test_sampling_params_keep_sglang_frontend_names():
    """The language's parameters are SglSamplingParams (sglang.lang.ir's name); like SGLang's
    frontend, the package exports no SamplingParams (that is the runtime's, other defaults)."""
    from radixlm.ir import SglSamplingParams

    assert SglSamplingParams().max_new_tokens is None and not hasattr(sgl, "SamplingParams")


def test_gen_values_override_run_values_and_unset_fields_stay_unset():
    backend = ScriptedBackend()

    @sgl.function
    def prog(s):
        s += "a" + sgl.gen("x", max_tokens=3, stop=["\n"])
        s += sgl.gen("y", temperature=0.5)

    prog.run(backend=backend, temperature=0, max_new_tokens=7, top_p=0.9)
    (_, (_, px)), (_, (_, py)) = backend.calls
    assert (px.max_new_tokens, px.temperature, px.top_p, px.stop) == (3, 0, 0.9, ("\n",))
    assert (py.max_new_tokens, py.temperature) == (7, 0.5)
    assert px.wire_sampling() == {"max_new_tokens": 3, "temperature": 0, "top_p": 0.9, "stop": ["\n"]}
    assert px.top_k is None and "top_k" not in px.wire_sampling()


def test_bad_input_raises_type_errors():
    backend = ScriptedBackend()

    @sgl.function
    def prog(s, q):
        s += q

    with pytest.raises(TypeError, match="unexpected keyword argument 'foo'"):
        sgl.gen("x", foo=1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        prog.run("hi", backend=backend, bogus=1)
    with pytest.raises(TypeError, match="None"):
        prog.run(None, backend=backend)
    with pytest.raises(TypeError, match="str"):
        prog.run(42, backend=backend)
    with pytest.raises(ValueError, match="choices"):
        sgl.select("x", [])
    with pytest.raises(TypeError, match="bind"):
        prog.bind(nope=1)


def test_program_order_text_and_variables():
    backend = ScriptedBackend(lambda prompt, params: f"<{len(prompt.text)}>")

    @sgl.function
    def prog(s, a):
        s += a + sgl.gen("first")
        s += "|" + sgl.gen("second")
        s["manual"] = 5
        return s["first"] + s["second"]

    state = prog.run("ab", backend=backend)
    assert state.text() == "ab<2>|<6>"
    assert state["first"] == "<2>" and state["second"] == "<6>" and state["manual"] == 5
    assert "first" in state and "missing" not in state
    assert state.ret_value == "<2><6>"
    assert state.get_meta_info("first") == {"prompt_tokens": 2}
    with pytest.raises(KeyError):
        state["missing"]


def test_roles_var_scope_and_messages():
    backend = ScriptedBackend(lambda prompt, params: "Paris")

    @sgl.function
    def prog(s):
        s += sgl.system("Be brief.")
        with s.user():
            s += "Capital of France?"
        s += sgl.assistant_begin()
        with s.var_scope("answer_text"):
            s += sgl.gen("answer")
        s += sgl.assistant_end()

    state = prog.run(backend=backend)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"},
                {"role": "assistant", "content": "Paris"}]
    assert state.messages() == messages
    assert state.text() == chatml(messages, False)
    prompt = backend.calls[0][1][0]
    assert prompt.text == chatml(messages[:2], True) and prompt.role == "assistant"
    assert state["answer_text"] == "Paris"


def test_nested_roles_and_unmatched_end_fail_the_program():
    backend = ScriptedBackend()

    @sgl.function
    def nested(s):
        s += sgl.user_begin()
        s += sgl.assistant("x")

    with pytest.raises(ValueError, match="do not nest"):
        nested.run(backend=backend)

    @sgl.function
    def unmatched(s):
        s += sgl.user_end()

    with pytest.raises(ValueError, match="without a matching"):
        unmatched.run(backend=backend)


def test_select_and_gen_choices_return_a_choice_with_scores():
    backend = ScriptedBackend()

    @sgl.function
    def prog(s):
        s += "Pick: " + sgl.select("a", ["long one", "short"]) + sgl.gen("b", choices=["xx", "y", "zzz"])

    state = prog.run(backend=backend)
    assert state["a"] == "short" and state["b"] == "y"
    assert state.text() == "Pick: shorty"
    assert state.get_meta_info("a")["scores"] == [-8.0, -5.0]


def test_choices_methods():
    choices = ["a", "b"]
    lps = [[(-1.0, 1), (-3.0, 2)], [(-1.5, 3)]]
    assert sgl.token_length_normalized(choices, lps).decision == "b"  # mean -1.5 > -2.0
    # Greedy: token 0 of "a" (-1.0) beats "b" (-1.5) outright.
    assert sgl.greedy_token_selection(choices, lps).decision == "a"
    uncond = [[(-0.5, 1), (-0.5, 2)], [(-3.5, 3)]]
    decision = sgl.unconditional_likelihood_normalized(choices, lps, uncond)
    assert decision.decision == "b" and decision.meta_info["scores"] == [-1.5, 2.0]


def test_fork_commits_trunk_runs_branches_concurrently_and_joins():
    backend = ScriptedBackend(lambda prompt, params: prompt.text[-1], delay=0.5)

    @sgl.function
    def prog(s):
        s += "trunk "
        forks = s.fork(3)
        forks += lambda i: str(i)
        forks += sgl.gen("branch")
        forks.join()
        s += "+".join(s["branch"])

    started = time.monotonic()
    state = prog.run(backend=backend)
    elapsed = time.monotonic() - started
    assert state["branch"] == ["0", "1", "2"]
    assert state.text() == "trunk 0+1+2"
    assert backend.calls[0] == ("cache_prefix", "trunk ")
    assert elapsed < 1.4, f"branches ran one after another ({elapsed:.2f}s)"


def test_fork_group_accepts_lists_iteration_and_indexing():
    backend = ScriptedBackend(lambda prompt, params: "!")

    @sgl.function
    def prog(s):
        forks = s.fork(2)
        forks += ["a", "b"]
        for f in forks:
            f += sgl.gen("g")
        assert len(forks) == 2
        return [forks[0].text(), forks[1].text()]

    assert prog.run(backend=backend).ret_value == ["a!", "b!"]


def test_failed_gen_raises_from_reader_and_run():
    backend = ScriptedBackend(lambda prompt, params: BackendError("sampling_params.top_p: must be in (0, 1]"))

    @sgl.function
    def reads(s):
        s += "x" + sgl.gen("a")
        s += s["a"]

    with pytest.raises(BackendError, match="top_p"):
        reads.run(backend=backend)

    @sgl.function
    def ignores(s):
        s += "x" + sgl.gen("a")
        s += "never runs" + sgl.gen("b")

    with pytest.raises(BackendError, match="top_p"):
        ignores.run(backend=backend)
    state = ignores.run(backend=backend, stream=True)
    assert isinstance(state.error(), BackendError)


def test_constraints_travel_as_the_native_api_fields():
    from pydantic import BaseModel

    class Point(BaseModel):
        x: int
        y: int

    backend = ScriptedBackend(lambda prompt, params: "7")

    @sgl.function
    def prog(s):
        s += "n=" + sgl.gen_int("n") + " p=" + sgl.gen("p", json_schema=Point) + sgl.gen("f", dtype=float)

    prog.run(backend=backend)
    wires = [call[1][1].wire_sampling() for call in backend.calls]
    assert wires[0]["regex"] == r"[-+]?[0-9]{1,19}"
    assert json.loads(wires[1]["json_schema"])["required"] == ["x", "y"]
    assert wires[2]["regex"].startswith(r"[-+]?[0-9]")


def test_run_batch_keeps_order_and_isolates_failures():
    def reply(prompt: Prompt, params: SglSamplingParams) -> Any:
        return BackendError("bad") if "3" in prompt.text else prompt.text[-1]

    backend = ScriptedBackend(reply, delay=0.05)

    @sgl.function
    def prog(s, i):
        if i == 5:
            raise RuntimeError("program bug")
        s += str(i) + sgl.gen("echo")

    states = prog.run_batch([{"i": i} for i in range(8)], backend=backend, num_threads=4)
    assert [s.error() is None for s in states] == [True, True, True, False, True, False, True, True]
    assert [s["echo"] for i, s in enumerate(states) if i not in (3, 5)] == ["0", "1", "2", "4", "6", "7"]
    assert isinstance(states[5].error(), RuntimeError)
    gen_style = prog.run_batch([{"i": i} for i in (0, 1, 2)], backend=backend, generator_style=True)
    assert not isinstance(gen_style, list)
    assert [s["echo"] for s in gen_style] == ["0", "1", "2"]
    assert [s["echo"] for s in prog.run_batch([[7], [6]], backend=backend)] == ["7", "6"]


def test_run_batch_warms_the_traced_constant_prefix():
    backend = ScriptedBackend()
    header = "You are a careful assistant. Answer every question in one word only.\n"

    @sgl.function
    def prog(s, question):
        s += header
        s += "Q: " + question + "\nA:" + sgl.gen("a")

    trace = prog.trace(backend=backend)
    assert trace.prefix == header and "question" in trace.stopped_by
    prog.run_batch([{"question": "a"}, {"question": "b"}], backend=backend)
    assert backend.calls[0] == ("cache_prefix", header)


def test_trace_stops_at_first_gen_and_through_roles():
    backend = ScriptedBackend()

    @sgl.function
    def prog(s, q):
        s += sgl.system("sys")
        s += sgl.assistant(sgl.gen("x"))
        s += q

    trace = prog.trace(backend=backend)
    assert trace.stopped_by == "gen"
    assert trace.prefix == chatml([{"role": "system", "content": "sys"}], True)
    assert prog.bind(q="bound").trace(backend=backend).stopped_by == "gen"
    assert backend.calls == []  # tracing never calls the model


def test_streaming_text_iter_matches_final_text():
    backend = ScriptedBackend(lambda prompt, params: "streamed words", delay=0.01)

    @sgl.function
    def prog(s):
        s += "Say:" + sgl.gen("out")
        s += "."

    state = prog.run(backend=backend, stream=True)
    pieces = list(state.text_iter())
    assert len(pieces) > 3 and "".join(pieces) == state.text() == "Say:streamed words."
    state = prog.run(backend=backend, stream=True)
    assert "".join(state.text_iter("out")) == "streamed words" == state["out"]


def test_default_backend_and_flush_cache():
    backend = ScriptedBackend()

    @sgl.function
    def prog(s):
        s += sgl.gen("x")

    sgl.set_default_backend(backend)
    try:
        assert prog.run()["x"] == "X"
        assert sgl.flush_cache() is False  # the scripted backend has no cache
    finally:
        import radixlm.backend as backend_module

        backend_module._default = None
    with pytest.raises(TypeError):
        sgl.set_default_backend("http://localhost")


def test_trace_without_a_backend_and_gen_choices_argument_checks():
    @sgl.function
    def prog(s):
        s += "Intro. " + sgl.system("x")

    trace = prog.trace()
    assert trace.prefix == "Intro. " and "role" in trace.stopped_by
    with pytest.raises(TypeError, match="max_tokens"):
        sgl.gen("x", 5, choices=["a", "b"])
    with pytest.raises(TypeError, match="needs choices"):
        sgl.gen("x", choices_method=sgl.greedy_token_selection)
