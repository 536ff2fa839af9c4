"""In-process engine: the scheduler and model in this process, SGLang's Engine API."""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

import torch

from .core.request import Req
from .intake import Intake, deterministic_seed
from .io_struct import TokenizedGenerateReq
from .multimodal.inputs import ImageInputs
from .multimodal.limits import limits_from_settings
from .results import LogprobRecord, Progress, final_text, result
from .server_args import ServerArgs
from .tp_launch import LocalRanks

logger = logging.getLogger(__name__)


class Engine:
    """`Engine(model_path=None, **server_args)`; `model_path=None` is the embedded default model."""

    def __init__(self, model_path: str | None = None, **server_args: Any):
        from .bootstrap import bootstrap_rank, build_scheduler, step_sender
        from .executor import parallel

        self.server_args = ServerArgs(model_path=model_path, **server_args)
        args = self.server_args
        # tp_size > 1: this process is rank 0; the other ranks are child processes (tp_launch.py).
        self._ranks = LocalRanks(args) if args.parallel.tp_size > 1 else None
        self._threads = torch.get_num_threads()  # a CPU rank takes its share of the cores; given back after
        try:
            rank = bootstrap_rank(args, 0, 0, self._ranks.addr if self._ranks else None)
            self.tokenizer = rank.loaded.tokenizer
            self.model_config = rank.loaded.config
            self.scheduler = build_scheduler(rank, args)
            self.server_args = self.scheduler.args  # with the device's defaults filled in
            if self._ranks:
                self._ranks.wait_ready()
                step_sender(self.scheduler).start(self.scheduler.req_table.dirty_from)
        except BaseException:
            if self._ranks:
                self._ranks.stop(grace_s=0)
                parallel.shutdown()
                torch.set_num_threads(self._threads)
            raise
        adapters = self.scheduler.adapters
        # Images may also be local paths here: the caller is this process, not a client.
        images = ImageInputs.for_model(self.model_config, self.tokenizer, rank.loaded.local_dir,
                                       limits_from_settings(args.multimodal, allow_paths=True))
        self.intake = Intake(self.tokenizer, self.model_config.vocab_size, self.scheduler.context_len,
                             deterministic_seed(args), (lambda: adapters.slots.adapters) if adapters else None,
                             images=images)

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        top_logprobs_num: int = 0,
        return_text_in_logprobs: bool = False,
        rid: str | list[str] | None = None,
        cache_salt: str | None = None,
        lora_path: str | list[str | None] | None = None,
        session_id: str | None = None,
        image_data: Any = None,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Generates for one prompt (returns a dict) or a batch (returns a list, input order;
        n > 1 samples of a prompt follow each other). Validation is the server's (srt/intake.py).
        lora_path: a loaded LoRA adapter's name (--enable-lora), or a list with one per prompt.
        session_id: a program session whose latest prefix stays cached until end_session
        (docs/sessions.md).
        image_data (vision-language models): an image (a PIL image, bytes, a path, a data URL or
        base64) or a list of them for one prompt, or for a batch a list with one such entry per
        prompt; each image's placeholder ("<image>"; Qwen2.5-VL's "<|image_pad|>", between its vision
        start and end tokens) sits in its prompt where it goes."""
        batched, groups = self.intake.batch(
            prompt, input_ids, sampling_params, rid, text_field="prompt", return_logprob=return_logprob,
            logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num, cache_salt=cache_salt,
            lora_path=lora_path, session_id=session_id, image_data=image_data)
        msgs = [m for group in groups for m in group]
        reqs = [Req.from_tokenized(m, self.model_config.vocab_size) for m in msgs]
        for msg, req in zip(msgs, reqs):
            self.scheduler.bind_adapter(req, msg.lora_path)
        start = time.perf_counter()
        for req in reqs:
            self.scheduler.add_request(req)
        try:
            while not all(r.finished for r in reqs):
                self.scheduler.step()
        except BaseException as e:  # leave the scheduler clean for the next call
            self.scheduler.abort_all(f"internal error: {e}")
            raise
        latency = time.perf_counter() - start
        outputs = [self._output(m, r, latency, return_text_in_logprobs) for m, r in zip(msgs, reqs)]
        return outputs if batched or len(outputs) > 1 else outputs[0]

    def _output(self, msg: TokenizedGenerateReq, req: Req, latency: float, with_text: bool) -> dict[str, Any]:
        from .results import TokenTexts

        finish = req.finish_reason.to_dict()
        lps = req.logprobs
        logprobs = LogprobRecord(lps.input_token, lps.input_top, lps.output_token, lps.output_top)
        progress = Progress(prompt_tokens=len(msg.input_ids), completion_tokens=len(req.output_ids),
                            cached_tokens=req.cached_tokens, cached_tiers=req.cached_tiers, finish_reason=finish, e2e_latency=latency,
                            spec_verify_ct=req.spec_verify_ct)
        text = final_text(self.tokenizer, req.output_ids, req.sampling_params, finish)
        return result(msg, text, list(req.output_ids), progress, logprobs,
                      TokenTexts(self.tokenizer) if with_text else None)

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, Any]:
        """Loads a PEFT LoRA adapter under `lora_name` (--enable-lora); ValueError naming what
        is refused (a rank above --max-lora-rank, another base model's shapes, DoRA, ...)."""
        return self.scheduler.load_adapter(lora_name, lora_path)

    def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        return self.scheduler.unload_adapter(lora_name)

    def end_session(self, session_id: str) -> bool:
        """Ends a program session: its prefix becomes plain cache. False if none was held."""
        return self.scheduler.sessions.end(session_id)

    def flush_cache(self, include_storage: bool = False) -> bool:
        """Empties the radix cache and the host tier (and the disk tier with include_storage)."""
        return self.scheduler.flush_cache(include_storage)

    def shutdown(self) -> None:
        if self.scheduler is not None:
            self.scheduler.close()
        if self._ranks is not None:
            from .bootstrap import step_sender
            from .executor import parallel

            step_sender(self.scheduler).stop()
            parallel.shutdown()  # the other ranks tear down with it, then exit
            self._ranks.stop()
            self._ranks = None
            torch.set_num_threads(self._threads)
        self.scheduler = None  # frees the model and KV pool
        gc.collect()  # CUDA graphs and backends hold reference cycles; free their memory now
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

