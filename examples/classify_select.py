"""Classification with `select`: the model scores every label after the prompt in one batched
call that shares the prompt's KV, and the answer is always one of the labels.

    python examples/classify_select.py [--url URL]
"""

import argparse

import radixlm as sgl

LABELS = ["positive", "negative"]


@sgl.function
def classify(s, review):
    s += sgl.user("Is this review positive or negative? " + review)
    s += sgl.assistant("The review is " + sgl.select("label", LABELS))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running radixlm server (default: start one)")
    args = parser.parse_args()
    backend = sgl.RuntimeEndpoint(args.url) if args.url else sgl.Runtime()
    reviews = ["I loved this movie, it was great!", "Terrible film, boring and way too long.",
               "The actors were wonderful and the music was beautiful.", "I want my money back."]
    try:
        for review, state in zip(reviews, classify.run_batch([{"review": r} for r in reviews], backend=backend)):
            scores = state.get_meta_info("label")["scores"]  # mean token logprob of each label
            detail = ", ".join(f"{label} {score:.2f}" for label, score in zip(LABELS, scores))
            print(f"{state['label']:8s} ({detail})  {review}")
    finally:
        if isinstance(backend, sgl.Runtime):
            backend.shutdown()


if __name__ == "__main__":
    main()
