"""Quickstart: start a server on the embedded default model (SmolLM2-135M-Instruct) and run a
program that uses gen, select and fork.

    python examples/quickstart.py               # starts `radixlm serve` as a child process
    python examples/quickstart.py --url URL     # uses a server that is already running
"""

import argparse

import radixlm as sgl


@sgl.function
def city_guide(s, city):
    s += sgl.system("You are a concise travel guide.")
    s += sgl.user(f"Describe {city} in one sentence.")
    s += sgl.assistant(sgl.gen("about", max_tokens=40))
    s += sgl.user(f"Which continent is {city} in?")
    s += sgl.assistant(f"{city} is in " + sgl.select("continent", ["Europe", "Asia", "Africa", "America"]))
    # Two follow-up questions in parallel; both branches reuse the conversation's KV cache.
    forks = s.fork(2)
    forks += [sgl.user("Name one famous landmark there."), sgl.user("Name one typical dish there.")]
    forks += sgl.assistant(sgl.gen("fact", max_tokens=40))
    forks.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running radixlm server (default: start one)")
    args = parser.parse_args()
    backend = sgl.RuntimeEndpoint(args.url) if args.url else sgl.Runtime()
    sgl.set_default_backend(backend)
    try:
        for city in ["Paris", "Tokyo", "Cairo"]:
            state = city_guide.run(city, temperature=0)
            print(f"== {city}")
            print("about:    ", state["about"])
            scores = state.get_meta_info("continent")["scores"]  # mean logprob of each choice's tokens
            print("continent:", state["continent"], "| scores:", " ".join(f"{x:.2f}" for x in scores))
            print("landmark: ", state["fact"][0])
            print("dish:     ", state["fact"][1])
        cache = backend.get_server_info()["cache"]
        print(f"radix cache hit rate: {cache['hit_rate']:.0%} ({cache['hit_tokens']} of {cache['queried_tokens']} "
              "prompt tokens)")
    finally:
        if isinstance(backend, sgl.Runtime):
            backend.shutdown()


if __name__ == "__main__":
    main()
