"""Runtime settings. Flag names follow SGLang's where one exists."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any


def _arg(default: Any, help: str) -> Any:
    """A field with its one-line help for `radixlm serve --help` (which adds the default)."""
    return dataclasses.field(default=default, metadata={"help": help})


def split_addr(addr: str) -> tuple[str, int]:
    """(host, port) of a host:port address ([::1]:port for IPv6)."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"dist_init_addr: expected host:port, got {addr!r}")
    return host.strip("[]"), int(port)


# Settings whose default depends on the device (ServerArgs.with_device_defaults). On CUDA the
# batch cap is cuda_graph_max_bs's default: decode batches past the largest graph run eagerly,
# and the H200's offline workload ran slower with 1024 requests at once than with 512 (docs/gpu.md).
DEVICE_DEFAULTS: dict[str, dict[str, int]] = {
    "cpu": {"max_running_requests": 64, "chunked_prefill_size": 2048},
    "cuda": {"max_running_requests": 512, "chunked_prefill_size": 8192},
}
DEVICE_DEPENDENT_FIELDS = tuple(DEVICE_DEFAULTS["cpu"])


@dataclass(frozen=True)
class ServerArgs:
    model_path: str | None = _arg(None, "Hugging Face directory, hub id or .gguf file; unset: the embedded "
                                        "SmolLM2-135M-Instruct")
    tokenizer_path: str | None = _arg(None, "tokenizer directory, when not the model's own")
    load_format: str = _arg("auto", "auto | dummy (random weights of the config) | gguf | safetensors")
    dtype: str = _arg("auto", "auto (float32 on CPU, bfloat16 on GPU) | float32 | bfloat16 | float16")
    device: str = _arg("auto", "auto (cuda when available, else cpu) | cpu | cuda")
    context_length: int | None = _arg(None, "longest prompt + output in tokens; unset: the model's")
    max_total_tokens: int | None = _arg(None, "KV cache slots; unset: sized from memory")
    max_running_requests: int | None = _arg(None, "requests decoded together at most; unset: 64 on CPU, 512 "
                                                  "on CUDA (the largest decode batch replayed from a CUDA graph)")
    max_queued_requests: int = _arg(256, "requests waiting beyond the running ones at most; more get 429 "
                                         "with Retry-After")
    max_prefill_tokens: int = _arg(8192, "prompt tokens prefilled in one step at most")
    chunked_prefill_size: int | None = _arg(None, "a longer prompt is prefilled in chunks of this many tokens; "
                                                  "unset: 2048 on CPU, 8192 on CUDA")
    page_size: int = _arg(1, "tokens per KV page")
    schedule_policy: str = _arg("lpm", "lpm (longest cached prefix first) | fcfs")
    disable_radix_cache: bool = _arg(False, "do not reuse cached prefixes")
    grammar_compile_timeout: float = _arg(60.0, "seconds a constraint may take to compile; a longer one fails "
                                                "its request alone")
    enable_mixed_chunk: bool = _arg(False, "decoding requests ride along in prefill steps (steadier streams)")
    disable_jump_forward: bool = _arg(False, "constrained decoding: no skipping of grammar-forced text")
    attention_backend: str = _arg("auto", "auto (flashinfer on CUDA with fp16/bf16, else torch_native) | "
                                          "torch_native | flashinfer")
    disable_overlap_schedule: bool = _arg(False, "CUDA: do not run a step's host work while the previous "
                                                 "step computes")
    disable_cuda_graph: bool = _arg(False, "do not replay decode steps from CUDA graphs (they need flashinfer)")
    disable_cascade_attention: bool = _arg(False, "decode reads a shared prefix per request, not once per group")
    cuda_graph_max_bs: int = _arg(512, "largest decode batch replayed from a graph (capped by "
                                       "max_running_requests)")
    # Our kernel paths, each on unless turned off to measure what it gains or to rule it out.
    disable_pdl: bool = _arg(False, "CUDA: launch our Triton kernels without programmatic dependent launch")
    disable_fp8_gemv: bool = _arg(False, "fp8: decode-sized projections through quantize + _scaled_mm, not "
                                         "our FP8 GEMV kernel")
    disable_fused_fp8_quantization: bool = _arg(False, "fp8: the GEMMs' input quantized by its own kernel, not "
                                                       "by the norm or SiLU-and-mul before it")
    disable_fused_rotary_store: bool = _arg(False, "flashinfer: the rotation and the KV store as two kernels")
    mem_fraction_static: float = _arg(0.88, "GPU memory share for weights + KV pool (the rest: activations, "
                                            "graphs)")
    random_seed: int = _arg(0, "seed of the sampler for requests without their own")
    host: str = _arg("127.0.0.1", "address to listen on (0.0.0.0: every interface)")
    port: int = _arg(30000, "HTTP port; a busy one is refused before the model loads")
    api_key: str | None = _arg(None, "require Authorization: Bearer <key> on every route but /health; "
                                     "unset: taken from $RADIXLM_API_KEY if set (keeps it off the command line)")
    rate_limit_rpm: int = _arg(0, "generation requests a client (its API key, else its address) may send per "
                                  "minute; more get 429 with Retry-After; 0: no limit")
    max_request_bytes: int = _arg(8 * 2**20, "request bodies larger than this get 413")
    graceful_shutdown_timeout: float = _arg(30.0, "seconds SIGTERM waits for running requests to finish "
                                                  "before failing them and exiting")
    chat_template: str | None = _arg(None, "a Jinja chat template file to render chats with instead of the "
                                           "model's own")
    tool_call_parser: str | None = _arg(None, "hermes | llama3_json | mistral | json; unset: from the chat "
                                              "template")
    reasoning_parser: str | None = _arg(None, "qwen3 | deepseek-r1: the think block comes back as "
                                              "reasoning_content")
    speculative_algorithm: str | None = _arg(None, "ngram (drafts by prompt lookup, no extra model) | draft "
                                                   "(STANDALONE: a smaller model drafts); unset: no speculative "
                                                   "decoding")
    speculative_num_draft_tokens: int = _arg(4, "draft tokens verified per step")
    speculative_ngram_max_match_window_size: int = _arg(4, "ngram: longest suffix matched against earlier tokens")
    speculative_ngram_min_match_window_size: int = _arg(1, "ngram: shortest suffix matched")
    speculative_draft_model_path: str | None = _arg(None, "draft / STANDALONE: the smaller model that drafts "
                                                          "(same tokenizer as the target)")
    speculative_num_steps: int | None = _arg(None, "draft / STANDALONE: tokens the draft model drafts per "
                                                   "step (unset: speculative_num_draft_tokens)")
    quantization: str | None = _arg(None, "fp8: the layers' projections quantized to FP8 e4m3 at load (per-channel "
                                          "weight scales, per-token activations; checkpoints already in FP8 are "
                                          "refused); unset: the checkpoint's dtype")
    kv_cache_dtype: str = _arg("auto", "auto (the model dtype) | fp8_e4m3 (KV stored in FP8 with scales)")
    tp_size: int = _arg(1, "tensor-parallel ranks: attention heads, MLP and vocabulary split across them")
    dp_size: int = _arg(1, "data-parallel replicas on this host behind a cache-aware router (one per GPU "
                           "group of tp_size GPUs)")
    nnodes: int = _arg(1, "hosts the tensor-parallel ranks span (tp_size / nnodes ranks each)")
    node_rank: int = _arg(0, "this host's index among nnodes; node 0 serves HTTP")
    dist_init_addr: str | None = _arg(None, "host:port of node 0's torch.distributed rendezvous (needed when "
                                            "nnodes > 1; unset: a free local port)")
    dist_timeout: float = _arg(120.0, "seconds to wait for every rank to join, and for a collective to finish, "
                                      "before failing with the ranks that did not answer")
    tp_all_reduce: str = _arg("nccl", "nccl | one_shot (small all-reduces through PyTorch's symmetric memory "
                                      "over NVLink)")

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError("page_size: must be >= 1")
        if self.schedule_policy not in ("lpm", "fcfs"):
            raise ValueError("schedule_policy: must be 'lpm' or 'fcfs'")
        if self.max_running_requests is not None and self.max_running_requests < 1:
            raise ValueError("max_running_requests: must be >= 1")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size < 1:
            raise ValueError("chunked_prefill_size: must be >= 1")
        if self.max_prefill_tokens < 1:
            raise ValueError("max_prefill_tokens: must be >= 1")
        if self.load_format not in ("auto", "dummy", "gguf", "safetensors"):
            raise ValueError("load_format: must be auto, dummy, gguf or safetensors")
        if self.attention_backend not in ("auto", "torch_native", "flashinfer"):
            raise ValueError("attention_backend: must be auto, torch_native or flashinfer")
        if self.grammar_compile_timeout <= 0:
            raise ValueError("grammar_compile_timeout: must be > 0")
        if self.cuda_graph_max_bs < 1:
            raise ValueError("cuda_graph_max_bs: must be >= 1")
        if self.chat_template is not None and not os.path.isfile(self.chat_template):
            raise ValueError(f"chat_template: no file at {self.chat_template!r}")
        if self.tool_call_parser is not None or self.reasoning_parser is not None:
            from .server.chat import ChatOptions

            ChatOptions(self.tool_call_parser, self.reasoning_parser)  # raises naming an unknown parser
        if self.speculative_algorithm is not None:
            self._check_speculative()
        if self.max_queued_requests < 0:
            raise ValueError("max_queued_requests: must be >= 0")
        if self.rate_limit_rpm < 0:
            raise ValueError("rate_limit_rpm: must be >= 0")
        if self.max_request_bytes < 1:
            raise ValueError("max_request_bytes: must be >= 1")
        if self.graceful_shutdown_timeout < 0:
            raise ValueError("graceful_shutdown_timeout: must be >= 0")
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError("mem_fraction_static: must be between 0 and 1")
        self._check_quantization()
        self._check_parallel()

    def _check_parallel(self) -> None:
        if self.tp_size < 1:
            raise ValueError("tp_size: must be >= 1")
        if self.dp_size < 1:
            raise ValueError("dp_size: must be >= 1")
        if self.nnodes < 1 or self.tp_size % self.nnodes:
            raise ValueError(f"nnodes: {self.nnodes} must be >= 1 and divide tp_size {self.tp_size} (each node runs "
                             "tp_size / nnodes ranks)")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank: {self.node_rank} must be between 0 and nnodes - 1 ({self.nnodes - 1})")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("dist_init_addr: required with nnodes > 1 (node 0's host:port, the same on every node)")
        if self.nnodes > 1 and self.dp_size > 1:
            raise ValueError("dp_size: replicas across several nodes are started one per node and joined with "
                             "`radixlm router`, not with --nnodes")
        if self.dist_init_addr:
            split_addr(self.dist_init_addr)  # raises naming the field
        if self.dist_timeout <= 0:
            raise ValueError("dist_timeout: must be > 0")
        if self.tp_all_reduce not in ("nccl", "one_shot"):
            raise ValueError("tp_all_reduce: must be nccl or one_shot")

    def _check_quantization(self) -> None:
        # SGLang's spellings that mean the same thing are accepted and normalised.
        if self.quantization is not None:
            if self.quantization.lower() != "fp8":
                raise ValueError(f"quantization: {self.quantization!r} is not implemented (fp8 is)")
            object.__setattr__(self, "quantization", "fp8")
        kv = self.kv_cache_dtype.lower()
        if kv in ("fp8", "fp8_e4m3", "float8_e4m3fn"):
            object.__setattr__(self, "kv_cache_dtype", "fp8_e4m3")
        elif kv == "auto":
            object.__setattr__(self, "kv_cache_dtype", "auto")
        else:
            raise ValueError(f"kv_cache_dtype: {self.kv_cache_dtype!r} is not implemented (auto or fp8_e4m3 are; "
                             "fp8_e5m2 is not)")

    def _check_speculative(self) -> None:
        name = self.speculative_algorithm
        algorithm = {"ngram": "ngram", "draft": "draft", "standalone": "draft"}.get(name.lower())
        if algorithm is None:
            raise ValueError(f"speculative_algorithm: {name!r} is not implemented (ngram and draft / STANDALONE "
                             "are; EAGLE, EAGLE3 and MTP speculation are not)")
        object.__setattr__(self, "speculative_algorithm", algorithm)  # SGLang spells them NGRAM, STANDALONE
        if not 1 <= self.speculative_num_draft_tokens <= 16:
            raise ValueError("speculative_num_draft_tokens: must be between 1 and 16")
        if algorithm == "ngram":
            if self.speculative_draft_model_path is not None:
                raise ValueError("speculative_draft_model_path: ngram speculation drafts without a model; use "
                                 "--speculative-algorithm draft for a draft model")
            low, high = self.speculative_ngram_min_match_window_size, self.speculative_ngram_max_match_window_size
            if not 1 <= low <= high:
                raise ValueError("speculative_ngram_min_match_window_size: must be >= 1 and at most the max "
                                 "window size")
            return
        if not self.speculative_draft_model_path:
            raise ValueError(f"speculative_draft_model_path: required with speculative_algorithm {name!r}")
        if self.speculative_num_steps is not None and not 1 <= self.speculative_num_steps <= 16:
            raise ValueError("speculative_num_steps: must be between 1 and 16")

    @property
    def speculative_drafts_per_step(self) -> int:
        """Draft tokens a verify step checks: the draft model's forwards, or the n-gram draft length."""
        if not self.speculative_algorithm:
            return 0
        if self.speculative_algorithm == "draft" and self.speculative_num_steps is not None:
            return self.speculative_num_steps
        return self.speculative_num_draft_tokens

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

    def with_device_defaults(self) -> "ServerArgs":
        """These settings with the device-dependent ones the user left unset filled in: a GPU
        batches far more requests, and larger prefill chunks, than a CPU core pair can."""
        unset = [name for name in DEVICE_DEPENDENT_FIELDS if getattr(self, name) is None]
        if not unset:
            return self
        kind = self.resolved_device().split(":")[0]  # "cuda:1" is a CUDA device
        defaults = DEVICE_DEFAULTS.get(kind, DEVICE_DEFAULTS["cpu"])
        return dataclasses.replace(self, **{name: defaults[name] for name in unset})

    def resolved_dtype(self) -> "Any":
        import torch

        if self.dtype == "auto":
            return torch.float32 if self.resolved_device() == "cpu" else torch.bfloat16
        try:
            return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]
        except KeyError:
            raise ValueError("dtype: must be auto, float32, bfloat16 or float16") from None
