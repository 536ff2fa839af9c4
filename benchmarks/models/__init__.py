"""The model shapes and the tokenizer the GPU benchmarks and the GPU tests run on, kept in this
folder so that a fresh checkout has them: the Llama-3.1-8B config (dummy weights) and the
Llama-3 tokenizer alone (a vocab-only GGUF; the engine converts it into its cache on first use).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

FOLDER = Path(__file__).resolve().parent
LLAMA_8B_CONFIG = FOLDER / "llama-3.1-8b" / "config.json"
LLAMA3_TOKENIZER_GGUF = FOLDER / "llama3-tokenizer-vocab.gguf"


@dataclass(frozen=True)
class LlamaShape:
    """The sizes the kernel benchmarks build their tensors from."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, path: Path) -> LlamaShape:
        c = json.loads(path.read_text())
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        return cls(c["num_hidden_layers"], c["hidden_size"], c["intermediate_size"], c["num_attention_heads"],
                   c["num_key_value_heads"], head_dim)

    def projections(self) -> dict[str, tuple[int, int]]:
        """(N, K) of each layer's four weight matrices (qkv and gate_up fused, as the engine runs them)."""
        return {"qkv_proj": ((self.heads + 2 * self.kv_heads) * self.head_dim, self.hidden),
                "o_proj": (self.hidden, self.heads * self.head_dim),
                "gate_up_proj": (2 * self.intermediate, self.hidden),
                "down_proj": (self.hidden, self.intermediate)}


LLAMA_8B = LlamaShape.from_config(LLAMA_8B_CONFIG)


def add_engine_model_flags(parser) -> None:
    """--llama8b and --tokenizer-path, for a benchmark that runs Engines on the default model or
    on the 8B shape."""
    parser.add_argument("--llama8b", action="store_true", help="the Llama-3.1-8B shape with dummy weights (GPU)")
    parser.add_argument("--tokenizer-path", default=None, help="--llama8b: a Llama-3 tokenizer directory")


def engine_model(args) -> tuple[dict, str]:
    """(Engine keyword arguments, the model's description) for those flags."""
    if args.llama8b:
        return ({"model_path": str(LLAMA_8B_CONFIG), "load_format": "dummy", "tokenizer_path": args.tokenizer_path},
                "Llama-3.1-8B shape, dummy weights, bf16")
    return {"max_total_tokens": 16384}, "SmolLM2-135M-Instruct (embedded default), float32"
