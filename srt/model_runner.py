"""Owns the model, its KV pool and attention backend; runs one forward per scheduler step."""

from __future__ import annotations

import logging
import math
import time

import torch

from radixlm.srt.attention.base import AttentionBackend
from radixlm.srt.configs import ModelConfig
from radixlm.srt.forward_batch import ForwardBatch
from radixlm.srt.mem_pool import KVPool
from radixlm.srt.models.llama import LlamaForCausalLM
from radixlm.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

# KV budget on CPU when --max-total-tokens is not given: one full context plus room to batch.
CPU_DEFAULT_KV_TOKENS = 32768


class ModelRunner:
    def __init__(self, loaded, args: ServerArgs, req_to_token: torch.Tensor, num_kv_slots: int):
        self.args = args
        self.device = torch.device(args.resolved_device())
        self.dtype = args.resolved_dtype()
        self.config: ModelConfig = loaded.config
        start = time.perf_counter()
        torch.manual_seed(args.random_seed)
        with torch.device(self.device):
            self.model = LlamaForCausalLM(self.config, loaded.hf_config)
        self.model.load_weights(loaded.weights)
        self.model.to(self.dtype).eval()
        cfg = self.config
        self.kv_pool = KVPool(num_kv_slots, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.dtype, self.device)
        self.attn_backend = self._make_backend(req_to_token)
        logger.info("model ready on %s (%s) in %.1fs, %d KV slots", self.device, self.dtype,
                    time.perf_counter() - start, num_kv_slots)

    def _make_backend(self, req_to_token: torch.Tensor) -> AttentionBackend:
        name = self.args.attention_backend
        if name == "auto":
            name = "torch_native"
        if name == "torch_native":
            from radixlm.srt.attention.torch_native import TorchNativeBackend

            return TorchNativeBackend(self.kv_pool, req_to_token, 1.0 / math.sqrt(self.config.head_dim))
        raise ValueError(f"attention_backend: {name!r} is not available in this build")

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Float32 logits for `batch.logit_rows`: [len(logit_rows), vocab]."""
        self.attn_backend.plan(batch)
        return self.model(batch.input_ids, batch.positions, self.attn_backend, batch.logit_rows)


def kv_slots_for(config: ModelConfig, args: ServerArgs) -> int:
    """The KV budget in tokens: --max-total-tokens, or a default sized for the device."""
    if args.max_total_tokens is not None:
        if args.max_total_tokens < 1:
            raise ValueError("max_total_tokens: must be >= 1")
        return args.max_total_tokens
    if args.resolved_device() == "cpu":
        return CPU_DEFAULT_KV_TOKENS
    free, _total = torch.cuda.mem_get_info()
    bytes_per_token = KVPool.bytes_per_token(config.num_layers, config.num_kv_heads, config.head_dim,
                                             args.resolved_dtype())
    return int(free * 0.85 // bytes_per_token)
