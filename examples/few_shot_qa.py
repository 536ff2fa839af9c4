"""Few-shot question answering over a batch: the shared examples are computed once (run_batch
warms the program's constant prefix), then every question pays only for its own tokens.

    python examples/few_shot_qa.py [--url URL]
"""

import argparse

import radixlm as sgl

EXAMPLES = [
    ("What is the capital of Italy?", "Rome"),
    ("What is the capital of Germany?", "Berlin"),
    ("What is the largest planet?", "Jupiter"),
    ("How many legs does a spider have?", "8"),
]


@sgl.function
def few_shot_qa(s, question):
    s += "Answer each question with a single word or number.\n\n"
    for q, a in EXAMPLES:
        s += f"Q: {q}\nA: {a}\n"
    s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=8, stop="\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running radixlm server (default: start one)")
    args = parser.parse_args()
    backend = sgl.RuntimeEndpoint(args.url) if args.url else sgl.Runtime()
    questions = ["What is the capital of France?", "What is the capital of Japan?", "What is the capital of Spain?",
                 "How many days are in a week?", "How many continents are there?"]
    try:
        states = few_shot_qa.run_batch([{"question": q} for q in questions], backend=backend, temperature=0,
                                       progress_bar=True)
        for question, state in zip(questions, states):
            meta = state.get_meta_info("answer")
            print(f"{question:35s} -> {state['answer'].strip():10s} "
                  f"(cached {meta['cached_tokens']}/{meta['prompt_tokens']} prompt tokens)")
    finally:
        if isinstance(backend, sgl.Runtime):
            backend.shutdown()


if __name__ == "__main__":
    main()
