"""Runtime settings, grouped by the component that reads them; each component receives its
section. Flag names follow SGLang's where one exists, and stay flat on the command line and in
`Engine(**kwargs)` (`--max-total-tokens`, `max_total_tokens=`).

Every field carries its help, and its choices or range where it has them (setting_fields.py):
`radixlm serve`'s flags are generated from the fields (server_flags.py), so a bad flag is one
argparse-style line before anything loads, and `Engine(...)` gets the same check as a
ValueError naming the field.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any

from .feature_settings import LoRASettings, MultimodalSettings, SessionSettings, SpeculativeSettings
from .setting_fields import Section, setting

API_KEY_ENV = "RADIXLM_API_KEY"
_HUB_ID_RE = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def looks_like_hub_id(source: str) -> bool:
    """Whether a model path that is not on disk could name a Hugging Face hub repository."""
    return _HUB_ID_RE.fullmatch(source) is not None and not source.endswith((".gguf", ".json", ".safetensors"))


@dataclass(frozen=True)
class ModelSettings(Section):
    """What is loaded and the numbers it computes in (the executor's, and the tokenizer's)."""

    model_path: str | None = setting(None, "Hugging Face directory, hub id or .gguf file; unset: the embedded "
                                           "SmolLM2-135M-Instruct")
    tokenizer_path: str | None = setting(None, "tokenizer directory, when not the model's own")
    load_format: str = setting("auto", "auto | dummy (random weights of the config) | gguf | safetensors",
                               choices=("auto", "dummy", "gguf", "safetensors"))
    dtype: str = setting("auto", "auto (float32 on CPU, bfloat16 on GPU) | float32 | bfloat16 | float16",
                         choices=("auto", "float32", "bfloat16", "float16"))
    device: str = setting("auto", "auto (cuda when available, else cpu) | cpu | cuda")
    context_length: int | None = setting(None, "longest prompt + output in tokens; unset: the model's", min=1)
    quantization: str | None = setting(None, "fp8: the layers' projections quantized to FP8 e4m3 at load "
                                             "(per-channel weight scales, per-token activations); unset: the "
                                             "checkpoint's dtype",
                                       choices=("fp8",), refusal="is not implemented (fp8 is)")
    kv_cache_dtype: str = setting("auto", "auto (the model dtype) | fp8_e4m3 (KV stored in FP8 with scales)",
                                  choices=("auto", "fp8_e4m3"),
                                  refusal="is not implemented (auto or fp8_e4m3 are; fp8_e5m2 is not)")
    random_seed: int = setting(0, "seed of the sampler for requests without their own")

    # SGLang's spellings that mean the same thing are accepted and normalised.
    ALIASES = {"quantization": {"fp8": "fp8"},
               "kv_cache_dtype": {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3"}}

    def check(self) -> None:
        for name in ("model_path", "tokenizer_path"):
            path = getattr(self, name)
            if path is not None and not os.path.exists(os.path.expanduser(path)) and not looks_like_hub_id(path):
                raise ValueError(f"{name}: no file or directory at {path!r} (nor is it a hub id)")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device: must be auto, cpu, cuda or cuda:N (got {self.device!r})")

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_dtype(self) -> Any:
        import torch

        if self.dtype == "auto":
            return torch.float32 if self.resolved_device() == "cpu" else torch.bfloat16
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]


@dataclass(frozen=True)
class CacheSettings(Section):
    """The KV pool and the radix cache over it."""

    max_total_tokens: int | None = setting(None, "KV cache slots; unset: sized from memory", min=1)
    mem_fraction_static: float = setting(0.88, "GPU memory share for weights + KV pool (the rest: activations, "
                                               "graphs)", above=0.0, below=1.0)
    page_size: int = setting(1, "tokens per KV page", min=1)
    disable_radix_cache: bool = setting(False, "do not reuse cached prefixes")
    # The hierarchical cache (docs/hicache.md): evicted prefixes move to host memory, and to disk.
    enable_hierarchical_cache: bool = setting(False, "keep prefixes evicted from the KV pool in host memory "
                                                     "(and on disk with --hicache-storage-backend file)")
    hicache_ratio: float = setting(2.0, "host tier size as a multiple of the KV pool", above=1.0)
    hicache_size: float = setting(0.0, "host tier size in GB; 0: set by --hicache-ratio", min=0.0)
    hicache_write_policy: str = setting("write_back", "write_back (copy to host on eviction) | write_through "
                                                      "(copy on insert)",
                                        choices=("write_back", "write_through"),
                                        refusal="is not implemented (write_back or write_through are)")
    hicache_storage_backend: str | None = setting(None, "file: a disk tier under --hicache-storage-dir that "
                                                        "outlives the process; unset: none", choices=("file",),
                                                  refusal="is not implemented (file is)")
    hicache_storage_dir: str | None = setting(None, "directory of the disk tier (shared by replicas of one model)")
    hicache_storage_max_gb: float = setting(0.0, "disk tier size bound in GB (oldest blocks go first); 0: unbounded",
                                            min=0.0)
    hicache_storage_prefetch_policy: str = setting("wait_complete", "how long admission waits for a request's "
                                                                    "disk blocks, read while it waits: wait_complete "
                                                                    "(all) | timeout | best_effort (not at all)",
                                                   choices=("wait_complete", "timeout", "best_effort"),
                                                   refusal="is not implemented (wait_complete, timeout and "
                                                           "best_effort are)")
    hicache_storage_prefetch_timeout: float = setting(1.0, "seconds admission waits for disk blocks under the "
                                                           "timeout policy", min=0.0)

    def check(self) -> None:
        if self.hicache_storage_backend and not self.hicache_storage_dir:
            raise ValueError("hicache_storage_dir: required with --hicache-storage-backend file")
        if self.hicache_storage_backend and not self.enable_hierarchical_cache:
            raise ValueError("hicache_storage_backend: needs --enable-hierarchical-cache")
        if self.enable_hierarchical_cache and self.disable_radix_cache:
            raise ValueError("enable_hierarchical_cache: cannot be combined with --disable-radix-cache")


# Settings whose default depends on the device (ServerArgs.with_device_defaults). On CUDA the
# batch cap is cuda_graph_max_bs's default: decode batches past the largest graph run eagerly,
# and the H200's offline workload ran slower with 1024 requests at once than with 512 (docs/gpu.md).
DEVICE_DEFAULTS: dict[str, dict[str, int]] = {
    "cpu": {"max_running_requests": 64, "chunked_prefill_size": 2048},
    "cuda": {"max_running_requests": 512, "chunked_prefill_size": 8192},
}
DEVICE_DEPENDENT_FIELDS = tuple(DEVICE_DEFAULTS["cpu"])


@dataclass(frozen=True)
class SchedulerSettings(Section):
    """The scheduling policy: admission, batching, chunked prefill, the step pipeline, grammars."""

    max_running_requests: int | None = setting(None, "requests decoded together at most; unset: 64 on CPU, 512 "
                                                     "on CUDA (the largest decode batch replayed from a CUDA graph)",
                                               min=1)
    max_queued_requests: int = setting(256, "requests waiting beyond the running ones at most; more get 429 with "
                                            "Retry-After", min=0)
    max_prefill_tokens: int = setting(8192, "prompt tokens prefilled in one step at most", min=1)
    chunked_prefill_size: int | None = setting(None, "a longer prompt is prefilled in chunks of this many tokens; "
                                                     "unset: 2048 on CPU, 8192 on CUDA", min=1)
    schedule_policy: str = setting("lpm", "lpm (longest cached prefix first) | fcfs", choices=("lpm", "fcfs"))
    enable_mixed_chunk: bool = setting(False, "decoding requests ride along in prefill steps (steadier streams)")
    disable_overlap_schedule: bool = setting(False, "CUDA: do not run a step's host work while the previous step "
                                                    "computes")
    grammar_compile_timeout: float = setting(60.0, "seconds a constraint may take to compile; a longer one fails "
                                                   "its request alone", above=0.0)
    disable_jump_forward: bool = setting(False, "constrained decoding: no skipping of grammar-forced text")


@dataclass(frozen=True)
class ExecutorSettings(Section):
    """The device engine: attention backend, CUDA graphs, and our kernel paths (each on unless
    turned off to measure what it gains, or to rule it out)."""

    attention_backend: str = setting("auto", "auto (flashinfer on CUDA with fp16/bf16, else torch_native) | "
                                             "torch_native | flashinfer",
                                     choices=("auto", "torch_native", "flashinfer"))
    disable_cuda_graph: bool = setting(False, "do not replay decode steps from CUDA graphs (they need flashinfer)")
    disable_cascade_attention: bool = setting(False, "decode reads a shared prefix per request, not once per group")
    cuda_graph_max_bs: int = setting(512, "largest decode batch replayed from a graph (capped by "
                                          "max_running_requests)", min=1)
    disable_pdl: bool = setting(False, "CUDA: launch our Triton kernels without programmatic dependent launch")
    disable_fp8_gemv: bool = setting(False, "fp8: decode-sized projections through quantize + _scaled_mm, not "
                                            "our FP8 GEMV kernel")
    disable_fused_fp8_quantization: bool = setting(False, "fp8: the GEMMs' input quantized by its own kernel, not "
                                                          "by the norm or SiLU-and-mul before it")
    disable_fused_rotary_store: bool = setting(False, "flashinfer: the rotation and the KV store as two kernels")
    disable_onednn_linear: bool = setting(False, "CPU: float32 projections through F.linear (MKL), not oneDNN over "
                                                 "weights packed at load")
    enable_deterministic_inference: bool = setting(False, "a request's tokens and logprobs do not depend on its "
                                                          "batch, prefill chunks or cached prefix; sampling seeded "
                                                          "per request (docs/deterministic.md)")


def split_addr(addr: str) -> tuple[str, int]:
    """(host, port) of a host:port address ([::1]:port for IPv6)."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"dist_init_addr: expected host:port, got {addr!r}")
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class ParallelSettings(Section):
    """Tensor parallelism (across hosts too) and data-parallel replicas behind the router."""

    tp_size: int = setting(1, "tensor-parallel ranks: attention heads, MLP and vocabulary split across them", min=1)
    dp_size: int = setting(1, "data-parallel replicas on this host behind a cache-aware router (one per GPU group "
                              "of tp_size GPUs)", min=1)
    nnodes: int = setting(1, "hosts the tensor-parallel ranks span (tp_size / nnodes ranks each)", min=1)
    node_rank: int = setting(0, "this host's index among nnodes; node 0 serves HTTP", min=0)
    dist_init_addr: str | None = setting(None, "host:port of node 0's torch.distributed rendezvous (needed when "
                                               "nnodes > 1; unset: a free local port)")
    dist_timeout: float = setting(120.0, "seconds to wait for every rank to join, and for a collective to finish, "
                                         "before failing with the ranks that did not answer", above=0.0)
    tp_all_reduce: str = setting("nccl", "nccl | one_shot (small all-reduces through PyTorch's symmetric memory "
                                         "over NVLink)", choices=("nccl", "one_shot"))

    def check(self) -> None:
        if self.tp_size % self.nnodes:
            raise ValueError(f"nnodes: {self.nnodes} must be >= 1 and divide tp_size {self.tp_size} (each node runs "
                             "tp_size / nnodes ranks)")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank: {self.node_rank} must be between 0 and nnodes - 1 ({self.nnodes - 1})")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("dist_init_addr: required with nnodes > 1 (node 0's host:port, the same on every node)")
        if self.nnodes > 1 and self.dp_size > 1:
            raise ValueError("dp_size: replicas across several nodes are started one per node and joined with "
                             "`radixlm router`, not with --nnodes")
        if self.dist_init_addr:
            split_addr(self.dist_init_addr)  # raises naming the field


@dataclass(frozen=True)
class HTTPSettings(Section):
    """The HTTP server in the main process: where it listens, who may call it, its limits."""

    host: str = setting("127.0.0.1", "address to listen on (0.0.0.0: every interface)")
    port: int = setting(30000, "HTTP port; a busy one is refused before the model loads", min=1, max=65535)
    api_key: str | None = setting(None, "require Authorization: Bearer <key> on every route but /health",
                                  env=API_KEY_ENV)
    rate_limit_rpm: int = setting(0, "generation requests a client (its API key, else its address) may send per "
                                     "minute; more get 429 with Retry-After; 0: no limit", min=0)
    max_request_bytes: int = setting(8 * 2**20, "request bodies larger than this get 413", min=1)
    graceful_shutdown_timeout: float = setting(30.0, "seconds SIGTERM waits for running requests to finish before "
                                                     "failing them and exiting", min=0.0)
    log_level: str = setting("info", "debug | info | warning | error", choices=("debug", "info", "warning", "error"))


TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "json")  # srt/server/tool_calls/parsers.py
REASONING_PARSERS = ("qwen3", "deepseek-r1")  # srt/server/tool_calls/reasoning.py


@dataclass(frozen=True)
class APISettings(Section):
    """How the routes answer: the model's name, chats rendered and read back, stream events."""

    served_model_name: str | None = setting(None, "model id in /v1/models; unset: the model path, or 'default' for "
                                                  "the embedded model")
    chat_template: str | None = setting(None, "a Jinja chat template file to render chats with instead of the "
                                              "model's own")
    tool_call_parser: str | None = setting(None, "hermes | llama3_json | mistral | json; unset: from the chat "
                                                 "template", choices=TOOL_CALL_PARSERS)
    reasoning_parser: str | None = setting(None, "qwen3 | deepseek-r1: the think block comes back as "
                                                 "reasoning_content", choices=REASONING_PARSERS)
    incremental_streaming_output: bool = setting(False, "native /generate streams: each event holds only the "
                                                        "text, ids and logprobs new since the one before (unset: "
                                                        "everything so far, SGLang's default)")

    def check(self) -> None:
        if self.chat_template is not None and not os.path.isfile(self.chat_template):
            raise ValueError(f"chat_template: no file at {self.chat_template!r}")


SECTIONS: dict[str, type[Section]] = {
    "model": ModelSettings, "cache": CacheSettings, "scheduler": SchedulerSettings, "executor": ExecutorSettings,
    "speculative": SpeculativeSettings, "lora": LoRASettings, "session": SessionSettings, "parallel": ParallelSettings,
    "http": HTTPSettings, "api": APISettings, "multimodal": MultimodalSettings,
}
# Flat setting name -> its section, for the command line and Engine(**kwargs).
SECTION_OF: dict[str, str] = {f.name: name for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)}


class ServerArgs:
    """Every setting, by section: `args.model`, `args.cache`, `args.scheduler`, `args.executor`,
    `args.speculative`, `args.lora`, `args.session`, `args.parallel`, `args.http`, `args.api`,
    `args.multimodal`. Made from flat names, as
    SGLang's ServerArgs and `Engine(**kwargs)` take them: `ServerArgs(max_total_tokens=4096)`;
    raises ValueError naming an unknown setting or a bad value. Immutable; sent to a child
    process as `to_dict()`."""

    __slots__ = tuple(SECTIONS)

    def __init__(self, **kwargs: Any):
        unknown = sorted(set(kwargs) - set(SECTION_OF))
        if unknown:
            raise ValueError(f"unknown server argument(s): {', '.join(unknown)}")
        grouped: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        for key, value in kwargs.items():
            grouped[SECTION_OF[key]][key] = value
        for name, values in grouped.items():
            object.__setattr__(self, name, SECTIONS[name](**values))

    model: ModelSettings
    cache: CacheSettings
    scheduler: SchedulerSettings
    executor: ExecutorSettings
    speculative: SpeculativeSettings
    lora: LoRASettings
    session: SessionSettings
    parallel: ParallelSettings
    http: HTTPSettings
    api: APISettings
    multimodal: MultimodalSettings

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("ServerArgs is immutable; use replace()")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ServerArgs) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return f"ServerArgs({', '.join(f'{k}={v!r}' for k, v in self.changed().items())})"

    def to_dict(self) -> dict[str, Any]:
        """Every setting by its flat name (ServerArgs(**that) makes these settings again)."""
        return {key: getattr(getattr(self, section), key) for key, section in SECTION_OF.items()}

    def changed(self) -> dict[str, Any]:
        """The settings that differ from their defaults, by flat name."""
        return {key: value for key, value in self.to_dict().items() if value != _DEFAULTS[key]}

    def replace(self, **kwargs: Any) -> ServerArgs:
        """These settings with some changed (by flat name, checked again)."""
        return ServerArgs(**{**self.to_dict(), **kwargs})

    def with_device_defaults(self) -> ServerArgs:
        """These settings with the device-dependent ones the user left unset filled in: a GPU
        batches far more requests, and larger prefill chunks, than a CPU core pair can."""
        unset = [name for name in DEVICE_DEPENDENT_FIELDS if getattr(self.scheduler, name) is None]
        if not unset:
            return self
        kind = self.model.resolved_device().split(":")[0]  # "cuda:1" is a CUDA device
        defaults = DEVICE_DEFAULTS.get(kind, DEVICE_DEFAULTS["cpu"])
        return self.replace(**{name: defaults[name] for name in unset})


_DEFAULTS = {f.name: f.default for cls in SECTIONS.values() for f in dataclasses.fields(cls)}
