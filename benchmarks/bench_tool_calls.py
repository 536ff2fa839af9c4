"""What a constrained tool call costs: chat requests with tool_choice "required" (decoding
constrained to the tools' JSON schemas) against the same chats unconstrained, generating the
same number of tokens, on one server with the default model, through the official `openai`
client. Runs alternate and the median is kept; the goal is at most 10% slower. Jump-forward
(on by default) appends the text the schema forces without a decode step each;
`--disable-jump-forward` measures the grammar masks' cost alone.

    python -m benchmarks.bench_tool_calls [--batch 8] [--runs 3] [--out benchmarks/results/cpu_tool_calls.jsonl]
"""

from __future__ import annotations

import argparse
import statistics
from concurrent.futures import ThreadPoolExecutor

from .harness import Reporter, ServerProcess, command_line, timed

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "maxLength": 24},
                                               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 14}},
                                               "required": ["city", "unit", "days"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "search", "description": "Search the web",
                                           "parameters": {"type": "object", "properties": {
                                               "query": {"type": "string", "maxLength": 60}},
                                               "required": ["query"], "additionalProperties": False}}}]
CITIES = ["Paris", "Oslo", "Lima", "Kyoto", "Cairo", "Quito", "Perth", "Dakar", "Hanoi", "Riga", "Bern", "Accra",
          "Sofia", "Lagos", "Seoul", "Doha"]


def chat(client, model: str, city: str, **extra):
    return client.chat.completions.create(
        model=model, temperature=0, messages=[{"role": "user", "content": f"Weather in {city} for the next days?"}],
        tools=TOOLS, **extra)


def timed_batch(client, model: str, cities: list[str], per_request) -> tuple[float, list]:
    """(seconds, responses) for one request per city, all at once."""
    def batch() -> list:
        with ThreadPoolExecutor(len(cities)) as pool:
            return list(pool.map(lambda c: per_request(client, model, c), cities))

    results, seconds = timed(batch)
    return seconds, results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8, help="concurrent requests per run (default 8)")
    parser.add_argument("--runs", type=int, default=3, help="alternating runs of each kind (default 3)")
    parser.add_argument("--max-tokens", type=int, default=60)
    parser.add_argument("--disable-jump-forward", action="store_true",
                        help="decode every token of the calls too (the mask cost alone, without jump-forward's savings)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import openai

    cities = CITIES[:args.batch]
    flags = ["--max-total-tokens", "32768"] + (["--disable-jump-forward"] if args.disable_jump_forward else [])
    server = ServerProcess(*flags, startup_timeout=600, own_group=True)
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=600, max_retries=0)
        model = client.models.list().data[0].id
        # Warm-up: compiles the tools' grammar once (cached after), and fills the prompt cache.
        constrained = lambda c, m, city: chat(c, m, city, tool_choice="required", max_tokens=args.max_tokens)  # noqa: E731
        _, first = timed_batch(client, model, cities, constrained)
        lengths = {city: r.usage.completion_tokens for city, r in zip(cities, first)}
        valid = sum(bool(r.choices[0].message.tool_calls) for r in first)
        plain = lambda c, m, city: chat(c, m, city, tool_choice="none", max_tokens=lengths[city],  # noqa: E731
                                        extra_body={"min_tokens": lengths[city], "ignore_eos": True})
        timed_batch(client, model, cities, plain)
        ours, base = [], []
        for _ in range(args.runs):
            seconds, results = timed_batch(client, model, cities, constrained)
            ours.append(seconds)
            assert [r.usage.completion_tokens for r in results] == [lengths[c] for c in cities], "greedy drifted"
            seconds, results = timed_batch(client, model, cities, plain)
            base.append(seconds)
            assert [r.usage.completion_tokens for r in results] == [lengths[c] for c in cities]
        ratio = statistics.median(ours) / statistics.median(base)
        report = Reporter(args.out, command=command_line())
        report.emit({"bench": "tool_calls", "system": "chat tool_choice=required (constrained)",
                     "baseline": "same chats, tool_choice=none, same output token counts", "batch": args.batch,
                     "jump_forward": not args.disable_jump_forward,
                     "output_tokens": sum(lengths.values()), "calls_with_tool_calls": f"{valid}/{len(cities)}",
                     "ours_s": round(statistics.median(ours), 3), "baseline_s": round(statistics.median(base), 3),
                     "all_ours": [round(s, 3) for s in ours], "all_baseline": [round(s, 3) for s in base],
                     "slowdown": round(ratio, 3), "goal": "<= 1.10", "meets_goal": ratio <= 1.10})
    finally:
        server.stop()


if __name__ == "__main__":
    main()
