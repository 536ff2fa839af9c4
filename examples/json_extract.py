"""JSON extraction: each note becomes a record that validates against a pydantic model. The
runtime constrains decoding to the schema, so every output parses; keys and punctuation the
schema fixes are appended without decode steps (jump-forward).

    python examples/json_extract.py [--url URL]
"""

import argparse

from pydantic import BaseModel, Field

import radixlm as sgl


class Order(BaseModel):
    customer: str = Field(max_length=40)
    item: str = Field(max_length=40)
    quantity: int = Field(ge=1, le=1000)
    express: bool


@sgl.function
def extract_order(s, note):
    s += sgl.system("You turn customer notes into order records.")
    s += sgl.user(f"Note: {note}\nReturn the order as JSON.")
    s += sgl.assistant(sgl.gen("order", json_schema=Order, max_tokens=96))


NOTES = [
    "Hi, this is Dana. Please send 3 boxes of green tea, fast shipping if you can.",
    "Mr. Okafor wants twelve ceramic mugs, no rush.",
    "Order from Lea: 1 standing desk. She needs it by tomorrow!",
    "Paul asks for 250 envelopes, regular delivery is fine.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running radixlm server (default: start one)")
    args = parser.parse_args()
    backend = sgl.RuntimeEndpoint(args.url) if args.url else sgl.Runtime()
    try:
        states = extract_order.run_batch([{"note": n} for n in NOTES], backend=backend, temperature=0,
                                         progress_bar=True)
        for note, state in zip(NOTES, states):
            order = Order.model_validate_json(state["order"])  # always valid: the schema constrained decoding
            print(f"{note[:45]:47s} -> {order.model_dump()}")
    finally:
        if isinstance(backend, sgl.Runtime):
            backend.shutdown()


if __name__ == "__main__":
    main()
