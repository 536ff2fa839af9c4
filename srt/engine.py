"""In-process engine: the scheduler and model in this process, SGLang's Engine API."""

from __future__ import annotations

import gc
import itertools
import logging
import time
import uuid
from typing import Any

import torch

from radixlm.srt.scheduler.finish import output_text
from radixlm.srt.server.input_validation import prompt_token_ids
from radixlm.srt.executor.logprobs import logprob_meta
from radixlm.srt.scheduler.request import LogprobOptions, Req
from radixlm.srt.sampling_params import SamplingParams
from radixlm.srt.scheduler.scheduler import Scheduler
from radixlm.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


class Engine:
    """`Engine(model_path=None, **server_args)`; `model_path=None` is the embedded default model."""

    def __init__(self, model_path: str | None = None, **server_args: Any):
        from radixlm.srt.executor.model_loader import load_model

        self.server_args = ServerArgs.from_kwargs(model_path=model_path, **server_args)
        args = self.server_args
        loaded = load_model(args.model_path, dtype=args.resolved_dtype(), load_format=args.load_format,
                            tokenizer_path=args.tokenizer_path, device=args.resolved_device())
        self.tokenizer = loaded.tokenizer
        self.model_config = loaded.config
        self.scheduler = Scheduler(loaded, args)
        self._rid_counter = itertools.count()

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
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Generates for one prompt (returns a dict) or a batch (returns a list, input order)."""
        batched, prompts_ids = self._tokenize(prompt, input_ids)
        params_list = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts_ids)
        if len(params_list) != len(prompts_ids):
            raise ValueError("sampling_params: a list must have one entry per prompt")
        rids = rid if isinstance(rid, list) else [rid] * len(prompts_ids)
        logprob = _logprob_options(return_logprob, logprob_start_len, top_logprobs_num)
        reqs = []
        for ids, params, one_rid in zip(prompts_ids, params_list, rids):
            sp = SamplingParams.from_dict(params, vocab_size=self.model_config.vocab_size)
            for _ in range(sp.n):
                reqs.append(Req(rid=one_rid if one_rid and sp.n == 1 else uuid.uuid4().hex, origin_input_ids=ids,
                                sampling_params=sp, logprob=logprob))
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
        outputs = [self._output(r, latency, return_text_in_logprobs) for r in reqs]
        return outputs if batched or len(outputs) > 1 else outputs[0]

    def _tokenize(self, prompt, input_ids) -> tuple[bool, list[list[int]]]:
        if prompt is not None and input_ids is not None:
            raise ValueError("prompt: give exactly one of prompt or input_ids")
        batched = isinstance(prompt, list) if prompt is not None else \
            isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)
        items = (prompt if prompt is not None else input_ids) if batched else [prompt if prompt is not None else input_ids]
        if not items:
            raise ValueError("prompt: must be a string or a non-empty list of strings")
        check = dict(vocab_size=self.model_config.vocab_size, context_len=self.scheduler.context_len,
                     text_field="prompt")
        if prompt is not None:
            return batched, [prompt_token_ids(self.tokenizer, t, None, **check) for t in items]
        return batched, [prompt_token_ids(self.tokenizer, None, ids, **check) for ids in items]

    def _output(self, req: Req, latency: float, with_text: bool) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": req.rid,
            "prompt_tokens": len(req.origin_input_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens,
            "finish_reason": req.finish_reason.to_dict(),
            "e2e_latency": latency,
        }
        if req.logprob.return_logprob:
            meta.update(logprob_meta(self.tokenizer, with_text, req.logprob.top_logprobs_num,
                                     req.input_token_logprobs, req.input_top_logprobs,
                                     req.output_token_logprobs, req.output_top_logprobs))
        return {"text": output_text(req, self.tokenizer), "output_ids": list(req.output_ids), "meta_info": meta}

    def flush_cache(self) -> bool:
        return self.scheduler.flush_cache()

    def shutdown(self) -> None:
        self.scheduler = None  # frees the model and KV pool
        gc.collect()  # CUDA graphs and backends hold reference cycles; free their memory now
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _logprob_options(return_logprob: bool, start: int | None, top_k: int) -> LogprobOptions:
    if not isinstance(return_logprob, bool):
        raise ValueError("return_logprob: must be a boolean")
    if start is not None and (not isinstance(start, int) or start < -1):
        raise ValueError("logprob_start_len: must be an integer >= -1")
    if not isinstance(top_k, int) or top_k < 0:
        raise ValueError("top_logprobs_num: must be an integer >= 0")
    return LogprobOptions(return_logprob=return_logprob, logprob_start_len=-1 if start is None else start,
                          top_logprobs_num=top_k)
