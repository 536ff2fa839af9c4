"""A PEFT LoRA adapter on disk (`adapter_config.json` + `adapter_model.safetensors`): its config
checked against what we serve, and its tensors mapped onto the base model's fused projections.

What is refused, by name, at load: DoRA, bias training, `modules_to_save`, per-layer rank or
alpha patterns, layer subsets, embedding / LM-head / MoE-expert targets, a rank above
`--max-lora-rank`, a target outside `--lora-target-modules`, shapes that do not match the base.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

# The projections an adapter may target, as HF names them, and the fused projection of ours
# holding each (q|k|v in qkv_proj, gate|up in gate_up_proj).
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED_OF = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "o_proj": "o_proj",
            "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_NAME_RE = re.compile(r"[A-Za-z0-9][\w.\-]{0,127}")
_KEY_RE = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    alpha: float
    use_rslora: bool
    targets: tuple[str, ...]  # among TARGET_MODULES

    @property
    def scaling(self) -> float:
        """PEFT's: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def check_adapter_name(name: Any, field: str = "lora_path") -> str:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ValueError(f"{field}: an adapter name is 1-128 letters, digits, '_', '-' or '.' (got {name!r})")
    return name


def parse_lora_paths(entries: tuple[str, ...] | None) -> dict[str, str]:
    """`--lora-paths name=path ...` (a bare path is named by its directory) as {name: path}."""
    named: dict[str, str] = {}
    for entry in entries or ():
        name, sep, path = entry.partition("=")
        if not sep:
            name, path = os.path.basename(os.path.normpath(entry)), entry
        check_adapter_name(name, "lora_paths")
        if name in named:
            raise ValueError(f"lora_paths: the adapter name {name!r} is given twice")
        named[name] = path
    return named


def read_config(path: str) -> AdapterConfig:
    """The adapter's config, refused (ValueError naming what) where we do not serve it."""
    config_file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_file):
        raise ValueError(f"lora adapter {path!r}: no {CONFIG_FILE} (a PEFT LoRA adapter directory is expected)")
    if not os.path.isfile(os.path.join(path, WEIGHTS_FILE)):
        raise ValueError(f"lora adapter {path!r}: no {WEIGHTS_FILE} (.bin adapters are not read: no pickle)")
    with open(config_file) as f:
        raw = json.load(f)
    peft_type = str(raw.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise ValueError(f"lora adapter {path!r}: peft_type {peft_type} is not implemented (LORA is)")
    refusals = {"use_dora": "DoRA", "modules_to_save": "modules_to_save (fully trained modules)",
                "layers_to_transform": "layers_to_transform", "rank_pattern": "rank_pattern",
                "alpha_pattern": "alpha_pattern", "use_qalora": "QA-LoRA"}
    for key, what in refusals.items():
        if raw.get(key):
            raise ValueError(f"lora adapter {path!r}: {what} is not implemented")
    if raw.get("bias", "none") != "none":
        raise ValueError(f"lora adapter {path!r}: bias={raw['bias']!r} is not implemented (bias='none' is)")
    rank = raw.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"lora adapter {path!r}: r must be a positive integer (got {rank!r})")
    targets = raw.get("target_modules")
    if isinstance(targets, str):
        targets = list(TARGET_MODULES) if targets == "all-linear" else [targets]
    if not targets:
        raise ValueError(f"lora adapter {path!r}: target_modules is empty")
    names = [t.rsplit(".", 1)[-1] for t in targets]
    unknown = sorted(set(names) - set(TARGET_MODULES))
    if unknown:
        raise ValueError(f"lora adapter {path!r}: target module(s) {', '.join(unknown)} are not implemented "
                         f"(LoRA on {', '.join(TARGET_MODULES)} is)")
    return AdapterConfig(rank=rank, alpha=float(raw.get("lora_alpha", rank)), use_rslora=bool(raw.get("use_rslora")),
                         targets=tuple(m for m in TARGET_MODULES if m in names))


def check_against(config: AdapterConfig, path: str, max_rank: int, allowed: tuple[str, ...]) -> None:
    if config.rank > max_rank:
        raise ValueError(f"lora adapter {path!r}: rank {config.rank} is above --max-lora-rank {max_rank}")
    outside = [t for t in config.targets if t not in allowed]
    if outside:
        raise ValueError(f"lora adapter {path!r}: targets {', '.join(outside)}, outside --lora-target-modules "
                         f"{' '.join(allowed)}")


def resolve_target_modules(given: tuple[str, ...] | None) -> tuple[str, ...]:
    """`--lora-target-modules` as module names: unset or `all` is every projection."""
    if not given or "all" in given or "all-linear" in given:
        return TARGET_MODULES
    unknown = sorted(set(given) - set(TARGET_MODULES))
    if unknown:
        raise ValueError(f"lora_target_modules: {', '.join(unknown)} not implemented (all, or some of "
                         f"{', '.join(TARGET_MODULES)})")
    return tuple(m for m in TARGET_MODULES if m in given)


def fingerprint(path: str) -> str:
    """A digest of the adapter's files: the radix cache keys its KV by it, so an adapter reloaded
    under the same name with other weights never meets the old one's cached prefixes."""
    digest = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        with open(os.path.join(path, name), "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        digest.update(b"\0")
    return digest.hexdigest()[:32]


def parse_key(key: str) -> tuple[int, str, str] | None:
    """(layer, module, "A" | "B") of a PEFT tensor name, None for a name that is not one."""
    m = _KEY_RE.match(key)
    if m is None:
        return None
    return int(m.group(1)), m.group(2), m.group(3)
