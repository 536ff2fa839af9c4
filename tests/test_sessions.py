"""Program sessions: the policy (srt/scheduler/sessions.py) over a real radix tree, with a fake
clock: protection, TTL, the per-session and total budgets, release on end and under pressure,
tenants; a hypothesis state machine keeping free + evictable + protected == capacity through
all of it; and a real server with a small KV pool, where sessions keep their hit rates under a
competing flood of unrelated prompts and leave no KV behind."""

from __future__ import annotations

import random
from collections.abc import Hashable
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from benchmarks.harness import ServerProcess, wait_until
from radixlm.radix import RadixCache
from radixlm.radix.tiered import TieredRadixCache
from radixlm.srt.core.request import Req
from radixlm.srt.core.step import PendingStep, StepPlan, StepResult
from radixlm.srt.intake import check_session_id
from radixlm.srt.sampling_params import SamplingParams
from radixlm.srt.scheduler.kv_memory import PageAllocator
from radixlm.srt.scheduler.request_kv import RequestKV
from radixlm.srt.scheduler.scheduler import Scheduler
from radixlm.srt.scheduler.sessions import Sessions
from radixlm.srt.server.session_routes import SessionOwners
from radixlm.srt.server_args import ServerArgs


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Pool:
    """The tree, its page allocator and the sessions over them, as the scheduler joins them."""

    def __init__(self, capacity: int = 64, ttl: float = 10.0, max_tokens: int = 1000, total_tokens: int = 1000,
                 page_size: int = 1):
        self.clock = Clock()
        self.allocator = PageAllocator(capacity, page_size)
        self.tree = RadixCache(self.allocator.capacity, self.allocator.free, page_size=page_size)
        self.sessions = Sessions(self.tree, ttl, max_tokens, total_tokens, clock=self.clock)
        self.kv = RequestKV(self.allocator, None, self.tree, page_size, sessions=self.sessions)

    def finish(self, key: list[int], session_id: str | None = None, namespace: Hashable = None,
               release_sessions: bool = True) -> int | None:
        """A request of `key` runs and finishes (match, lock, allocate the rest, insert, keep,
        unlock, as RequestKV does); returns the tokens it found cached, None when it did not fit."""
        match = self.tree.match_prefix(key, namespace)
        self.tree.lock(match.node)
        needed = self.allocator.slots_needed(0, len(key) - match.matched_len)
        if not self.kv.make_room(needed, release_sessions):
            self.tree.unlock(match.node)
            return None
        own = self.allocator.alloc(0, len(key) - match.matched_len, None)
        slots = match.slot_indices + own
        already = self.tree.insert(key, slots, namespace)
        aligned = len(key) - len(key) % self.tree.page_size
        self.allocator.free(slots[match.matched_len:already] + slots[aligned:])
        if session_id is not None:
            self.sessions.keep(session_id, namespace, key)
        self.tree.unlock(match.node)
        return match.matched_len

    def check(self) -> None:
        self.tree.check_invariants()
        free, tree = self.allocator.available_size, self.tree
        assert free + tree.evictable_size + tree.protected_size == self.allocator.capacity


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(n)]


# ---------------------------------------------------------------------------- the policy
def test_a_session_keeps_its_latest_prefix_and_lets_go_of_the_one_before() -> None:
    pool = Pool(capacity=80)
    first = tokens(20, 1)
    pool.finish(first, "s")
    assert pool.tree.protected_size == 20 and pool.sessions.protected_tokens == 20
    pool.tree.evict(1000)
    second = first + tokens(10, 2)
    assert pool.finish(second, "s") == 20  # the next call hits the protected prefix
    assert pool.tree.protected_size == 30
    pool.finish(tokens(40, 3))  # a flood, then eviction of all it can: the session's 30 tokens stay
    pool.tree.evict(1000)
    assert pool.tree.protected_size == 30 and pool.tree.cached_prefix_len(second) == 30
    pool.check()


def test_ttl_expiry_and_end_release_the_prefix() -> None:
    pool = Pool(ttl=10.0)
    pool.finish(tokens(8, 1), "a")
    pool.clock.now = 5.0
    pool.finish(tokens(8, 2), "b")
    pool.clock.now = 10.0
    pool.sessions.expire()  # "a" is idle for 10 s, "b" for 5
    assert pool.sessions.info()["expired"] == 1 and pool.sessions.protected_tokens == 8
    assert pool.sessions.end("b") and not pool.sessions.end("b") and not pool.sessions.end("a")
    assert pool.tree.protected_size == 0 and len(pool.sessions) == 0
    pool.check()


def test_a_request_arriving_counts_as_activity() -> None:
    pool = Pool(ttl=10.0)
    pool.finish(tokens(8, 1), "a")
    pool.clock.now = 9.0
    assert pool.sessions.admit("a", None)
    pool.clock.now = 15.0
    pool.sessions.expire()
    assert pool.sessions.protected_tokens == 8


def test_per_session_budget_protects_the_head_of_the_prefix() -> None:
    pool = Pool(max_tokens=12)
    key = tokens(30, 1)
    pool.finish(key, "s")
    assert pool.tree.protected_size == 12
    pool.tree.evict(1000)
    assert pool.tree.cached_prefix_len(key) == 12
    pool.check()


def test_total_budget_lets_the_most_recently_active_go_first() -> None:
    """Programs return in about the order they left: the newest is needed last."""
    pool = Pool(total_tokens=20)
    for i, sid in enumerate("abc"):
        pool.clock.now = i
        pool.finish(tokens(8, i), sid)
    info = pool.sessions.info()
    assert info["budget_releases"] == 1 and info["protected_tokens"] == 16 and info["active"] == 3
    pool.tree.evict(1000)
    assert pool.tree.cached_prefix_len(tokens(8, 0)) == 8 and pool.tree.cached_prefix_len(tokens(8, 2)) == 0
    pool.check()


def test_pressure_releases_newest_first_and_only_when_asked() -> None:
    pool = Pool(capacity=32)
    pool.finish(tokens(12, 1), "old")
    pool.clock.now = 1.0
    pool.finish(tokens(12, 2), "new")
    assert pool.finish(tokens(20, 3), release_sessions=False) is None  # it would wait for running work
    assert pool.finish(tokens(16, 3)) == 0  # nothing else frees memory: protection gives way
    info = pool.sessions.info()
    assert info["pressure_releases"] == 1 and info["protected_tokens"] == 12
    assert pool.tree.cached_prefix_len(tokens(12, 1)) == 12
    pool.check()


def test_with_the_host_tier_a_protected_prefix_stays_on_the_device() -> None:
    """--enable-hierarchical-cache: protection holds the prefix on the device (docs/sessions.md
    says why); once released it demotes to the host like any other prefix."""
    allocator = PageAllocator(64)
    tree = TieredRadixCache(allocator.capacity, allocator.free, host_capacity=128)
    sessions = Sessions(tree, 10.0, 100, 100, clock=Clock())
    session_key, other = tokens(12, 1), tokens(12, 2)
    for key, sid in ((session_key, "s"), (other, None)):
        tree.insert(key, allocator.alloc(0, len(key), None))
        if sid:
            sessions.keep(sid, None, key)
    tree.evict(1000)
    assert tree.match(session_key).matched_len == 12  # on the device
    assert tree.match(other).matched_len == 0 and tree.match(other).host_len == 12  # demoted
    sessions.end("s")
    tree.evict(1000)
    assert tree.match(session_key).host_len == 12
    tree.check_invariants()


def test_flush_clears_every_protection() -> None:
    pool = Pool()
    pool.finish(tokens(8, 1), "a")
    pool.sessions.clear()
    pool.tree.reset()
    assert pool.allocator.available_size == pool.allocator.capacity and len(pool.sessions) == 0


def test_a_session_belongs_to_its_first_namespace() -> None:
    pool = Pool()
    pool.finish(tokens(8, 1), "s", namespace="tenant-a")
    assert pool.sessions.admit("s", "tenant-a") and not pool.sessions.admit("s", "tenant-b")
    pool.finish(tokens(8, 2), "s", namespace="tenant-b")  # refused upstream; never protected here
    assert pool.sessions.protected_tokens == 8 and pool.tree.protected_size == 8


def test_owners_refuse_another_tenant_until_the_id_is_forgotten() -> None:
    clock = Clock()
    owners = SessionOwners(ttl=10.0, clock=clock)
    owners.claim("s", ("salt", None))
    owners.claim("s", ("salt", None))
    with pytest.raises(ValueError, match="^session_id: "):
        owners.claim("s", (None, None))
    clock.now = 9.0
    owners.touch("s")  # its request ended
    clock.now = 18.0
    with pytest.raises(ValueError, match="^session_id: "):
        owners.claim("s", (None, "adapter"))
    clock.now = 30.0
    owners.claim("s", (None, None))  # expired: a new session
    owners.drop("s")
    owners.claim("s", ("salt", None))


@pytest.mark.parametrize("bad", ["", "x" * 129, 7, ["s"], True])
def test_bad_session_ids_are_refused_naming_the_field(bad) -> None:
    with pytest.raises(ValueError, match="^session_id: "):
        check_session_id(bad)
    assert check_session_id("x" * 128) == "x" * 128 and check_session_id(None) is None


# ---------------------------------------------------------------------------- in the scheduler
class FakeEngine:
    """Draws a fixed function of request and position as each token (any batching: the same)."""

    def __init__(self, loaded, args, req_to_token, num_kv_slots, *, eos_ids, grammar_backend):
        self.overlap = False

    @staticmethod
    def kv_capacity(config, args) -> int:
        return args.cache.max_total_tokens

    def launch(self, plan: StepPlan) -> PendingStep:
        tokens = [10 + (len(r.origin_input_ids) + len(r.output_ids) + r.pending_tokens) % 50
                  for r in plan.sampling_reqs]
        return PendingStep(plan, lambda: StepResult(tokens))


def make_scheduler(**overrides) -> Scheduler:
    args = dict(max_total_tokens=128, max_running_requests=8, chunked_prefill_size=32, max_prefill_tokens=32,
                context_length=256, device="cpu", session_total_tokens=128, **overrides)
    config = SimpleNamespace(eos_token_ids=(2,), vocab_size=64, context_len=256)
    loaded = SimpleNamespace(config=config, tokenizer=SimpleNamespace(eos_token_id=2, decode=lambda ids, **_: ""))
    return Scheduler(loaded, ServerArgs(**args), engine_factory=FakeEngine)


def run(sched: Scheduler, *reqs: Req) -> None:
    for req in reqs:
        sched.add_request(req)
    for _ in range(1000):
        if not sched.has_work and sched.pending is None:
            return
        sched.step()
    raise AssertionError("no progress")


def req(rid: str, prompt: list[int], new: int = 4, session_id: str | None = None) -> Req:
    sp = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    return Req(rid=rid, origin_input_ids=prompt, sampling_params=sp, session_id=session_id)


def test_in_the_scheduler_a_session_hits_gives_way_to_work_and_leaks_nothing() -> None:
    sched = make_scheduler()
    first = req("a1", tokens(40, 1), session_id="a")  # prefilled in two chunks
    run(sched, first)
    assert sched.sessions.protected_tokens == 43  # prompt + output but the last token (no KV yet)
    second = req("a2", first.fill_ids + tokens(10, 2), session_id="a")
    run(sched, req("other", tokens(60, 3)), second)
    assert second.cached_tokens == 43 and sched.sessions.protected_tokens == 57
    aborted = req("a3", second.fill_ids + [5], new=50, session_id="a")
    sched.add_request(aborted)
    sched.step()
    sched.abort("a3")
    run(sched)
    assert sched.sessions.protected_tokens == 57  # an aborted call changes nothing
    # Two requests that need most of the pool: decoding lets the protection go rather than retract.
    retracted = []
    real_retract = sched.decode.retract
    sched.decode.retract = lambda r: retracted.append(r.rid) or real_retract(r)
    run(sched, req("b1", tokens(20, 4), new=40), req("b2", tokens(20, 5), new=40))
    assert not retracted and sched.sessions.info()["pressure_releases"] == 1
    assert sched.sessions.protected_tokens == 0 and sched.sessions.end("a") and not sched.sessions.end("a")
    run(sched, req("c", tokens(8, 6), session_id="c"))
    assert sched.sessions.protected_tokens == 11 and sched.flush_cache()
    stats = sched.kv_stats()
    assert stats["leaked"] == 0 and stats["protected"] == 0 and stats["free"] == stats["capacity"], stats
    assert len(sched.sessions) == 0


def test_in_the_scheduler_another_namespace_runs_without_the_session() -> None:
    sched = make_scheduler()
    run(sched, req("a1", tokens(20, 1), session_id="s"))
    foreign = req("b1", tokens(20, 1), session_id="s")
    foreign.namespace = "tenant-b"
    run(sched, foreign)
    assert foreign.session_id is None and foreign.cached_tokens == 0
    assert sched.sessions.protected_tokens == 23


# ---------------------------------------------------------------------------- state machine
SIDS = st.sampled_from(["a", "b", "c"])
NAMESPACES = st.sampled_from([None, "salt"])
PARTS = st.lists(st.sampled_from([1, 2, 3]), min_size=1, max_size=6)


class SessionMachine(RuleBasedStateMachine):
    """Sessions over a small pool: calls extending each session's last sequence, unrelated
    requests, ends, time passing and pressure; the pool's accounting and the budgets hold."""

    @initialize(page_size=st.sampled_from([1, 2]), max_tokens=st.integers(2, 30), total=st.integers(0, 40))
    def setup(self, page_size: int, max_tokens: int, total: int) -> None:
        self.pool = Pool(capacity=48, ttl=5.0, max_tokens=max_tokens, total_tokens=total, page_size=page_size)
        self.last: dict[str, tuple[Hashable, list[int]]] = {}

    @rule(sid=SIDS, ns=NAMESPACES, extra=PARTS)
    def call(self, sid: str, ns: Hashable, extra: list[int]) -> None:
        owner, key = self.last.get(sid, (ns, []))
        if not self.pool.sessions.admit(sid, owner):
            return
        key = key + extra
        if self.pool.finish(key, sid, owner) is not None:
            self.last[sid] = (owner, key)

    @rule(key=PARTS, ns=NAMESPACES)
    def unrelated(self, key: list[int], ns: Hashable) -> None:
        self.pool.finish([9] + key * 4, None, ns)

    @rule(sid=SIDS)
    def end(self, sid: str) -> None:
        self.pool.sessions.end(sid)
        assert not self.pool.sessions.end(sid)
        self.last.pop(sid, None)

    @rule(seconds=st.floats(0, 4))
    def wait(self, seconds: float) -> None:
        self.pool.clock.now += seconds
        self.pool.sessions.expire()

    @rule(n=st.integers(1, 48))
    def pressure(self, n: int) -> None:
        self.pool.kv.make_room(n, release_sessions=True)

    @invariant()
    def accounting_holds(self) -> None:
        if not hasattr(self, "pool"):
            return
        pool = self.pool
        pool.check()
        info = pool.sessions.info()
        assert info["protected_tokens"] <= max(info["total_tokens"], 0)
        assert pool.tree.protected_size <= info["protected_tokens"]  # nothing else holds locks here
        if info["protected_tokens"] == 0:
            assert pool.tree.protected_size == 0

    def teardown(self) -> None:
        if hasattr(self, "pool"):  # every protection goes with its sessions
            self.pool.sessions.clear()
            assert self.pool.tree.protected_size == 0
            self.pool.check()


TestSessionMachine = SessionMachine.TestCase
TestSessionMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------- a real server
POOL_TOKENS = 512
GREEDY = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def srv():
    """A small pool: a flood of 5 x 110 unrelated tokens evicts everything not protected."""
    server = ServerProcess("--max-total-tokens", str(POOL_TOKENS), "--session-ttl", "600")
    yield server
    server.stop()


def ids(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def generate(c, body: dict) -> dict:
    r = c.post("/generate", json={"sampling_params": GREEDY, **body})
    assert r.status_code == 200, r.text
    return r.json()


def run_programs(c, seed: int, with_sessions: bool, calls: int) -> list[float]:
    """Two programs of `calls` calls, each call extending the one before by 30 tokens, with a
    flood before every call; returns the share of each later call's previous prompt found cached."""
    rng = random.Random(seed)
    prompts = {f"prog-{seed}-{i}": ids(60, rng) for i in range(2)}
    shares = []
    for call in range(calls):
        generate(c, {"input_ids": [ids(110, rng) for _ in range(5)],
                     "sampling_params": {**GREEDY, "max_new_tokens": 1}})
        for sid, prompt in prompts.items():
            body = {"input_ids": prompt, **({"session_id": sid} if with_sessions else {})}
            cached = generate(c, body)["meta_info"]["cached_tokens"]
            if call:
                shares.append(cached / (len(prompt) - 30))
            prompts[sid] = prompt + ids(30, rng)
    if with_sessions:
        for sid in prompts:
            assert c.post("/end_session", json={"session_id": sid}).json() == {"session_id": sid, "ended": True}
            assert c.post("/end_session", json={"session_id": sid}).json()["ended"] is False
    return shares


def server_info(c) -> dict:
    return c.get("/get_server_info").json()


def test_sessions_keep_their_hits_under_a_flood_and_leave_no_kv_behind(srv) -> None:
    with srv.client() as c:
        with_sessions = run_programs(c, 1, with_sessions=True, calls=3)
        without = run_programs(c, 2, with_sessions=False, calls=2)
        assert min(with_sessions) >= 0.99, with_sessions  # the whole previous prompt, every call
        assert max(without) <= 0.3, without  # the flood evicted it
        metrics = c.get("/metrics").text
        assert "radixlm_session_protected_tokens 0.0" in metrics and "radixlm_sessions_active 0.0" in metrics
        wait_until(lambda: server_info(c)["num_running_reqs"] == 0, 20, interval=0.2)
        info = server_info(c)
        assert info["kv"]["leaked"] == 0 and info["kv"]["protected"] == 0, info["kv"]
        assert info["sessions"]["active"] == 0 and info["sessions"]["ended"] >= 2
        assert info["session_ttl"] == 600


def test_a_session_id_of_another_tenant_is_refused(srv) -> None:
    with srv.client() as c:
        generate(c, {"input_ids": [5, 6, 7, 8], "session_id": "owned"})
        r = c.post("/generate", json={"input_ids": [5, 6, 7, 8], "session_id": "owned", "cache_salt": "tenant-b"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "session_id", r.text
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "session_id": "owned"}
        r = c.post("/v1/chat/completions", json={**chat, "cache_salt": "tenant-b"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "session_id", r.text
        assert c.post("/v1/chat/completions", json=chat).status_code == 200
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "session_id": "owned",
                                            "cache_salt": "tenant-b"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "session_id", r.text
        assert c.post("/end_session", json={"session_id": "owned"}).json()["ended"] is True
        # Ended: the id is free for another tenant.
        generate(c, {"input_ids": [5, 6, 7, 8], "session_id": "owned", "cache_salt": "tenant-b"})
        assert c.post("/end_session", json={"session_id": "owned"}).json()["ended"] is True


@pytest.mark.parametrize("body", [{"session_id": 7}, {"session_id": ""}, {"session_id": "x" * 129}])
def test_bad_session_ids_get_400_naming_the_field(srv, body) -> None:
    with srv.client() as c:
        r = c.post("/generate", json={"input_ids": [5, 6], **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == "session_id", r.text
        r = c.post("/end_session", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "session_id", r.text


def test_end_session_is_in_the_openapi_document(srv) -> None:
    with srv.client() as c:
        doc = c.get("/openapi.json").json()
    body = doc["paths"]["/end_session"]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert body.endswith("/EndSessionRequest")
    assert "session_id" in doc["components"]["schemas"]["GenerateRequest"]["properties"]


def test_the_engine_keeps_a_session_until_it_ends(engine) -> None:
    """The in-process Engine takes session_id as the server does, and end_session lets it go."""
    params = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    first = engine.generate("Tell me a story about a dog.", params, session_id="engine-session")
    held = engine.scheduler.sessions.protected_tokens
    assert held == first["meta_info"]["prompt_tokens"] + 3  # the last token has no KV yet
    assert engine.end_session("engine-session") and not engine.end_session("engine-session")
    assert engine.scheduler.sessions.protected_tokens == 0
    with pytest.raises(ValueError, match="session_id"):
        engine.generate("hi", {"max_new_tokens": 1}, session_id="")
