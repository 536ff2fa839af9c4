"""Benchmarks of the language (radixlm programs) on a radixlm server it starts, each with a
baseline measured in the same run.

few-shot-select: 16 multiple-choice questions (4 options each) after a shared ~800-token
    few-shot prefix, answered by `select` in one `run_batch`. Baseline: HF transformers scoring
    the full prompt + each choice (64 forward passes, no reuse), picking the highest mean
    choice-token logprob as select's token_length_normalized does. Metric: questions/s;
    ratio = ours / HF. Also: accuracy of both, agreement, the server's cache hit rate.
lang-overhead: `run_batch` of 64 one-gen programs against the same 64 requests sent straight to
    /generate (same text, same sampling params, as many in flight as run_batch's
    num_threads="auto" gives). Metric: wall time (median of runs, alternating systems);
    ratio = lang / raw.

The cache is flushed before every timed run. The server is stopped (SIGTERM, then SIGKILL of its
process group) on exit, errors, Ctrl-C and SIGTERM. Traffic goes to 127.0.0.1 only.

    python -m benchmarks.bench_lang --quick
    python -m benchmarks.bench_lang all --out benchmarks/results/cpu_lang.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import logging
import os
import shlex
import signal
import statistics
import sys
import threading
import time
from typing import Any, Callable

import httpx

import radixlm as sgl
from radixlm.function import _thread_count  # what run_batch's num_threads="auto" resolves to

from . import lang_workloads as wl
from .cpu_noise import measure_noise, wait_until_quiet
from .harness import Reporter, ServerProcess, command_line, raise_on_sigterm

logger = logging.getLogger("bench.lang")

BENCHES = ("few-shot-select", "lang-overhead")
NOISY_SHARE = 0.05  # others used > 5% of the cores during a timed run: its numbers are suspect
BUSY_LOAD = 1.5  # 1-minute load average above which the machine counts as busy (2 cores)
GEN_PARAMS = {"max_new_tokens": 16, "ignore_eos": True, "temperature": 0}
FEW_SHOT_PREFIX = wl.few_shot_prefix()


# ---- common ------------------------------------------------------------------------------------

def load_now() -> dict[str, Any]:
    load1 = round(os.getloadavg()[0], 2)
    return {"loadavg_1m": load1, "busy_machine": load1 > BUSY_LOAD}


def bounded(fn: Callable[[], Any], timeout: float, what: str) -> Any:
    """fn() in a daemon thread; TimeoutError if it is not done in `timeout` s (the caller then
    stops the server, which ends the requests still open)."""
    box: dict[str, Any] = {}

    def body() -> None:
        try:
            box["out"] = fn()
        except BaseException as e:
            box["err"] = e

    thread = threading.Thread(target=body, name=f"bench-{what}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(f"{what}: not done after {timeout:.0f}s")
    if "err" in box:
        raise box["err"]
    return box["out"]


def control(base_url: str, method: str, path: str) -> Any:
    resp = httpx.request(method, base_url + path, timeout=60, trust_env=False)
    resp.raise_for_status()
    return resp.json() if resp.headers.get("content-type", "").startswith("application/json") else resp.text


def flush(base_url: str) -> None:
    control(base_url, "POST", "/flush_cache")


def timed_run(fn: Callable[[], Any], pgid: int | None, args: argparse.Namespace, what: str) -> tuple[Any, float, dict]:
    """(result, wall seconds, noise info) of one timed run, after an optional wait for quiet."""
    quiet = wait_until_quiet(args.wait_quiet, pgid, NOISY_SHARE) if args.wait_quiet else None
    load = load_now()

    def run() -> tuple[Any, float]:
        start = time.perf_counter()
        out = bounded(fn, args.max_run_time, what)
        return out, time.perf_counter() - start

    (out, seconds), noise = measure_noise(run, pgid)
    noise.update(load, others_cpu_share_before=quiet, noisy=noise["others_cpu_share"] > NOISY_SHARE)
    return out, seconds, noise


class RetryBudget:
    """How many extra timed runs may replace noisy ones (other processes used the CPU)."""

    def __init__(self, retries: int):
        self.left = retries

    def again(self, noise: dict[str, Any], what: str) -> bool:
        if noise["noisy"] and self.left > 0:
            self.left -= 1
            logger.info("%s: others used %.0f%% of the cores; repeating the run (%d retries left)", what,
                        100 * noise["others_cpu_share"], self.left)
            return True
        return False


def _clean(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [line for line in lines if not line["noisy"]] or lines


# ---- few-shot-select ---------------------------------------------------------------------------

@sgl.function
def multiple_choice(s, question_block, choices):
    s += FEW_SHOT_PREFIX
    s += question_block + sgl.select("answer", choices)


def _select_items(questions: list[wl.MCQuestion]) -> list[dict[str, Any]]:
    return [{"question_block": wl.format_question(q), "choices": wl.choice_texts(q)} for q in questions]


def _accuracy(picks: list[str], questions: list[wl.MCQuestion]) -> float:
    return round(sum(p.strip() == q.answer for p, q in zip(picks, questions)) / len(questions), 4)


def radixlm_select(endpoint: sgl.RuntimeEndpoint, questions: list[wl.MCQuestion]) -> dict[str, Any]:
    states = multiple_choice.run_batch(_select_items(questions), backend=endpoint, temperature=0)
    errors = [repr(s.error()) for s in states if s.error() is not None]
    if errors:
        raise RuntimeError(f"{len(errors)} programs failed: {errors[:3]}")
    return {"picks": [s["answer"] for s in states],
            "scores": [s.get_meta_info("answer")["scores"] for s in states]}


class HFScorer:
    """HF transformers, fp32, scoring each full prompt + choice in its own forward pass. The
    prompt/choice boundary is select's own (the longest common token prefix of prompt and
    prompt + choice), and only the logits the score needs are computed."""

    def __init__(self, model_path: str | None, tokenizer):
        import torch

        from .hf_baseline import load_hf_model

        torch.set_num_threads(os.cpu_count() or 1)
        self.torch = torch
        self.model = load_hf_model(model_path)
        self.tok = tokenizer

    def choice_logprobs(self, seq: list[int], start: int) -> list[float]:
        torch = self.torch
        ids = torch.tensor([seq], dtype=torch.long)
        with torch.inference_mode():
            logits = self.model(input_ids=ids, logits_to_keep=len(seq) - start + 1).logits[0, :-1]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        return logprobs.gather(1, torch.tensor(seq[start:]).unsqueeze(1)).squeeze(1).tolist()

    def score(self, questions: list[wl.MCQuestion], deadline: float) -> dict[str, Any]:
        picks, scores, passes, tokens = [], [], 0, 0
        for q in questions:
            prompt = FEW_SHOT_PREFIX + wl.format_question(q)
            prompt_ids = self.tok.encode(prompt)
            row = []
            for choice in wl.choice_texts(q):
                if time.perf_counter() > deadline:
                    raise TimeoutError("HF baseline passed --max-run-time")
                seq = self.tok.encode(prompt + choice)
                start = max(1, min(_common_prefix_len(prompt_ids, seq), len(seq) - 1))
                lps = self.choice_logprobs(seq, start)
                row.append(sum(lps) / len(lps))
                passes += 1
                tokens += len(seq)
            scores.append(row)
            picks.append(wl.choice_texts(q)[max(range(len(row)), key=row.__getitem__)])
        return {"picks": picks, "scores": scores, "forward_passes": passes, "forward_tokens": tokens}


def local_tokenizer(model_path: str | None):
    """The model's tokenizer in this process (the same ids as the server's /tokenize)."""
    from radixlm.srt.executor.model_loader import load_model
    from radixlm.tokenizer import load_client_tokenizer

    return load_client_tokenizer(load_model(model_path, with_weights=False).local_dir)


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n


def bench_few_shot_select(server: ServerProcess, args: argparse.Namespace) -> None:
    report = Reporter(args.out)
    url, pgid = server.base_url, server.proc.pid
    questions = list(wl.QUESTIONS[:args.num_questions])
    endpoint = sgl.RuntimeEndpoint(url, timeout=args.request_timeout)
    ids = endpoint.tokenize([FEW_SHOT_PREFIX] + [FEW_SHOT_PREFIX + wl.format_question(q) for q in questions])
    if ids is None:
        raise RuntimeError("the server has no /tokenize: select would fall back to text scoring")
    prefix_len, prompt_lens = len(ids[0]), [len(i) for i in ids[1:]]
    common = {"bench": "lang", "workload": "few-shot-select", "questions": len(questions), "choices_per_question": 4,
              "prefix_tokens": prefix_len, "prompt_tokens_mean": round(statistics.fmean(prompt_lens), 1)}

    # Warm-up (untimed): other questions, so the model's first-call costs are not timed.
    warm = [q for q, _ in wl.FEW_SHOT[:2]]
    bounded(lambda: radixlm_select(endpoint, warm), args.max_run_time, "warm-up")
    budget = RetryBudget(args.retry_noisy)
    while True:
        flush(url)
        ours, seconds, noise = timed_run(lambda: radixlm_select(endpoint, questions), pgid, args, "radixlm select")
        info = control(url, "GET", "/get_server_info")
        ours_line = {**common, "system": "radixlm-run_batch-select", "duration_s": round(seconds, 3),
                     "questions_per_s": round(len(questions) / seconds, 3),
                     "accuracy": _accuracy(ours["picks"], questions),
                     "server_cache": info.get("cache"), "server_kv_leaked": (info.get("kv") or {}).get("leaked"),
                     **noise}
        report.emit(ours_line)
        if not budget.again(noise, "radixlm select"):
            break
    server.stop()  # HF runs alone on the cores

    tok = local_tokenizer(args.model_path)  # the server is gone: HF's side tokenizes here
    scorer = HFScorer(args.model_path, tok)
    scorer.choice_logprobs(tok.encode(FEW_SHOT_PREFIX)[:64] + [tok.encode(" Paris")[0]], 64)  # warm-up
    budget = RetryBudget(min(1, args.retry_noisy))  # HF takes minutes: one retry at most
    while True:
        theirs, seconds, noise = timed_run(lambda: scorer.score(questions, time.perf_counter() + args.max_run_time),
                                           None, args, "HF scoring")
        theirs_line = {**common, "system": "hf-transformers-full-prompts", "duration_s": round(seconds, 3),
                       "questions_per_s": round(len(questions) / seconds, 3),
                       "accuracy": _accuracy(theirs["picks"], questions), "forward_passes": theirs["forward_passes"],
                       "forward_tokens": theirs["forward_tokens"], **noise}
        report.emit(theirs_line)
        if not budget.again(noise, "HF scoring"):
            break

    same = sum(a == b for a, b in zip(ours["picks"], theirs["picks"]))
    score_diff = max(abs(a - b) for ra, rb in zip(ours["scores"], theirs["scores"]) for a, b in zip(ra, rb))
    ratio = ours_line["questions_per_s"] / theirs_line["questions_per_s"]
    report.emit({"bench": "lang", "workload": "few-shot-select", "system": ours_line["system"],
                 "baseline": theirs_line["system"], "metric": "questions_per_s", "ours": ours_line["questions_per_s"],
                 "theirs": theirs_line["questions_per_s"], "ratio": round(ratio, 2), "goal": 10.0,
                 "meets_goal": ratio >= 10.0, "accuracy_ours": ours_line["accuracy"],
                 "accuracy_theirs": theirs_line["accuracy"], "same_picks": f"{same}/{len(questions)}",
                 "max_abs_score_diff": float(f"{score_diff:.3g}"),
                 "cache_hit_rate": (ours_line["server_cache"] or {}).get("hit_rate"),
                 "noisy": ours_line["noisy"] or theirs_line["noisy"],
                 "busy_machine": ours_line["busy_machine"] or theirs_line["busy_machine"],
                 "picks_ours": [p.strip() for p in ours["picks"]],
                 "picks_theirs": [p.strip() for p in theirs["picks"]]})


# ---- lang-overhead -----------------------------------------------------------------------------

@sgl.function
def one_gen(s, prompt):
    s += prompt
    s += sgl.gen("out", max_tokens=GEN_PARAMS["max_new_tokens"], ignore_eos=GEN_PARAMS["ignore_eos"],
                 temperature=GEN_PARAMS["temperature"])


def lang_batch(endpoint: sgl.RuntimeEndpoint, prompts: list[str]) -> list[dict[str, Any]]:
    states = one_gen.run_batch([{"prompt": p} for p in prompts], backend=endpoint, num_threads="auto")
    errors = [repr(s.error()) for s in states if s.error() is not None]
    if errors:
        raise RuntimeError(f"{len(errors)} programs failed: {errors[:3]}")
    return [{"text": s["out"], "meta_info": s.get_meta_info("out")} for s in states]


def raw_batch(base_url: str, prompts: list[str], in_flight: int, timeout: float) -> list[dict[str, Any]]:
    async def main() -> list[dict[str, Any]]:
        gate = asyncio.Semaphore(in_flight)
        limits = httpx.Limits(max_connections=in_flight, max_keepalive_connections=in_flight)
        async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits, trust_env=False) as client:
            async def one(prompt: str) -> dict[str, Any]:
                async with gate:
                    resp = await client.post("/generate", json={"text": prompt, "sampling_params": GEN_PARAMS})
                resp.raise_for_status()
                return resp.json()

            return list(await asyncio.gather(*(one(p) for p in prompts)))

    return asyncio.run(main())


def _check(outs: list[dict[str, Any]], system: str) -> dict[str, Any]:
    short = sum(o["meta_info"]["completion_tokens"] != GEN_PARAMS["max_new_tokens"] for o in outs)
    if short:
        raise RuntimeError(f"{system}: {short} requests did not produce {GEN_PARAMS['max_new_tokens']} tokens")
    return {"prompt_tokens": sum(o["meta_info"]["prompt_tokens"] for o in outs),
            "cached_tokens": sum(o["meta_info"].get("cached_tokens", 0) for o in outs),
            "output_tokens": sum(o["meta_info"]["completion_tokens"] for o in outs)}


def bench_lang_overhead(server: ServerProcess, args: argparse.Namespace) -> None:
    report = Reporter(args.out)
    url, pgid = server.base_url, server.proc.pid
    prompts = wl.overhead_prompts(args.num_programs)
    in_flight = _thread_count("auto", len(prompts))
    endpoint = sgl.RuntimeEndpoint(url, timeout=args.request_timeout)
    systems = {
        "radixlm-run_batch-gen": lambda: lang_batch(endpoint, prompts),
        "raw-generate": lambda: raw_batch(url, prompts, in_flight, args.request_timeout),
    }
    common = {"bench": "lang", "workload": "lang-overhead", "programs": len(prompts), "in_flight": in_flight,
              "sampling_params": GEN_PARAMS}
    warm = wl.overhead_prompts(4)
    bounded(lambda: lang_batch(endpoint, warm), args.max_run_time, "warm-up")
    bounded(lambda: raw_batch(url, warm, in_flight, args.request_timeout), args.max_run_time, "warm-up")

    lines: dict[str, list[dict[str, Any]]] = {name: [] for name in systems}
    texts: dict[str, list[str]] = {}
    budget = RetryBudget(args.retry_noisy)
    for run in range(args.num_runs):
        order = list(systems) if run % 2 == 0 else list(systems)[::-1]  # ABBAAB: drift hits both alike
        for name in order:
            while True:
                flush(url)
                outs, seconds, noise = timed_run(systems[name], pgid, args, name)
                texts.setdefault(name, [o["text"] for o in outs])
                line = {**common, "system": name, "run": run, "duration_s": round(seconds, 3),
                        "req_s": round(len(prompts) / seconds, 3), **_check(outs, name), **noise}
                lines[name].append(line)
                report.emit(line)
                if not budget.again(noise, name):
                    break
    times = {name: [line["duration_s"] for line in _clean(lines[name])] for name in systems}
    every = [line for name in systems for line in lines[name]]
    noisy = any(line["noisy"] for name in systems for line in _clean(lines[name]))
    busy = any(line["busy_machine"] for line in every)
    lang_s, raw_s = (statistics.median(times[name]) for name in systems)
    same = sum(a == b for a, b in zip(*texts.values()))
    report.emit({"bench": "lang", "workload": "lang-overhead", "system": "radixlm-run_batch-gen",
                 "baseline": "raw-generate", "metric": "wall_s (median of runs, clean ones if any)",
                 "runs": args.num_runs, "ours": round(lang_s, 3), "theirs": round(raw_s, 3),
                 "ratio": round(lang_s / raw_s, 3), "goal": 1.05, "meets_goal": lang_s / raw_s <= 1.05,
                 "all_ours": [round(t, 3) for t in times["radixlm-run_batch-gen"]],
                 "all_theirs": [round(t, 3) for t in times["raw-generate"]], "in_flight": in_flight,
                 "noisy_runs_dropped": sum(len(lines[name]) - len(_clean(lines[name])) for name in systems),
                 "same_outputs": f"{same}/{len(prompts)}", "noisy": noisy, "busy_machine": busy})


# ---- main --------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("bench", nargs="?", choices=[*BENCHES, "all"], default="all")
    p.add_argument("--quick", action="store_true", help="smoke run: 4 questions, 16 programs, 1 run")
    p.add_argument("--num-questions", type=int, default=None, help=f"few-shot-select (max {len(wl.QUESTIONS)})")
    p.add_argument("--num-programs", type=int, default=None, help="lang-overhead programs (default 64)")
    p.add_argument("--num-runs", type=int, default=None, help="lang-overhead runs per system (default 3)")
    p.add_argument("--model-path", default=None, help="passed to the server and the HF baseline")
    p.add_argument("--server-args", default="", help="extra flags for the server")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--request-timeout", type=float, default=300.0, help="seconds per HTTP request")
    p.add_argument("--max-run-time", type=float, default=600.0, help="seconds per timed run (HF included)")
    p.add_argument("--wait-quiet", type=float, default=0.0,
                   help="before each timed run, wait up to this many seconds for other processes to go quiet")
    p.add_argument("--retry-noisy", type=int, default=2,
                   help="extra timed runs allowed to replace noisy ones (others used > 5%% of the cores)")
    p.add_argument("--out", help="append the command and JSON lines to this file")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    quick = args.quick
    args.num_questions = args.num_questions or (4 if quick else len(wl.QUESTIONS))
    args.num_programs = args.num_programs or (16 if quick else 64)
    args.num_runs = args.num_runs or (1 if quick else 3)
    if not 1 <= args.num_questions <= len(wl.QUESTIONS):
        parser.error(f"--num-questions: must be 1..{len(wl.QUESTIONS)}")
    if args.num_programs < 1 or args.num_runs < 1 or args.retry_noisy < 0:
        parser.error("--num-programs and --num-runs: must be >= 1; --retry-noisy: >= 0")
    return args


def with_server(args: argparse.Namespace, fn: Callable[[ServerProcess, argparse.Namespace], None]) -> None:
    extra = shlex.split(args.server_args) + (["--model-path", args.model_path] if args.model_path else [])
    server = ServerProcess(*extra, startup_timeout=args.startup_timeout, own_group=True)
    try:
        fn(server, args)
    finally:
        server.stop()


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, raise_on_sigterm)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        header = {"bench": "lang", "command": command_line(),
                  "time": datetime.datetime.now().isoformat(timespec="seconds"), "quick": args.quick,
                  "cpu_count": os.cpu_count(), "server_args": args.server_args, **load_now()}
        with open(args.out, "a") as f:
            f.write(json.dumps(header) + "\n")
    benches = BENCHES if args.bench == "all" else (args.bench,)
    try:
        if "lang-overhead" in benches:  # first: few-shot-select stops its server before the HF baseline
            with_server(args, bench_lang_overhead)
        if "few-shot-select" in benches:
            with_server(args, bench_few_shot_select)
    except BaseException as e:  # the file says the run above has no summary, and why
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps({"bench": "lang", "aborted": f"{type(e).__name__}: {e}"}) + "\n")
        raise
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:  # the server was stopped on the way out
        sys.exit(130)
