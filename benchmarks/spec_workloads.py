"""The speculative-decoding benchmarks' workloads (CPU and GPU), one request at a time, greedy:
  extraction  a document in, its fields out (the output quotes the input)
  code_edit   a function in, the edited function out (mostly copied)
  chat        ordinary questions (little to copy: speculation must not cost)
"""

from __future__ import annotations

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


WORKLOADS = {
    "extraction": [chat_prompt(f"Document: {d}\nList every field of the document as 'field: value' lines, "
                               "copying the values exactly.") for d in DOCS],
    "code_edit": [chat_prompt(f"Rename the function to snake_case with a _v2 suffix and output the whole "
                              f"function:\n{c}") for c in CODE],
    "chat": [chat_prompt(q) for q in CHAT],
}


def run(engine, prompts: list[str], max_new: int) -> tuple[float, list[list[int]]]:
    """(seconds, output ids) for the prompts one after another."""
    def each() -> list[dict]:
        return [engine.generate(p, {"temperature": 0, "max_new_tokens": max_new}) for p in prompts]

    outs, seconds = timed(each)
    return seconds, [o["output_ids"] for o in outs]
