"""A multi-turn chat: roles render through the model's own chat template, and each turn only
appends text, so every earlier turn is served from the radix cache.

    python examples/multi_turn_chat.py [--url URL]
"""

import argparse

import radixlm as sgl


@sgl.function
def chat(s, questions):
    s += sgl.system("You are a helpful assistant. Answer in one sentence.")
    for i, question in enumerate(questions):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen(f"answer_{i}", max_tokens=48))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running radixlm server (default: start one)")
    args = parser.parse_args()
    backend = sgl.RuntimeEndpoint(args.url) if args.url else sgl.Runtime()
    questions = ["What is the capital of France?", "And of Spain?", "Which of the two is further south?"]
    try:
        state = chat.run(questions, backend=backend, temperature=0)
        for i, question in enumerate(questions):
            meta = state.get_meta_info(f"answer_{i}")
            print(f"user:      {question}")
            print(f"assistant: {state[f'answer_{i}']}")
            print(f"           ({meta['cached_tokens']} of {meta['prompt_tokens']} prompt tokens from the cache)")
        print("roles:", [m["role"] for m in state.messages()])
    finally:
        if isinstance(backend, sgl.Runtime):
            backend.shutdown()


if __name__ == "__main__":
    main()
