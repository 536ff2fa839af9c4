"""The speculative-decoding benchmarks' workloads (CPU and GPU), one request at a time, greedy:
  extraction  a document in, its fields out (the output quotes the input)
  code_edit   a function in, the edited function out (mostly copied)
  chat        ordinary questions (little to copy: speculation must not cost)
  agent       an agent's trace (suffix speculation): four trip sessions of three steps each, every
              prompt quoting the calls made so far as tool-call JSON and every reply started as a
              tool call; the fourth session repeats the first trip (a retry, or another user with
              the same request), so its replies are earlier replies
"""

from __future__ import annotations

import json

from .harness import timed

DOCS = [
    "Invoice 4471. Customer: Maria Lopez, 12 Harbor Street, Lisbon. Items: 3 blue chairs at 45 euros, "
    "1 oak table at 300 euros. Total: 435 euros. Due date: 14 March 2026.",
    "Order 9182 from Jonas Berg, Storgatan 7, Uppsala. Delivered by Nordic Freight on 2 May 2026. "
    "Contents: 12 glass jars, 4 steel lids. Amount paid: 128 kronor by card.",
    "Booking 551 for Aiko Tanaka at the Sakura Hotel, Kyoto, from 3 June 2026 to 7 June 2026, "
    "room 204, breakfast included, total 86000 yen, paid in advance.",
]
CODE = [
    "def total_price(items):\n    total = 0\n    for item in items:\n        total = total + item.price * item.count\n"
    "    return total\n",
    "def find_user(users, name):\n    for user in users:\n        if user.name == name:\n            return user\n"
    "    return None\n",
]
CHAT = ["What is a good name for a pet turtle?", "Give me three tips for sleeping better.",
        "Why is the sky blue?"]


def chat_prompt(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


AGENT_SYSTEM = ("<|im_start|>system\nYou are a travel agent. Tools: get_weather(city), search_flights(origin, "
                "destination, date), book_hotel(city, nights). Reply with one tool call as JSON.<|im_end|>\n")
TRIPS = [("Paris", "Lisbon", "2026-06-03"), ("Berlin", "Madrid", "2026-07-10"), ("Oslo", "Rome", "2026-08-21")]
CITIES = ["Paris", "Lisbon", "Berlin", "Madrid", "Oslo", "Rome", "Vienna", "Prague", "Dublin", "Athens"]


def trips(count: int) -> list[tuple[str, str, str]]:
    """`count` distinct trips (origin, destination, date) for larger agent traces (GPU batches)."""
    pairs = [(a, b) for a in CITIES for b in CITIES if a != b]
    return [(a, b, f"2026-{1 + i % 12:02d}-{1 + i % 28:02d}") for i, (a, b) in enumerate(pairs[:count])]


def agent_trace(trip_list: list[tuple[str, str, str]] = TRIPS) -> list[str]:
    """Each trip's steps in order, each prompt quoting the calls made so far; the reply is
    started as a tool call (`{"name": "`), as a tool-calling template would."""
    prompts = []
    for origin, destination, date in trip_list:
        calls = [{"name": "get_weather", "arguments": {"city": destination}},
                 {"name": "search_flights", "arguments": {"origin": origin, "destination": destination, "date": date}},
                 {"name": "book_hotel", "arguments": {"city": destination, "nights": 3}}]
        for step in range(len(calls)):
            done = "".join(f"Step {i + 1}: {json.dumps(c)} -> ok\n" for i, c in enumerate(calls[:step]))
            prompts.append(AGENT_SYSTEM + f"<|im_start|>user\nTask: fly from {origin} to {destination} on {date} and "
                           f"book a hotel.\n{done}Next tool call?<|im_end|>\n<|im_start|>assistant\n{{\"name\": \"")
    return prompts


WORKLOADS = {
    "extraction": [chat_prompt(f"Document: {d}\nList every field of the document as 'field: value' lines, "
                               "copying the values exactly.") for d in DOCS],
    "code_edit": [chat_prompt(f"Rename the function to snake_case with a _v2 suffix and output the whole "
                              f"function:\n{c}") for c in CODE],
    "chat": [chat_prompt(q) for q in CHAT],
    "agent": agent_trace(TRIPS + TRIPS[:1]),
}


def run(engine, prompts: list[str], max_new: int) -> tuple[float, list[list[int]]]:
    """(seconds, output ids) for the prompts one after another."""
    def each() -> list[dict]:
        return [engine.generate(p, {"temperature": 0, "max_new_tokens": max_new}) for p in prompts]

    outs, seconds = timed(each)
    return seconds, [o["output_ids"] for o in outs]
