"""The adapters a scheduler serves (no torch): loading and unloading by name through the
engine, which keeps their tensors, and binding each request to its adapter's digest and cache
namespace. The device slots are slots.py's."""

from __future__ import annotations

import os
from typing import Any

from ..core.request import Req
from .adapter import check_adapter_name, check_against, parse_lora_paths, read_config, resolve_target_modules
from .slots import AdapterSlots, LoadedAdapter


class AdapterBudgetFull(ValueError):
    """Loading one more adapter would pass --max-loaded-loras (HTTP 503)."""

    reply = {"status": 503}


def lora_namespace(cache_salt: str | None, uid: str) -> tuple[str | None, str]:
    """The radix-cache namespace of an adapter's requests: prefixes are shared within one adapter
    (and salt), never with the base model or another adapter."""
    return cache_salt, "lora:" + uid


def max_lora_rank(settings) -> int:
    """--max-lora-rank, or the largest rank among --lora-paths."""
    if settings.max_lora_rank is not None:
        return settings.max_lora_rank
    return max(read_config(path).rank for path in parse_lora_paths(settings.lora_paths).values())


class SchedulerAdapters:
    def __init__(self, settings, engine):
        """engine: has load_adapter(uid, path, config) and drop_adapter(uid) (the device engine)."""
        self.engine = engine
        self.max_rank = max_lora_rank(settings)
        self.targets = resolve_target_modules(settings.lora_target_modules)
        self.max_loaded = settings.max_loaded_loras
        self.slots = AdapterSlots(settings.max_loras_per_batch)
        for name, path in parse_lora_paths(settings.lora_paths).items():
            self.load(name, path)

    def bind(self, req: Req, name: str) -> None:
        adapter = self.slots.adapters.get(name) if isinstance(name, str) else None
        if adapter is None:
            raise ValueError(f"lora_path: adapter {name!r} is not loaded (loaded: "
                             f"{', '.join(sorted(self.slots.adapters)) or 'none'})")
        req.adapter_name, req.adapter_uid = name, adapter.uid
        req.namespace = lora_namespace(req.namespace, adapter.uid)

    def load(self, name: Any, path: Any) -> dict[str, Any]:
        from .adapter import fingerprint

        check_adapter_name(name, "lora_name")
        if not isinstance(path, str) or not path:
            raise ValueError("lora_path: the adapter's directory is required")
        if name in self.slots.adapters:
            raise ValueError(f"lora_name: an adapter named {name!r} is loaded already; unload it first")
        if self.max_loaded is not None and len(self.slots.adapters) >= self.max_loaded:
            raise AdapterBudgetFull(f"max_loaded_loras: {self.max_loaded} adapters are loaded; unload one first")
        path = os.path.expanduser(path)
        config = read_config(path)
        check_against(config, path, self.max_rank, self.targets)
        uid = fingerprint(path)
        if not self.slots.uid_in_use(uid):
            self.engine.load_adapter(uid, path, config)
        self.slots.register(LoadedAdapter(name, uid))
        return {"lora_name": name, "rank": config.rank, "target_modules": list(config.targets)}

    def unload(self, name: Any, busy: list[Req]) -> dict[str, Any]:
        if name not in self.slots.adapters:
            raise ValueError(f"lora_name: adapter {name!r} is not loaded")
        if busy:
            raise ValueError(f"lora_name: {len(busy)} requests still run on adapter {name!r}")
        adapter = self.slots.unregister(name)
        if not self.slots.uid_in_use(adapter.uid):
            self.engine.drop_adapter(adapter.uid)
        return {"lora_name": name}

    def info(self) -> dict[str, Any]:
        return {**self.slots.info(), "max_lora_rank": self.max_rank, "target_modules": list(self.targets)}
