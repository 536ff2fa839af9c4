"""Fork: expand two tips in parallel branches that share the trunk's KV cache, then join the
branches' answers back into the main text.

    python examples/parallel_tips_fork.py [--url URL]
"""

import argparse

import radixlm as sgl


@sgl.function
def tip_suggestion(s, topic):
    s += f"Here are two tips for {topic}: 1. Eat a balanced diet. 2. Exercise regularly.\n\n"
    forks = s.fork(2)  # the text so far is prefilled once; both branches start from its cache
    for i, f in enumerate(forks):
        f += f"Now, expand tip {i + 1} into a paragraph:\n"
        f += sgl.gen("detailed_tip", max_tokens=48, stop="\n\n")
    forks.join()  # the branches' `detailed_tip` values come back as a list
    s += "Tip 1:" + s["detailed_tip"][0] + "\n"
    s += "Tip 2:" + s["detailed_tip"][1] + "\n"
    s += "In summary," + sgl.gen("summary", max_tokens=32, stop="\n")
    return forks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running radixlm server (default: start one)")
    args = parser.parse_args()
    backend = sgl.RuntimeEndpoint(args.url) if args.url else sgl.Runtime()
    try:
        state = tip_suggestion.run("staying healthy", backend=backend, temperature=0)
        print(state.text())
        cached = [branch.get_meta_info("detailed_tip")["cached_tokens"] for branch in state.ret_value]
        print(f"\nprompt tokens each branch found cached: {cached}")
    finally:
        if isinstance(backend, sgl.Runtime):
            backend.shutdown()


if __name__ == "__main__":
    main()
