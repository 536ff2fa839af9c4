"""Quickstart: start a server on the embedded default model (SmolLM2-135M-Instruct) and run a
program that uses gen, select and fork, printing each answer as it comes.

    python examples/quickstart.py               # starts `radixlm serve` as a child process
    python examples/quickstart.py --url URL     # uses a server that is already running

It says what it is doing all along: the server's start (on a first run it converts the weights
once, which takes about half a minute on 2 CPU cores), then each answer as it is generated.
"""

import argparse
import sys
import time
from collections.abc import Iterator

import radixlm as sgl


@sgl.function
def city_guide(s, city):
    s += sgl.system("You are a concise travel guide.")
    s += sgl.user(f"Describe {city} in one sentence.")
    s += sgl.assistant(sgl.gen("about", max_tokens=32, stop="\n"))
    s += sgl.user(f"Which continent is {city} in?")
    s += sgl.assistant(f"{city} is in " + sgl.select("continent", ["Europe", "Asia", "Africa", "America"]))
    # Two follow-up questions in parallel; both branches reuse the conversation's KV cache.
    forks = s.fork(2)
    forks += [sgl.user("Name one famous landmark there."), sgl.user("Name one typical dish there.")]
    forks += sgl.assistant(sgl.gen("fact", max_tokens=24, stop="\n"))
    forks.join()


def print_as_generated(label: str, pieces: Iterator[str]) -> None:
    """Prints a label, then the text piece by piece as the server generates it."""
    print(label, end=" ", flush=True)
    text_began = False
    for piece in pieces:
        piece = piece if text_began else piece.lstrip()
        text_began = text_began or bool(piece)
        print(piece, end="", flush=True)
    print(flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running radixlm server (default: start one)")
    args = parser.parse_args()
    started = time.perf_counter()
    backend = sgl.RuntimeEndpoint(args.url) if args.url else sgl.Runtime()
    sgl.set_default_backend(backend)
    try:
        cities = ["Paris", "Tokyo"]
        print(f"asking about {' and '.join(cities)} at once (one batch on the server)...", flush=True)
        # stream=True returns at once and runs each program in its own thread: both are on the
        # server together, so their decode steps share a batch, and each answer shows as it comes.
        states = [city_guide.run(city=city, temperature=0, stream=True) for city in cities]
        for city, state in zip(cities, states):
            print(f"== {city}")
            print_as_generated("about:    ", state.text_iter("about"))
            scores = state.get_meta_info("continent")["scores"]  # mean logprob of each choice's tokens
            print("continent:", state["continent"], "| scores:", " ".join(f"{x:.2f}" for x in scores), flush=True)
            print("landmark: ", end=" ", flush=True)  # the fork's two branches, set when they join
            if state.error() is not None:  # waits for the program's end
                raise state.error()
            print(state["fact"][0].strip())
            print("dish:     ", state["fact"][1].strip(), flush=True)
        cache = backend.get_server_info()["cache"]
        print(f"radix cache hit rate: {cache['hit_rate']:.0%} ({cache['hit_tokens']} of {cache['queried_tokens']} "
              f"prompt tokens); {time.perf_counter() - started:.0f}s in all")
    finally:
        if isinstance(backend, sgl.Runtime):
            backend.shutdown()


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C: the server was stopped on the way out; no traceback
        print("interrupted", file=sys.stderr)
        sys.exit(130)
