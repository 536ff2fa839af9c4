"""Runtime settings. Flag names follow SGLang's where one exists."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ServerArgs:
    model_path: str | None = None  # None: the embedded default model
    tokenizer_path: str | None = None
    load_format: str = "auto"  # auto | dummy
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on GPU
    device: str = "auto"  # auto: cuda when available, else cpu
    context_length: int | None = None
    max_total_tokens: int | None = None  # KV slots; None: sized from memory
    max_running_requests: int = 64
    max_prefill_tokens: int = 8192
    chunked_prefill_size: int = 2048
    page_size: int = 1
    schedule_policy: str = "lpm"  # lpm | fcfs
    disable_radix_cache: bool = False
    grammar_compile_timeout: float = 60.0  # seconds; a request whose grammar compiles longer fails alone
    enable_mixed_chunk: bool = False  # decoding requests ride along in prefill steps (steadier streams)
    disable_jump_forward: bool = False  # constrained decoding: no skipping of grammar-forced text
    attention_backend: str = "auto"  # auto: flashinfer on CUDA (fp16/bf16), else torch_native
    disable_overlap_schedule: bool = False  # CUDA: run each step's host work while the previous step computes
    disable_cuda_graph: bool = False  # decode CUDA graphs need the flashinfer backend
    disable_cascade_attention: bool = False  # decode reads a shared prefix once per request, not per group
    cuda_graph_max_bs: int = 512  # largest decode batch replayed from a graph (capped by max_running_requests)
    mem_fraction_static: float = 0.88  # GPU memory share for weights + KV pool (the rest: activations, graphs)
    random_seed: int = 0
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    tool_call_parser: str | None = None  # hermes | llama3_json | mistral | json; None: from the chat template
    reasoning_parser: str | None = None  # qwen3 | deepseek-r1: the think block comes back as reasoning_content

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError("page_size: must be >= 1")
        if self.schedule_policy not in ("lpm", "fcfs"):
            raise ValueError("schedule_policy: must be 'lpm' or 'fcfs'")
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests: must be >= 1")
        if self.load_format not in ("auto", "dummy", "gguf", "safetensors"):
            raise ValueError("load_format: must be auto, dummy, gguf or safetensors")
        if self.attention_backend not in ("auto", "torch_native", "flashinfer"):
            raise ValueError("attention_backend: must be auto, torch_native or flashinfer")
        if self.grammar_compile_timeout <= 0:
            raise ValueError("grammar_compile_timeout: must be > 0")
        if self.cuda_graph_max_bs < 1:
            raise ValueError("cuda_graph_max_bs: must be >= 1")
        if self.tool_call_parser is not None or self.reasoning_parser is not None:
            from radixlm.srt.server.chat import ChatOptions

            ChatOptions(self.tool_call_parser, self.reasoning_parser)  # raises naming an unknown parser
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError("mem_fraction_static: must be between 0 and 1")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "ServerArgs":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown server argument(s): {', '.join(unknown)}")
        return cls(**kwargs)

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_dtype(self) -> "Any":
        import torch

        if self.dtype == "auto":
            return torch.float32 if self.resolved_device() == "cpu" else torch.bfloat16
        try:
            return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]
        except KeyError:
            raise ValueError("dtype: must be auto, float32, bfloat16 or float16") from None
