"""One request intake for native /generate, the OpenAI routes and the in-process Engine: the
same validation, per-sample seeds, caps, stop trimming, stream close and cache salt on every
path (each of these once differed between the paths)."""

from __future__ import annotations

import asyncio
import uuid

import orjson
import pytest

from radixlm.srt import io_struct
from radixlm.srt.intake import MAX_TOP_LOGPROBS, Intake
from radixlm.srt.server.metrics import Metrics
from radixlm.srt.io_struct import TokenizedGenerateReq
from radixlm.srt.sampling_params import SamplingParams
from radixlm.srt.core.request import Req

FRUIT = "Pick a random fruit:"
SEEDED = {"temperature": 1.0, "seed": 7, "max_new_tokens": 8, "ignore_eos": True}
COUNT = "Count: 1, 2, 3, 4,"


def _post(server, path, body):
    with server.client() as c:
        return c.post(path, json=body)


# ---- n > 1: sample i is seeded with seed + i ------------------------------------------------------

def test_engine_n_samples_use_seed_plus_i_like_the_server(engine, server):
    outs = engine.generate(FRUIT, {**SEEDED, "n": 3})
    ids = [o["output_ids"] for o in outs]
    assert len({tuple(i) for i in ids}) > 1  # the Engine once gave n identical samples
    for i, one in enumerate(ids):
        assert engine.generate(FRUIT, {**SEEDED, "seed": 7 + i})["output_ids"] == one
    served = _post(server, "/generate", {"text": FRUIT, "sampling_params": {**SEEDED, "n": 3}}).json()
    assert [o["output_ids"] for o in served] == ids


def test_intake_expands_n_into_seeded_samples_with_rids():
    intake = Intake(tokenizer=None, vocab_size=100, context_len=64)
    msgs = intake.samples([1, 2, 3], {"n": 3, "seed": 7}, rid="job")
    assert [m.rid for m in msgs] == ["job-0", "job-1", "job-2"]
    assert [m.sampling_params.seed for m in msgs] == [7, 8, 9]
    assert all(m.sampling_params.n == 1 for m in msgs)
    unseeded = intake.samples([1, 2, 3], {"n": 2})
    assert [m.sampling_params.seed for m in unseeded] == [None, None]
    assert len({m.rid for m in unseeded}) == 2
    assert intake.samples([1], {"seed": 7}, rid="solo")[0].rid == "solo"
    with pytest.raises(ValueError, match="rid: 'a-1' is given twice"):
        intake.batch(None, [[1], [2]], [{"n": 2}, None], ["a", "a-1"])
    with pytest.raises(ValueError, match="rid: a list must have one entry per prompt"):
        intake.batch(None, [[1], [2]], None, ["a"])


# ---- the same caps -------------------------------------------------------------------------------

def test_top_logprobs_num_and_n_caps_hold_on_every_path(engine, server):
    over = MAX_TOP_LOGPROBS + 1
    with pytest.raises(ValueError, match="top_logprobs_num"):
        engine.generate("hi", {"max_new_tokens": 1}, return_logprob=True, top_logprobs_num=over)
    with pytest.raises(ValueError, match="sampling_params.n"):
        engine.generate("hi", {"max_new_tokens": 1, "n": 65})
    resp = _post(server, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1},
                                       "return_logprob": True, "top_logprobs_num": over})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "top_logprobs_num"
    resp = _post(server, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1, "n": 65}})
    assert resp.status_code == 400 and "n" in resp.json()["error"]["message"]
    top = engine.generate("hi", {"max_new_tokens": 1}, return_logprob=True, top_logprobs_num=MAX_TOP_LOGPROBS)
    assert len(top["meta_info"]["output_top_logprobs"][0]) == MAX_TOP_LOGPROBS


# ---- stop trimming -------------------------------------------------------------------------------

@pytest.mark.parametrize("stop, text", [
    ({"stop": " 7"}, " 5, 6,"),
    ({"stop_regex": r" [7-9]"}, " 5, 6,"),  # the server once kept a stop regex's match
    ({"stop_regex": r" [7-9]", "no_stop_trim": True}, " 5, 6, 7"),
])
def test_stop_trimming_is_the_same_in_engine_and_server(engine, server, stop, text):
    params = {"temperature": 0, "max_new_tokens": 16, **stop}
    eng = engine.generate(COUNT, params)
    srv = _post(server, "/generate", {"text": COUNT, "sampling_params": params}).json()
    assert eng["text"] == srv["text"] == text
    assert eng["meta_info"]["finish_reason"] == srv["meta_info"]["finish_reason"] == {"type": "stop", "matched": " 7"}


# ---- stream close: a client gone mid-stream aborts at once ---------------------------------------

class _FakeTokenizerManager:
    """Stands in for the TokenizerManager: each request yields one chunk, then waits forever."""

    def __init__(self) -> None:
        self.intake = Intake(tokenizer=None, vocab_size=100, context_len=64)
        self.context_len = 64
        self.tokenizer = None
        self.adapters = None  # served without --enable-lora
        self.aborted: list[str] = []
        self.metrics = Metrics()

    def is_full(self, adding: int = 1) -> bool:
        return False

    async def generate(self, msg: TokenizedGenerateReq, text_in_logprobs: bool = False):
        try:
            yield {"text": "a", "output_ids": [5], "meta_info": {"finish_reason": None, "cached_tokens": 0,
                                                                 "completion_tokens": 1}}
            await asyncio.Event().wait()
        finally:
            self.aborted.append(msg.rid)

    async def cache_prompt(self, msg: TokenizedGenerateReq) -> None:
        pass


def _streaming_app(tm: _FakeTokenizerManager):
    from radixlm.srt.server.http_server import ServerState, create_app
    from radixlm.srt.server.openai_api import register_openai_routes

    app = create_app(ServerState(tm, "fake", {}), api_key=None)
    register_openai_routes(app, lambda: tm, "fake")
    return app


@pytest.mark.parametrize("path, body", [
    ("/generate", {"input_ids": [1, 2, 3], "stream": True}),
    ("/v1/completions", {"prompt": [1, 2, 3], "stream": True}),
])
def test_stream_is_closed_and_aborted_when_the_client_is_gone(path, body):
    """An ASGI 2.4 server reports a gone client only by failing a send; every streaming route
    must then close its body at once (which aborts the request), not at garbage collection."""
    tm = _FakeTokenizerManager()
    app = _streaming_app(tm)
    raw = orjson.dumps(body)
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
             "query_string": b"", "server": ("test", 80), "client": ("test", 1),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]}
    received = []

    async def receive():
        if not received:
            received.append(True)
            return {"type": "http.request", "body": raw, "more_body": False}
        await asyncio.Event().wait()

    async def send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            raise OSError("the client is gone")

    async def run():
        try:
            await app(scope, receive, send)
        except Exception as e:  # the disconnect surfaces as Starlette's ClientDisconnect
            kept = e  # noqa: F841  (held, as a server's error log would hold it)
        for _ in range(5):  # cancellation reaches the request's generator within a few turns
            await asyncio.sleep(0)
        return list(tm.aborted)

    assert len(asyncio.run(run())) == 1


# ---- cache salt ----------------------------------------------------------------------------------

def test_cache_salt_separates_cached_prefixes_natively(server):
    prompt = f"Salted prompt {uuid.uuid4().hex}: " + "the quick brown fox jumps over the lazy dog. " * 4

    def cached(salt):
        body = {"text": prompt, "sampling_params": {"max_new_tokens": 1}}
        if salt is not None:
            body["cache_salt"] = salt
        return _post(server, "/generate", body).json()["meta_info"]["cached_tokens"]

    assert cached("alpha") == 0
    assert cached("beta") == 0
    assert cached(None) == 0
    assert cached("alpha") > 30
    assert cached(None) > 30


def test_cache_salt_separates_cached_prefixes_in_openai_and_engine(server, engine):
    prompt = f"Another salted prompt {uuid.uuid4().hex}: " + "a red box, a green box, a blue box. " * 4

    def cached(salt):
        body = {"prompt": prompt, "max_tokens": 1, "cache_salt": salt}
        return _post(server, "/v1/completions", body).json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("one") == 0 and cached("two") == 0
    assert cached("one") > 30
    first = engine.generate(prompt, {"max_new_tokens": 1}, cache_salt="one")
    other = engine.generate(prompt, {"max_new_tokens": 1}, cache_salt="two")
    again = engine.generate(prompt, {"max_new_tokens": 1}, cache_salt="one")
    assert first["meta_info"]["cached_tokens"] == other["meta_info"]["cached_tokens"] == 0
    assert again["meta_info"]["cached_tokens"] > 30


@pytest.mark.parametrize("salt", [5, "", ["a"]])
def test_bad_cache_salt_is_400_naming_the_field(server, engine, salt):
    native = _post(server, "/generate", {"text": "hi", "cache_salt": salt})
    assert native.status_code == 400 and native.json()["error"]["param"] == "cache_salt"
    openai = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "cache_salt": salt})
    assert openai.status_code == 400 and openai.json()["error"]["param"] == "cache_salt"
    with pytest.raises(ValueError, match="cache_salt"):
        engine.generate("hi", {"max_new_tokens": 1}, cache_salt=salt)


# ---- the message that travels ----------------------------------------------------------------------

def test_frozen_sampling_params_travel_over_msgpack():
    sp = SamplingParams.from_dict({"stop": ["a", "b"], "stop_token_ids": [3], "choices": ["x", "y"], "seed": 9})
    msg = TokenizedGenerateReq("r", [1, 2], sp, return_logprob=True, top_logprobs_num=2, cache_salt="s")
    back = io_struct.decode(io_struct.encode(msg))
    assert back == msg and isinstance(back.sampling_params.stop, tuple)
    req = Req.from_tokenized(back, vocab_size=100)
    assert req.sampling_params == sp and req.namespace == "s"


def test_from_tokenized_refuses_bad_peers():
    bad_range = TokenizedGenerateReq("r", [1], SamplingParams(temperature=-1.0))
    with pytest.raises(ValueError, match="temperature"):
        Req.from_tokenized(bad_range, vocab_size=100)
    with pytest.raises(ValueError, match="sampling_params"):
        Req.from_tokenized(TokenizedGenerateReq("r", [1], {"temperature": 1.0}), vocab_size=100)
    with pytest.raises(ValueError, match="sampling_params"):
        Req.from_tokenized(TokenizedGenerateReq("r", [1], SamplingParams(temperature="hot")), vocab_size=100)
