"""Settings of the optional features, one section each: speculative decoding, LoRA adapters,
program sessions and images (server_args.py gathers every section into ServerArgs)."""

from __future__ import annotations

from dataclasses import dataclass

from .setting_fields import Section, setting


@dataclass(frozen=True)
class SpeculativeSettings(Section):
    """Speculative decoding: who drafts, and how many tokens a verify step checks."""

    speculative_algorithm: str | None = setting(None, "ngram (drafts by prompt lookup, no extra model) | suffix "
                                                      "(drafts from the request's text and recent outputs, no extra "
                                                      "model) | draft (STANDALONE: a smaller model drafts); unset: no "
                                                      "speculative decoding", choices=("ngram", "suffix", "draft"),
                                                refusal="is not implemented (ngram, suffix and draft / STANDALONE are; "
                                                        "EAGLE, EAGLE3 and MTP speculation are not)")
    speculative_num_draft_tokens: int = setting(4, "draft tokens verified per step", min=1, max=16)
    speculative_ngram_max_match_window_size: int = setting(4, "ngram: longest suffix matched against earlier "
                                                              "tokens", min=1)
    speculative_ngram_min_match_window_size: int = setting(1, "ngram: shortest suffix matched", min=1)
    # Suffix speculation (srt/scheduler/suffix.py); vLLM's suffix_decoding_* names and defaults, but
    # for the spec factor (vLLM: 1.0): a verify step costs about the same for 4 or 16 drafts.
    speculative_suffix_max_tokens: int = setting(1 << 16, "suffix: tokens of finished requests kept to draft from "
                                                          "(outputs, each after its prompt's last tree-depth tokens), "
                                                          "over all cache namespaces; the oldest go first", min=1)
    speculative_suffix_max_tree_depth: int = setting(24, "suffix: longest context matched", min=1)
    speculative_suffix_max_spec_factor: float = setting(8.0, "suffix: draft at most this many tokens per token of "
                                                             "matched context", above=0.0)
    speculative_suffix_min_token_prob: float = setting(0.1, "suffix: stop a draft where its estimated probability "
                                                            "falls below this", min=0.0, max=1.0)
    speculative_draft_model_path: str | None = setting(None, "draft / STANDALONE: the smaller model that drafts "
                                                             "(same tokenizer as the target)")
    speculative_num_steps: int | None = setting(None, "draft / STANDALONE: tokens the draft model drafts per step "
                                                      "(unset: speculative_num_draft_tokens)", min=1, max=16)

    ALIASES = {"speculative_algorithm": {"ngram": "ngram", "suffix": "suffix", "draft": "draft", "standalone": "draft"}}

    def check(self) -> None:
        algorithm = self.speculative_algorithm
        if algorithm is None:
            return
        if algorithm in ("ngram", "suffix"):
            if self.speculative_draft_model_path is not None:
                raise ValueError(f"speculative_draft_model_path: {algorithm} speculation drafts without a model; use "
                                 "--speculative-algorithm draft for a draft model")
            if self.speculative_ngram_min_match_window_size > self.speculative_ngram_max_match_window_size:
                raise ValueError("speculative_ngram_min_match_window_size: must be at most the max window size")
        elif not self.speculative_draft_model_path:
            raise ValueError("speculative_draft_model_path: required with speculative_algorithm draft")

    @property
    def drafts_per_step(self) -> int:
        """Draft tokens a verify step checks: the draft model's forwards, or the n-gram / suffix
        draft length at most."""
        if not self.speculative_algorithm:
            return 0
        if self.speculative_algorithm == "draft" and self.speculative_num_steps is not None:
            return self.speculative_num_steps
        return self.speculative_num_draft_tokens


@dataclass(frozen=True)
class LoRASettings(Section):
    """LoRA adapters of the base model, served side by side and batched together (docs/lora.md)."""

    enable_lora: bool = setting(False, "serve LoRA adapters: requests name one (lora_path, or the OpenAI model "
                                       "'<adapter>'); without one they run the base model")
    lora_paths: tuple[str, ...] | None = setting(None, "adapters loaded at start, as name=path (a PEFT adapter "
                                                       "directory; a bare path is named by its directory)")
    max_loras_per_batch: int = setting(8, "adapters on the device at once (each a slot of max_lora_rank); a "
                                          "batch mixes at most this many", min=1)
    max_loaded_loras: int | None = setting(None, "adapters loaded (in host memory) at most; loading one more is "
                                                 "refused with 503 until one is unloaded; unset: no bound", min=1)
    max_lora_rank: int | None = setting(None, "largest adapter rank a slot holds; unset: the largest of "
                                              "--lora-paths", min=1)
    lora_target_modules: tuple[str, ...] | None = setting(None, "projections that may carry LoRA: all, or some "
                                                                "of q_proj k_proj v_proj o_proj gate_proj up_proj "
                                                                "down_proj; unset: all")
    lora_backend: str = setting("auto", "auto (on CUDA triton up to 8 tokens a forward, torch above; torch on CPU) | triton (each token's own adapter "
                                        "by gathered kernels) | torch (every slot's products, masked per token)",
                                choices=("auto", "torch", "triton"),
                                refusal="is not implemented (auto, triton and torch are; csgmv is not)")

    def check(self) -> None:
        from .lora.adapter import parse_lora_paths, resolve_target_modules

        if not self.enable_lora:
            if self.lora_paths:
                raise ValueError("lora_paths: needs --enable-lora")
            return
        parse_lora_paths(self.lora_paths)
        resolve_target_modules(self.lora_target_modules)
        if not self.lora_paths and self.max_lora_rank is None:
            raise ValueError("max_lora_rank: required with --enable-lora and no --lora-paths (the slots are sized "
                             "before any adapter is loaded)")
        if self.max_loaded_loras is not None and self.lora_paths and len(self.lora_paths) > self.max_loaded_loras:
            raise ValueError(f"max_loaded_loras: {self.max_loaded_loras} is fewer than the "
                             f"{len(self.lora_paths)} --lora-paths")


SESSION_TOTAL_SHARE = 0.5  # of the KV pool, protected for sessions when --session-total-tokens is unset


@dataclass(frozen=True)
class SessionSettings(Section):
    """Program sessions: the latest prefix of a session's calls kept cached between them (docs/sessions.md)."""

    session_ttl: float = setting(300.0, "seconds a session's prefix stays protected after its last call; 0: "
                                        "sessions protect nothing", min=0.0)
    session_max_tokens: int | None = setting(None, "tokens one session protects at most (the head of its prefix); "
                                                   "unset: the total bound", min=1)
    session_total_tokens: int | None = setting(None, "tokens all sessions protect together at most; unset: half "
                                                     "the KV pool (the other half stays plain cache and room for "
                                                     "running requests)", min=0)


@dataclass(frozen=True)
class MultimodalSettings(Section):
    """Images for vision-language models (docs/multimodal.md): what requests may send, and the
    encoder cache of vision features."""

    max_images_per_request: int = setting(16, "images one prompt may carry at most; more get 400", min=0)
    max_image_pixels: int = setting(4096 * 4096, "width x height of one decoded image at most; larger get 400",
                                    min=1)
    allow_remote_images: bool = setting(False, "fetch http(s) image URLs that requests name (off: the server must "
                                               "not fetch for whoever can reach it; send data URLs or base64)")
    mm_cache_size_gb: float = setting(1.0, "the encoder cache: vision features kept by image content hash, in GB "
                                           "of device memory (outside --mem-fraction-static); 0: none", min=0.0)
