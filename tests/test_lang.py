"""Programs in the language against a real server on the default model (SmolLM2-135M-Instruct),
greedy. The asserted answers are the model's own greedy answers, checked beforehand."""

from __future__ import annotations

import subprocess
import sys

import pytest

import radixlm as sgl
from radixlm.backend import BackendError


@pytest.fixture(scope="module")
def backend(server):
    return sgl.RuntimeEndpoint(server.base_url)


FEW_SHOT = ("Q: What is the capital of Italy?\nA: Rome\nQ: What is the capital of Germany?\nA: Berlin\n"
            "Q: What is the largest planet?\nA: Jupiter\n")


@sgl.function
def few_shot_qa(s, question):
    s += FEW_SHOT
    s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=6, stop="\n")


def test_few_shot_qa_in_a_batch(backend, capsys):
    questions = ["What is the capital of France?", "What is the capital of Japan?", "How many days are in a week?"]
    states = few_shot_qa.run_batch([{"question": q} for q in questions], backend=backend, temperature=0,
                                   progress_bar=True)
    assert [s["answer"].strip() for s in states] == ["Paris", "Tokyo", "7"]
    assert "3/3" in capsys.readouterr().err  # the tqdm bar
    # run_batch warmed the shared few-shot prefix once, so every program found it cached.
    assert all(s.get_meta_info("answer")["cached_tokens"] >= 30 for s in states)
    gen_states = few_shot_qa.run_batch([{"question": questions[0]}], backend=backend, temperature=0,
                                       generator_style=True)
    assert [s["answer"].strip() for s in gen_states] == ["Paris"]


@sgl.function
def multi_turn_chat(s):
    s += sgl.system("You are a helpful assistant.")
    s += sgl.user("What is the capital of France?")
    s += sgl.assistant(sgl.gen("a1", max_tokens=12))
    s += sgl.user("And of Spain?")
    s += sgl.assistant(sgl.gen("a2", max_tokens=12))


def test_multi_turn_chat_roles_cache_and_chat_api_identity(backend, server):
    before = backend.get_server_info()["cache"]
    state = multi_turn_chat.run(backend=backend, temperature=0)
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assert "Paris" in state["a1"] and "Madrid" in state["a2"]
    first, second = state.get_meta_info("a1"), state.get_meta_info("a2")
    # The second turn reuses everything up to the first answer from the radix cache.
    assert second["cached_tokens"] >= first["prompt_tokens"]
    after = backend.get_server_info()["cache"]
    assert after["hit_tokens"] - before["hit_tokens"] >= second["cached_tokens"]
    # /v1/chat/completions renders the same messages to the same tokens: all but the last hit.
    body = {"model": "default", "messages": messages[:-1], "max_tokens": 1, "temperature": 0}
    with server.client() as client:
        usage = client.post("/v1/chat/completions", json=body).json()["usage"]
    assert usage["prompt_tokens"] == second["prompt_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1


def test_roles_from_a_local_tokenizer_equal_those_from_the_servers_template(backend, server):
    """Roles come from the chat template /get_model_info reports; a client told to use the
    model's tokenizer on this machine (tokenizer_path) renders the same text."""
    from radixlm.srt.executor.model_loader import default_model_path, load_model

    local = sgl.RuntimeEndpoint(server.base_url,
                                tokenizer_path=load_model(default_model_path(), with_weights=False).local_dir)
    assert backend.model_info["chat_template"]
    server_state = multi_turn_chat.run(backend=backend, temperature=0)
    local_state = multi_turn_chat.run(backend=local, temperature=0)
    assert local_state.text() == server_state.text()
    assert local_state.get_meta_info("a2")["cached_tokens"] >= local_state.get_meta_info("a1")["prompt_tokens"]


def test_client_process_imports_no_torch_and_no_runtime(server):
    """A program against a server (roles, gen, select) needs neither torch nor radixlm.srt in
    the client: everything comes over HTTP."""
    code = f"""
import sys
import radixlm as sgl

@sgl.function
def prog(s):
    s += sgl.user("Is this review positive or negative? I loved it!")
    s += sgl.assistant("The review is " + sgl.select("label", ["positive", "negative"]) + sgl.gen("x", max_tokens=2))

state = prog.run(backend=sgl.RuntimeEndpoint({server.base_url!r}), temperature=0)
assert state["label"] == "positive", state.text()
print(sorted(m for m in sys.modules if m == "torch" or m.startswith(("torch.", "radixlm.srt"))))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]"]


@sgl.function
def classify(s, review):
    s += sgl.user("Is this review positive or negative? " + review)
    s += sgl.assistant("The review is " + sgl.select("label", ["positive", "negative"]))


def test_select_classifies_and_scores_each_choice(backend):
    good = classify.run("I loved this movie, it was great!", backend=backend)
    bad = classify.run("Terrible film, boring and way too long.", backend=backend)
    assert (good["label"], bad["label"]) == ("positive", "negative")
    meta = good.get_meta_info("label")
    assert len(meta["scores"]) == 2 and meta["scores"][0] > meta["scores"][1]
    assert good.text().endswith("The review is positive<|im_end|>\n")


def test_select_scores_are_the_choice_tokens_logprobs(backend, server):
    """The boundary: "is " + "positive" tokenizes as "is", " positive"; the score must be the
    logprob of " positive" after "...is", computed here independently over the whole text."""
    prompt = "Q: Is the sky blue?\nA: The answer is "

    @sgl.function
    def prog(s):
        s += prompt + sgl.select("yn", ["yes", "no", "maybe not"])

    state = prog.run(backend=backend)
    assert state["yn"] in ("yes", "no", "maybe not")
    scores = state.get_meta_info("yn")["scores"]
    prompt_ids, *seqs = backend.tokenize([prompt] + [prompt + c for c in ["yes", "no", "maybe not"]])
    for ids, score in zip(seqs, scores):
        start = len(prompt_ids) - 1  # the prompt's trailing " " merges into the choice
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                "logprob_start_len": 0}
        with server.client() as client:
            entries = client.post("/generate", json=body).json()["meta_info"]["input_token_logprobs"]
        expected = [lp for lp, *_ in entries[start:]]
        assert score == pytest.approx(sum(expected) / len(expected), abs=1e-3)


def test_select_without_server_tokenize_finds_the_same_boundary(backend, server):
    """A server without /tokenize (older ones): the boundary comes from the token ids the
    server reports for the prompt, and scores equal the exact (/tokenize) ones."""
    remote = sgl.RuntimeEndpoint(server.base_url)
    remote._server_tokenizes = False  # as after a 404 from /tokenize
    assert remote.tokenize(["x"]) is None
    exact = classify.run("I loved this movie, it was great!", backend=backend)
    assert classify.run("I loved this movie, it was great!", backend=remote)["label"] == exact["label"]

    @sgl.function
    def plain(s):
        s += "Review: I loved this movie, it was great!\nThe review is " + sgl.select("label", ["positive", "negative"])

    ours, theirs = plain.run(backend=backend), plain.run(backend=remote)
    assert ours["label"] == theirs["label"] == exact["label"] == "positive"
    assert theirs.get_meta_info("label")["scores"] == pytest.approx(ours.get_meta_info("label")["scores"], abs=1e-3)


def test_select_methods_and_gen_choices(backend):
    @sgl.function
    def prog(s):
        s += "Q: What is the capital of France?\nA: The capital of France is"
        s += sgl.select("city", [" Paris", " London", " Berlin"], choices_method=sgl.greedy_token_selection)
        s += "\nQ: Is fire cold?\nA:" + sgl.gen("yn", choices=["Yes", "No"],
                                               choices_method=sgl.unconditional_likelihood_normalized)

    state = prog.run(backend=backend)
    assert state["city"] == " Paris" and state["yn"] in ("Yes", "No")
    assert len(state.get_meta_info("yn")["unconditional_token_logprobs"]) == 2


@sgl.function
def tips(s, topic):
    s += "Here are two tips for " + topic + ": 1. Balanced diet. 2. Regular exercise.\n"
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f"Now, expand tip {i + 1} into one sentence:" + sgl.gen("detail", max_tokens=6)
    forks.join()
    s += "Tip 1:" + s["detail"][0] + "\nTip 2:" + s["detail"][1] + "\nIn summary," + sgl.gen("summary", max_tokens=4)
    return forks


def test_fork_join_shares_the_trunk(backend):
    state = tips.run("staying healthy", backend=backend, temperature=0)
    details = state["detail"]
    assert isinstance(details, list) and len(details) == 2 and all(d.strip() for d in details)
    assert state["summary"].strip()
    trunk_tokens = len(backend.tokenize(["Here are two tips for staying healthy: 1. Balanced diet. "
                                         "2. Regular exercise."])[0])
    for branch in state.ret_value:  # the trunk was committed before the branches ran
        assert branch.get_meta_info("detail")["cached_tokens"] >= trunk_tokens


@sgl.function
def story(s):
    s += "Once upon a time"
    with s.var_scope("continuation"):
        s += "," + sgl.gen("rest", max_tokens=10)


def test_streaming_text_iter_and_var_scope(backend):
    state = story.run(backend=backend, stream=True, temperature=0)
    pieces = list(state.text_iter())
    assert len(pieces) > 3
    assert "".join(pieces) == state.text()
    assert state.text() == "Once upon a time" + state["continuation"]
    assert state["continuation"] == "," + state["rest"]
    state = story.run(backend=backend, stream=True, temperature=0)
    assert "".join(state.text_iter("rest")) == state["rest"]


@sgl.function
def calculator_agent(s, a, b):
    s += "Use the calculator for arithmetic.\n"
    s += "Question: What is 3 times 4?\nCalculator: 3*4\nResult: 12\nAnswer: 12\n\n"
    s += f"Question: What is {a} plus {b}?\nCalculator:" + sgl.gen("expr", max_tokens=10, stop="\n")
    expr = s["expr"].strip()  # read inside the program to build the next prompt
    if not all(c in "0123456789+-*/ ()" for c in expr):
        raise ValueError(f"not arithmetic: {expr!r}")
    s += f"\nResult: {eval(expr, {'__builtins__': {}})}\nAnswer:" + sgl.gen("answer", max_tokens=6, stop="\n")


def test_tool_use_step_evaluated_in_python(backend):
    state = calculator_agent.run(17, 25, backend=backend, temperature=0)
    assert state["expr"].strip() == "17+25"
    assert "Result: 42\n" in state.text()
    assert state["answer"].strip() == "42"


def test_errors_carry_the_server_message_and_do_not_hang_a_batch(backend):
    @sgl.function
    def prog(s, top_p):
        s += "Hello" + sgl.gen("x", max_tokens=2, top_p=top_p)
        s += s["x"]

    with pytest.raises(BackendError, match=r"top_p: must be in \(0, 1\]"):
        prog.run(5.0, backend=backend)
    states = prog.run_batch([{"top_p": 1.0}, {"top_p": 5.0}, {"top_p": 0.5}], backend=backend, temperature=0)
    assert [s.error() is None for s in states] == [True, False, True]
    assert "top_p" in str(states[1].error())
    with pytest.raises(BackendError, match="top_p"):
        states[1]["x"]


def test_default_backend_flush_cache_and_hit_rate(backend):
    sgl.set_default_backend(backend)
    try:
        assert sgl.flush_cache() is True
        state = multi_turn_chat.run(temperature=0, max_new_tokens=4)
        assert state.get_meta_info("a2")["cached_tokens"] > 0
        assert 0 < sgl.get_server_info()["cache"]["hit_rate"] <= 1
    finally:
        import radixlm.backend as backend_module

        backend_module._default = None


def test_openai_backend_against_our_server(server):
    openai = sgl.OpenAI("default", base_url=server.base_url + "/v1", api_key="unused")
    chat = multi_turn_chat.run(backend=openai, temperature=0)
    assert "Paris" in chat["a1"] and "Madrid" in chat["a2"]
    assert chat.get_meta_info("a2")["cached_tokens"] > 0
    few = few_shot_qa.run("What is the capital of Japan?", backend=openai, temperature=0)
    assert few["answer"].strip() == "Tokyo"
    label = classify.run("I loved this movie, it was great!", backend=openai)
    assert label["label"] == "positive"
    streamed = story.run(backend=openai, stream=True, temperature=0)
    assert "".join(streamed.text_iter()) == streamed.text()
    wrong = sgl.OpenAI("default", base_url=server.base_url + "/not-v1", api_key="unused")
    with pytest.raises(BackendError, match="select with the OpenAI backend needs /completions"):
        classify.run("Fine.", backend=wrong)


def test_runtime_endpoint_reports_unreachable_server():
    with pytest.raises(BackendError, match="cannot reach"):
        sgl.RuntimeEndpoint("http://127.0.0.1:9")
