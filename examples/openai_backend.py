"""The same programs through an OpenAI-compatible API — here our own server's /v1 routes.

Gens at the start of an assistant turn go through /v1/chat/completions, other gens through
/v1/completions, and select scores the choices with completion logprobs (echo).

    python examples/openai_backend.py [--url URL]    # URL of a radixlm server (without /v1)
"""

import argparse

import radixlm as sgl


@sgl.function
def chat(s):
    s += sgl.system("You are a helpful assistant.")
    s += sgl.user("What is the capital of France?")
    s += sgl.assistant(sgl.gen("answer", max_tokens=24))
    s += sgl.user("Is that city in Europe? Answer yes or no.")
    s += sgl.assistant(sgl.select("yes_no", ["yes", "no"]))


@sgl.function
def complete(s, country):
    s += "The capital of Italy is Rome.\n"
    s += f"The capital of {country} is" + sgl.gen("capital", max_tokens=12, stop=["\n", "."])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running radixlm server (default: start one)")
    args = parser.parse_args()
    runtime = None if args.url else sgl.Runtime()
    base_url = args.url or runtime.url
    backend = sgl.OpenAI("default", base_url=base_url.rstrip("/") + "/v1", api_key="unused")
    try:
        state = chat.run(backend=backend, temperature=0)
        print("chat:      ", state["answer"], "| in Europe:", state["yes_no"])
        print("completion:", complete.run("France", backend=backend, temperature=0)["capital"].strip())
        streamed = complete.run("Japan", backend=backend, temperature=0, stream=True)
        print("streamed:  ", end="")
        for piece in streamed.text_iter("capital"):
            print(piece, end="", flush=True)
        print()
    finally:
        if runtime is not None:
            runtime.shutdown()


if __name__ == "__main__":
    main()
