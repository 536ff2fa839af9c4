"""Generate with the in-process Engine on the embedded default model (SmolLM2-135M-Instruct)."""

from radixlm.srt import Engine


def main() -> None:
    engine = Engine()
    prompts = ["The capital of France is", "The three primary colors are"]
    for out in engine.generate(prompts, {"temperature": 0, "max_new_tokens": 24}):
        meta = out["meta_info"]
        print(f"{out['text']!r}  ({meta['completion_tokens']} tokens, finish: {meta['finish_reason']['type']})")
    # A second call sharing the prompt's prefix is served from the radix cache.
    again = engine.generate(prompts[0] + " a city", {"temperature": 0, "max_new_tokens": 8})
    print(f"cached prompt tokens on the second call: {again['meta_info']['cached_tokens']}")
    engine.shutdown()


if __name__ == "__main__":
    main()
