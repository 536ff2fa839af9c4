"""Owns the model, its KV pool and attention backend; runs one forward per scheduler step."""

from __future__ import annotations

import logging
import math
import time

import torch

from ..configs import ModelConfig
from ..multimodal.encoder_cache import EncoderCache
from ..server_args import ServerArgs
from . import parallel
from .attention.base import AttentionBackend
from .attention.layer_spec import check_backend_supports, layer_specs
from .forward_batch import ForwardBatch
from .image_embeds import ImageEmbedder
from .kernel_options import KernelOptions
from .cpu_linear import onednn_available, pack_projections
from .mem_pool import KVPool, kv_cache_torch_dtype
from .models.ops import select_ops
from .models.registry import model_class
from .models.sharding import ShardPlan
from .quantization import apply_quantization

logger = logging.getLogger(__name__)

# KV budget on CPU when --max-total-tokens is not given: one full context plus room to batch.
CPU_DEFAULT_KV_TOKENS = 32768


class ModelRunner:
    def __init__(self, loaded, args: ServerArgs, req_to_token: torch.Tensor, num_kv_slots: int,
                 tp: parallel.TensorParallel = parallel.TensorParallel()):
        """Under tensor parallelism (`tp` of several ranks), `loaded` holds this rank's shard
        and rank 0 sends every batch to the other ranks before running it (step_broadcast.py);
        one rank of one (the default) runs a whole model alone."""
        self.args = args
        self.tp = tp
        self.device = torch.device(args.model.resolved_device())
        if self.device.type == "cuda":  # a rank's own GPU (parallel.py set it)
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = args.model.resolved_dtype()
        self.config: ModelConfig = loaded.config
        start = time.perf_counter()
        torch.manual_seed(args.model.random_seed)
        cfg = self.config
        self.kernels = KernelOptions.from_settings(args.executor)
        self.ops = select_ops(self.device, cfg.head_dim, self.kernels.pdl)
        # Parameters are made in the serving dtype on the device: an fp32 copy first would need
        # twice the memory (Mixtral-8x7B: 187 GB) before the cast.
        previous_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                self.model = model_class(cfg)(cfg, loaded.hf_config, self.ops, shard=loaded.shard, tp=self.tp)
        finally:
            torch.set_default_dtype(previous_dtype)
        self.model.load_weights(loaded.weights)
        # .to(device) too: rotary tables are built on the host (fp64 math) whatever the device.
        self.model.to(device=self.device, dtype=self.dtype).eval()
        self.images = None  # a vision-language model's image features, through the encoder cache
        if cfg.vision is not None:
            check_vision_settings(args, cfg)
            cache = EncoderCache(int(args.multimodal.mm_cache_size_gb * 2**30))
            self.images = ImageEmbedder(self.model, cache, self.device, self.dtype)
        # --quantization fp8, or an FP8 checkpoint: projections in FP8
        apply_quantization(self.model, args.model.quantization, self.device, loaded.fp8_scales, self.kernels)
        self.deterministic = args.executor.enable_deterministic_inference
        if self.deterministic:
            from .batch_invariant import check_deterministic_settings, make_batch_invariant

            check_deterministic_settings(args)
            make_batch_invariant(self.model, self.device)
            if self.device.type == "cuda":
                self._prove_fast_products()
        elif self.device.type == "cpu" and self.kernels.onednn_linear and onednn_available():
            pack_projections(self.model)
        self.lora = None  # --enable-lora: the adapters' device slots in the projections
        if args.lora.enable_lora:
            from ..lora.layers import LoRASlots, check_lora_supported, triton_max_tokens
            from ..lora.registry import max_lora_rank
            from ..lora.adapter import resolve_target_modules

            check_lora_supported(args, cfg)
            self.lora = LoRASlots(self.model, cfg, args.lora.max_loras_per_batch, max_lora_rank(args.lora),
                                  resolve_target_modules(args.lora.lora_target_modules), self.device, self.dtype,
                                  shard=loaded.shard, triton_max_tokens=triton_max_tokens(args),
                                  pdl=self.kernels.pdl)
        local = self.model.config  # this rank's heads under tensor parallelism
        kv_dtype = kv_cache_torch_dtype(args.model.kv_cache_dtype, self.dtype)  # --kv-cache-dtype fp8_e4m3: FP8
        self.kv_pool = KVPool(num_kv_slots, cfg.num_layers, local.num_kv_heads, cfg.head_dim, kv_dtype, self.device,
                              pdl=self.kernels.pdl)
        self.attention_backend_name = resolve_attention_backend(args.executor.attention_backend, self.device,
                                                                self.dtype)
        if self.deterministic:
            self.attention_backend_name = "deterministic"
        self.attn_backend = self._make_backend(req_to_token)
        self.graph_runner = self._make_graph_runner(req_to_token)
        self.step_sender = None
        if self.tp.enabled and self.tp.rank == 0:
            from .step_broadcast import StepSender

            self.step_sender = StepSender(self.tp, req_to_token.numpy(), self.device)
        logger.info("model ready on %s (%s, %s attention, %s ops, CUDA graphs %s) in %.1fs, %d KV slots",
                    self.device, self.dtype, self.attention_backend_name, self.ops.name,
                    "on" if self.graph_runner else "off", time.perf_counter() - start, num_kv_slots)

    def _prove_fast_products(self) -> None:
        """cuBLAS proven at every row count a step can reach before the graphs are captured
        (batch_invariant.prove_fast_products)."""
        from .batch_invariant import prove_fast_products

        sched = self.args.scheduler
        prefill = min(sched.max_prefill_tokens, sched.chunked_prefill_size)
        max_rows = max(prefill + (sched.max_running_requests if sched.enable_mixed_chunk else 0),
                       sched.max_running_requests)
        started = time.perf_counter()
        proven = prove_fast_products(self.model, self.dtype, max_rows, sched.max_running_requests)
        torch.cuda.empty_cache()  # the probes' memory back before the KV pool, sized beforehand, is allocated
        logger.info("deterministic GEMMs: cuBLAS gives the Triton kernel's bits at %d of %d shapes up to %d rows "
                    "(proven in %.1fs)", proven["fast"], proven["shapes"], max_rows, time.perf_counter() - started)

    def _make_backend(self, req_to_token: torch.Tensor) -> AttentionBackend:
        cfg = self.config
        # Windows and soft-caps reach the backend per layer; one it cannot compute refuses the model.
        layers = layer_specs(cfg.sliding_windows, cfg.num_layers, cfg.attn_logit_softcap,
                             self.args.model.context_length or cfg.context_len)
        cascade = not self.args.executor.disable_cascade_attention
        if self.deterministic and self.device.type == "cuda":
            # Triton, capturable: CUDA graphs stay on under the flag.
            from .attention.deterministic_cuda import TritonDeterministicBackend

            check_backend_supports(TritonDeterministicBackend, layers, cfg.architecture)
            return TritonDeterministicBackend(self.kv_pool, req_to_token, cfg.attention_scale,
                                              self.model.config.num_heads, layers, cascade=cascade)
        if self.deterministic:
            from .attention.deterministic import DeterministicBackend

            check_backend_supports(DeterministicBackend, layers, cfg.architecture)
            return DeterministicBackend(self.kv_pool, req_to_token, cfg.attention_scale, layers)
        if self.attention_backend_name == "torch_native":
            from .attention.torch_native import TorchNativeBackend

            check_backend_supports(TorchNativeBackend, layers, cfg.architecture)
            return TorchNativeBackend(self.kv_pool, req_to_token, cfg.attention_scale, cascade=cascade, layers=layers)
        from .attention.flashinfer_backend import FlashInferBackend

        check_backend_supports(FlashInferBackend, layers, cfg.architecture)
        local = self.model.config
        return FlashInferBackend(self.kv_pool, req_to_token, self.args.cache.page_size, local.num_heads,
                                 local.num_kv_heads, cfg.head_dim, cfg.attention_scale, self.dtype, cascade=cascade,
                                 layers=layers,
                                 fused_rotary_store=self.kernels.fused_rotary_store)

    def _make_graph_runner(self, req_to_token: torch.Tensor):
        # The backend says whether it can be captured (torch_native cannot); no name checks here.
        if self.args.executor.disable_cuda_graph or not self.attn_backend.supports_cuda_graph:
            return None
        from .cuda_graph_runner import CudaGraphRunner

        max_bs = min(self.args.executor.cuda_graph_max_bs, self.args.scheduler.max_running_requests)
        max_pages_per_req = -(-req_to_token.shape[1] // self.args.cache.page_size)
        with torch.inference_mode():
            return CudaGraphRunner(self.model, self.attn_backend, max_bs, max_pages_per_req, self.device,
                                   self.lora.batch if self.lora is not None else None)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, loads=None) -> torch.Tensor:
        """Float32 logits for `batch.logit_rows`: [len(logit_rows), vocab].
        loads: KV being loaded back from the host tier (host_loads.LayerLoads), scattered into
        the pool layer by layer as this forward reaches each layer."""
        if self.step_sender is None:
            return self._forward(batch, loads)
        with self.step_sender.sending(batch):  # tensor parallelism: the other ranks run it too
            return self._forward(batch, loads)

    def _forward(self, batch: ForwardBatch, loads) -> torch.Tensor:
        if self.lora is not None:
            self.lora.prepare(batch.adapter_loads, batch.adapter_drops, batch.adapter_slots)
        # A decode batch with enough shared-prefix KV runs cascade attention: in its bucket's
        # cascade graph, or eagerly where the bucket has none (should_replay asks the backend).
        graphs = self.graph_runner
        if graphs is not None and graphs.should_replay(batch):
            if loads is not None:  # a graph cannot stop per layer: the whole load first
                loads.finish()
            return graphs.replay(batch)
        extra = {"image_embeds": self.images(batch.images)} if batch.images else {}
        self.attn_backend.plan(batch)
        if loads is None:
            return self.model(batch.input_ids, batch.positions, self.attn_backend, batch.logit_rows, **extra)
        logits = self.model(batch.input_ids, batch.positions, LayerGate(self.attn_backend, loads), batch.logit_rows,
                            **extra)
        loads.finish()  # a model whose layers skip attention still gets every layer
        return logits


class LayerGate:
    """An attention backend whose layer l first has `loads` scatter layer l's loaded KV into
    the pool: the layers before it compute while layer l is still being copied in."""

    def __init__(self, backend: AttentionBackend, loads):
        self._backend, self._loads = backend, loads

    def forward_with_rotary(self, q, k, v, layer_id: int, positions, rotary, ops):
        self._loads.before_layer(layer_id)
        return self._backend.forward_with_rotary(q, k, v, layer_id, positions, rotary, ops)

    def forward(self, q, k, v, layer_id: int):
        self._loads.before_layer(layer_id)
        return self._backend.forward(q, k, v, layer_id)

    def __getattr__(self, name: str):
        return getattr(self._backend, name)


def check_vision_settings(args: ServerArgs, config: ModelConfig) -> None:
    """Refuses, by name, what a vision-language model does not run with yet (tensor parallelism
    is refused where the model is split, sharding.py)."""
    if args.lora.enable_lora:
        raise ValueError(f"enable_lora: LoRA on {config.architecture} (a vision-language model) is not implemented")
    if args.executor.enable_deterministic_inference:
        raise ValueError(f"enable_deterministic_inference: with {config.architecture} (a vision-language model) is "
                         "not implemented yet (the vision tower is not batch-invariant)")
    if args.model.quantization is not None:  # it would also quantize the vision tower, untested
        raise ValueError(f"quantization: {args.model.quantization} with {config.architecture} (a vision-language "
                         "model) is not implemented")
    if args.speculative.speculative_algorithm == "draft":
        raise ValueError(f"speculative_algorithm: a draft model beside {config.architecture} (a vision-language "
                         "model) is not implemented; ngram and suffix speculation are")


def resolve_attention_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """`auto` is flashinfer on CUDA in fp16/bf16 when it is installed, else torch_native."""
    if name == "flashinfer":
        if device.type != "cuda":
            raise ValueError("attention_backend: flashinfer needs a CUDA device")
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError("attention_backend: flashinfer needs dtype float16 or bfloat16")
        return name
    if name != "auto":
        return name
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return "torch_native"
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        logger.warning("flashinfer is not installed; using torch_native attention (pip install 'radixlm[gpu]')")
        return "torch_native"
    return "flashinfer"


def kv_slots_for(config: ModelConfig, args: ServerArgs, tp: parallel.TensorParallel = parallel.TensorParallel()) -> int:
    """The KV budget in tokens: --max-total-tokens, or a default sized for the device."""
    if args.cache.max_total_tokens is not None:
        if args.cache.max_total_tokens < 1:
            raise ValueError("max_total_tokens: must be >= 1")
        return args.cache.max_total_tokens
    if args.model.resolved_device() == "cpu":
        return CPU_DEFAULT_KV_TOKENS
    dtype = args.model.resolved_dtype()
    free, total = torch.cuda.mem_get_info()
    # This rank's part of the weights and of each token's KV; every rank then takes the
    # smallest count, so slot numbers mean the same on all.
    local = rank_config(config, tp)
    # Called before the runner builds its copy of the weights (the loaded ones are freed after).
    budget = free - (1.0 - args.cache.mem_fraction_static) * total - model_bytes(local, dtype, args.model.quantization)
    if args.lora.enable_lora:  # the adapters' device slots
        from ..lora.adapter import resolve_target_modules
        from ..lora.layers import lora_bytes
        from ..lora.registry import max_lora_rank

        budget -= lora_bytes(local, args.lora.max_loras_per_batch, max_lora_rank(args.lora),
                             resolve_target_modules(args.lora.lora_target_modules), dtype)
    bytes_per_token = KVPool.bytes_per_token(local.num_layers, local.num_kv_heads, local.head_dim,
                                             kv_cache_torch_dtype(args.model.kv_cache_dtype, dtype))
    if budget < bytes_per_token * 4096:
        raise ValueError(f"mem_fraction_static: {args.cache.mem_fraction_static} leaves no room for the KV cache "
                         f"({free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB)")
    return tp.min_on_host(int(budget // bytes_per_token))


def rank_config(config: ModelConfig, tp: parallel.TensorParallel) -> ModelConfig:
    """This tensor-parallel rank's part of the model (its heads, MLP columns): `config` on one rank."""
    return ShardPlan.for_rank(config, tp.rank, tp.size).local_config(config) if tp.enabled else config


def model_bytes(config: ModelConfig, dtype: torch.dtype, quantization: str | None = None) -> int:
    from .model_loader import weight_shapes

    if quantization == "fp8":
        from .quantization.fp8 import fp8_weight_bytes

        return fp8_weight_bytes(weight_shapes(config), dtype)
    numel = sum(math.prod(shape) for shape in weight_shapes(config).values())
    return numel * torch.finfo(dtype).bits // 8
