"""Quickstart: start a server on the embedded default model (SmolLM2-135M-Instruct) and run a
program that uses gen, select and fork, printing each answer as it comes.

    python examples/quickstart.py               # starts `radixlm serve` as a child process
    python examples/quickstart.py --url URL     # uses a server that is already running

On 2 CPU cores the first run takes about a minute (it converts the weights once); the server
says what it is doing while it starts.
"""

import argparse
import sys
import time

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
        # run_batch runs the programs concurrently, so their decode steps share the batch.
        states = city_guide.run_batch([{"city": c} for c in cities], temperature=0, generator_style=True)
        for city, state in zip(cities, states):
            print(f"== {city}")
            print("about:    ", state["about"].strip())
            scores = state.get_meta_info("continent")["scores"]  # mean logprob of each choice's tokens
            print("continent:", state["continent"], "| scores:", " ".join(f"{x:.2f}" for x in scores))
            print("landmark: ", state["fact"][0].strip())
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
