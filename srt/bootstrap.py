"""Bringing up one tensor-parallel rank, the same way in every process that runs a model: the
scheduler process (rank 0), the in-process Engine (rank 0) and the TP followers (ranks > 0).
It joins the policy (srt/scheduler/) to the device engine (srt/executor/), which know nothing
of each other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .core.step import kv_pool_slots
from .executor import parallel
from .executor.device_engine import DeviceEngine, kv_capacity
from .executor.host_kv import HostKVPool, agree_on_host_tokens, host_tier_tokens
from .executor.model_loader import LoadedModel, load_model
from .executor.model_runner import ModelRunner, kv_slots_for
from .executor.step_broadcast import Follower, StepReceiver
from .scheduler.kv_tiers import host_tier_request
from .scheduler.scheduler import Scheduler
from .server_args import ServerArgs


@dataclass(frozen=True)
class Rank:
    """A rank ready to build its engine: its device, its shard of the model and its group."""

    device: str
    loaded: LoadedModel
    tp: parallel.TensorParallel


def bootstrap_rank(args: ServerArgs, rank: int = 0, local_rank: int = 0, dist_addr: str | None = None) -> Rank:
    """Takes the rank's device (its GPU, or its share of the CPU cores), loads its shard of the
    weights there and, with tp_size > 1, joins the other ranks at `dist_addr` (host:port)."""
    device = parallel.prepare_rank(args, local_rank)
    loaded = load_model(args.model.model_path, dtype=args.model.resolved_dtype(), load_format=args.model.load_format,
                        tokenizer_path=args.model.tokenizer_path, device=device,
                        tensor_parallel=(rank, args.parallel.tp_size))
    tp = parallel.init_tensor_parallel(args, rank, local_rank, dist_addr) if args.parallel.tp_size > 1 else \
        parallel.TensorParallel()
    return Rank(device, loaded, tp)


class _DeviceEngines:
    """Makes rank 0's device engine, on its tensor-parallel group, for the Scheduler."""

    def __init__(self, tp: parallel.TensorParallel):
        self.tp = tp

    def kv_capacity(self, config: Any, args: ServerArgs) -> int:
        return kv_capacity(config, args, self.tp)

    def __call__(self, *args: Any, **kwargs: Any) -> DeviceEngine:
        return DeviceEngine(*args, **kwargs, tp=self.tp)


def build_scheduler(rank: Rank, args: ServerArgs) -> Scheduler:
    """Rank 0's scheduling policy over its device engine, once every rank holds its shard and
    KV pool."""
    scheduler = Scheduler(rank.loaded, args, _DeviceEngines(rank.tp))
    rank.tp.barrier("ready")
    return scheduler


def step_sender(scheduler: Scheduler) -> Any:
    """Under tensor parallelism, what sends rank 0's steps to the other ranks (None on one
    rank); started with the policy's table marks once the other ranks listen."""
    return scheduler.engine.runner.step_sender


def build_follower(rank: Rank, args: ServerArgs) -> Follower:
    """A follower rank's runner, with the table and KV pool shaped as rank 0's policy shapes
    its own, so that every slot and row means the same on all ranks."""
    args = args.with_device_defaults()  # as rank 0's Scheduler does: the same table rows
    capacity = kv_slots_for(rank.loaded.config, args, rank.tp)
    context_len = args.model.context_length or rank.loaded.config.context_len
    table = np.zeros((args.scheduler.max_running_requests, context_len + 1), dtype=np.int64)
    num_slots = kv_pool_slots(capacity, args.cache.page_size)
    runner = ModelRunner(rank.loaded, args, torch.from_numpy(table), num_slots, rank.tp)
    host_kv = None
    if args.cache.enable_hierarchical_cache:  # this rank's shard of the host tier, as DeviceEngine makes it
        request = host_tier_request(args, capacity)
        tokens = host_tier_tokens(HostKVPool.token_bytes(runner.kv_pool), request.get("host_kv_tokens"),
                                  request.get("host_kv_bytes"))
        host_kv = HostKVPool(runner.kv_pool, agree_on_host_tokens(tokens, rank.tp), runner.device)
    rank.tp.barrier("ready")
    return Follower(runner, StepReceiver(rank.tp, table, runner.device), host_kv)
