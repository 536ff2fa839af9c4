"""Async programs against a real server: same greedy states as sync, batches streamed as they
finish, cancellation that aborts the server's requests, and errors that stop the branches."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

import radixlm as sgl


@pytest.fixture(scope="module")
def backend(server):
    return sgl.RuntimeEndpoint(server.base_url)


def _server_info(server) -> dict:
    return httpx.get(server.base_url + "/get_server_info", timeout=30).json()


def lookup(city: str) -> str:
    """Looks up how many museums a city has.

    Args:
        city: the city's name
    """
    return f"{city.strip()[:20]} has {len(city.strip()) * 7 % 97} museums."


def _run_calls(calls: list[dict]) -> list:
    return [sgl.tool(lookup(**call["arguments"]), call_id=call["id"]) for call in calls]


@sgl.function
def react_sync(s, question):
    s += sgl.user(question)
    s += sgl.assistant("Thought:" + sgl.gen("thought", max_tokens=8, stop="\n"))
    s += sgl.user("Look it up.")
    s += sgl.assistant(sgl.gen("call", tools=[lookup], tool_choice="required", max_tokens=48))
    for message in _run_calls(s["call"]):
        s += message
    forks = s.fork(2)
    forks += lambda i: sgl.user(f"Answer {i}?") + sgl.assistant(sgl.gen("answer", max_tokens=6))
    forks.join()
    s += sgl.user("Final?") + sgl.assistant(sgl.gen("final", max_tokens=6))


@sgl.function
async def react_async(s, question):
    s += sgl.user(question)
    s += sgl.assistant("Thought:" + sgl.gen("thought", max_tokens=8, stop="\n"))
    s += sgl.user("Look it up.")
    s += sgl.assistant(sgl.gen("call", tools=[lookup], tool_choice="required", max_tokens=48))
    for message in _run_calls(await s.get("call")):
        s += message
    forks = s.fork(2)
    forks += lambda i: sgl.user(f"Answer {i}?") + sgl.assistant(sgl.gen("answer", max_tokens=6))
    await forks.join()
    s += sgl.user("Final?") + sgl.assistant(sgl.gen("final", max_tokens=6))


QUESTIONS = [f"Which city in country number {i} has the most museums?" for i in range(32)]


def test_an_async_react_program_over_32_tasks_matches_the_sync_one(backend):
    args = [{"question": q} for q in QUESTIONS]
    sync_states = react_sync.run_batch(args, backend=backend, temperature=0)
    async_states = react_async.run_batch(args, backend=backend, temperature=0, max_concurrency=32)
    called = 0
    for a, b in zip(sync_states, async_states):
        assert a.error() is None and b.error() is None
        assert b.text() == a.text()
        assert [(c["name"], c["arguments"]) for c in b["call"]] == [(c["name"], c["arguments"]) for c in a["call"]]
        called += bool(b["call"])
        assert b["answer"] == a["answer"] and len(b["answer"]) == 2
        assert b["final"] == a["final"]
    assert called >= 16  # the tool round trip ran (a call cut off at max_tokens parses to none)


def test_arun_awaits_in_an_event_loop_and_run_says_to_await_there(backend):
    async def main():
        state = await react_async.arun(QUESTIONS[0], backend=backend, temperature=0)
        with pytest.raises(RuntimeError, match="arun"):
            react_async.run(QUESTIONS[0], backend=backend)
        sync_in_loop = await react_sync.arun(QUESTIONS[0], backend=backend, temperature=0)  # a worker thread
        return state, sync_in_loop

    state, sync_in_loop = asyncio.run(main())
    assert state.text() == sync_in_loop.text()


def test_reading_a_value_before_it_is_there_says_to_await_it(backend):
    @sgl.function
    async def eager(s):
        s += "Hi" + sgl.gen("x", max_tokens=2)
        return s["x"]

    with pytest.raises(RuntimeError, match="await s.get"):
        eager.run(backend=backend)


def test_run_batch_stream_yields_in_finishing_order(backend):
    @sgl.function
    async def count(s, n):
        s += "Count: 1 2 3" + sgl.gen("more", max_tokens=n, ignore_eos=True)

    lengths = [48, 1, 24, 6]

    async def main():
        return [(i, len(state["more"])) async for i, state in count.run_batch_stream(
            [{"n": n} for n in lengths], backend=backend, temperature=0)]

    order = [i for i, _ in asyncio.run(main())]
    assert order == sorted(range(len(lengths)), key=lengths.__getitem__)


def test_sync_programs_take_max_concurrency_and_stream_too(backend):
    args = [{"question": q} for q in QUESTIONS[:4]]
    states = react_sync.run_batch(args, backend=backend, temperature=0, max_concurrency=2)

    async def main():
        return {i: s async for i, s in react_sync.run_batch_stream(args, backend=backend, temperature=0)}

    streamed = asyncio.run(main())
    assert [streamed[i].text() for i in range(4)] == [s.text() for s in states]
    with pytest.raises(ValueError, match="max_concurrency"):
        react_sync.run_batch(args, backend=backend, max_concurrency=0)


def _wait_until_idle(server) -> dict:
    deadline = time.monotonic() + 20
    while True:
        info = _server_info(server)
        if info["num_running_reqs"] == info["num_waiting_reqs"] == 0:
            return info
        assert time.monotonic() < deadline, f"still running after the program was cancelled: {info}"
        time.sleep(0.05)


def test_cancelling_a_program_task_aborts_its_requests_and_frees_their_kv(server, backend):
    @sgl.function
    async def long_story(s):
        forks = s.fork(2)
        forks += "Once upon a time" + sgl.gen("story", max_tokens=4000, ignore_eos=True)
        await forks.join()

    async def main():
        task = asyncio.ensure_future(long_story.arun(backend=backend, temperature=0))
        deadline = time.monotonic() + 60
        while (await asyncio.to_thread(_server_info, server))["num_running_reqs"] < 2:
            assert time.monotonic() < deadline, "the branches never started"
            await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    kv = _wait_until_idle(server)["kv"]
    assert kv["held_by_requests"] == 0 and kv["leaked"] == 0


def test_a_program_that_raises_aborts_its_branches_requests(server, backend):
    @sgl.function
    async def fails(s):
        forks = s.fork(2)
        forks += "Once upon a time" + sgl.gen("story", max_tokens=4000, ignore_eos=True)
        while (await asyncio.to_thread(_server_info, server))["num_running_reqs"] < 2:
            await asyncio.sleep(0.1)
        raise ValueError("the tool failed")

    with pytest.raises(ValueError, match="the tool failed"):
        fails.run(backend=backend, temperature=0)
    kv = _wait_until_idle(server)["kv"]
    assert kv["held_by_requests"] == 0 and kv["leaked"] == 0


def test_each_program_and_branch_keeps_a_session_and_ends_it(server, backend):
    assert backend.sessions  # the server offers them (/get_model_info)
    before = _server_info(server)["sessions"]

    @sgl.function
    async def two_branches(s):
        s += "A short story:" + sgl.gen("a", max_tokens=2)
        forks = s.fork(2)
        forks += sgl.gen("b", max_tokens=2)
        await forks.join()

    two_branches.run(backend=backend, temperature=0)
    react_sync.run(QUESTIONS[0], backend=backend, temperature=0)  # a sync program ends its own (and its branches')
    after = _server_info(server)["sessions"]
    assert after["ended"] - before["ended"] == 3 + 3 and after["active"] == before["active"]
    off = sgl.RuntimeEndpoint(server.base_url, sessions=False)
    two_branches.run(backend=off, temperature=0)
    assert _server_info(server)["sessions"]["ended"] == after["ended"]


def test_a_streamed_async_program_yields_its_text_as_it_comes(backend):
    @sgl.function
    async def story(s):
        s += "Once upon a time" + sgl.gen("rest", max_tokens=12, ignore_eos=True)

    async def main():
        state = await story.arun(backend=backend, temperature=0, stream=True)
        pieces = [piece async for piece in state.text_iter("rest")]
        await state.wait()
        assert state.error() is None
        return pieces, state

    pieces, state = asyncio.run(main())
    assert len(pieces) > 1 and "".join(pieces) == state["rest"]
