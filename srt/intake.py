"""Request intake: the one place where a request from any front door (native /generate, the
OpenAI routes, the in-process Engine) is validated and normalised into scheduler messages.

Every check raises a ValueError whose message starts with the field it is about
("sampling_params.top_p: ...", "cache_salt: ..."); the HTTP layers turn that into a 400 naming
the field, the Engine lets it propagate. Nothing is sent before the whole request validated.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any, Callable, Collection

from .io_struct import ImageInput, TokenizedGenerateReq
from .sampling_params import SamplingParams

MAX_TOP_LOGPROBS = 64  # top-k alternatives per token; each costs a top-k over the vocabulary
# Integers travel to the scheduler over msgpack as signed 64-bit values; a larger one would fail
# there, after the request was accepted, so it is refused here naming the field.
_INT64_MAX = 2**63 - 1
_BOUNDED_INT_FIELDS = ("max_new_tokens", "top_k", "min_new_tokens")


def prompt_token_ids(tokenizer: Any, text: Any, input_ids: Any, vocab_size: int, context_len: int,
                     text_field: str = "text", ids_field: str = "input_ids") -> list[int]:
    """Token ids for exactly one of `text` / `input_ids`, checked against vocab and context."""
    if (text is None) == (input_ids is None):
        raise ValueError(f"{text_field}: give exactly one of {text_field} or {ids_field}")
    if text is not None:
        if not isinstance(text, str):
            raise ValueError(f"{text_field}: must be a string")
        if not text:
            raise ValueError(f"{text_field}: must not be empty")
        ids, field = tokenizer.encode(text, add_special_tokens=False), text_field
    else:
        ids, field = input_ids, ids_field
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"{field}: must be a list of token ids")
    if not ids:
        raise ValueError(f"{field}: must not be empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{field}: token ids {bad[:3]} are outside the vocabulary [0, {vocab_size})")
    if len(ids) >= context_len:
        raise ValueError(f"{field}: {len(ids)} tokens do not fit the context length {context_len}")
    return list(ids)


def check_logprob_options(return_logprob: Any, logprob_start_len: Any, top_logprobs_num: Any) -> tuple[bool, int, int]:
    """(return_logprob, logprob_start_len, top_logprobs_num) with None read as the default."""
    start = -1 if logprob_start_len is None else logprob_start_len
    top = 0 if top_logprobs_num is None else top_logprobs_num
    if not isinstance(return_logprob, bool):
        raise ValueError("return_logprob: must be a boolean")
    if not _is_int(start) or start < -1:
        raise ValueError("logprob_start_len: must be an integer >= -1")
    if not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs_num: must be an integer in [0, {MAX_TOP_LOGPROBS}]")
    return return_logprob, start, top


def check_cache_salt(cache_salt: Any) -> str | None:
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise ValueError("cache_salt: must be a non-empty string")
    return cache_salt


MAX_SESSION_ID_CHARS = 128


def check_session_id(session_id: Any) -> str | None:
    if session_id is not None and (not isinstance(session_id, str) or not 0 < len(session_id) <= MAX_SESSION_ID_CHARS):
        raise ValueError(f"session_id: must be a non-empty string of at most {MAX_SESSION_ID_CHARS} characters")
    return session_id


def deterministic_seed(args: Any) -> int | None:
    """The seed of requests that name none: --random-seed under --enable-deterministic-inference,
    else none (each such request samples freshly)."""
    return args.model.random_seed if args.executor.enable_deterministic_inference else None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class Intake:
    """Validates requests against one model (its tokenizer, vocabulary and context length)."""

    def __init__(self, tokenizer: Any, vocab_size: int, context_len: int, default_seed: int | None = None,
                 adapters: Callable[[], Collection[str]] | None = None, sessions: Any = None, images: Any = None):
        """default_seed: the seed of a request that names none (--enable-deterministic-inference
        gives every request one, so that the same request gets the same answer).
        adapters: the names of the LoRA adapters requests may name now (None: no --enable-lora).
        sessions: who owns which session id (server/session_routes.py's SessionOwners: its
        `claim(session_id, tenant)` raises ValueError for another tenant's); None: not checked.
        images: a vision-language model's image intake (srt/multimodal/inputs.py's ImageInputs);
        None: a text-only model, which refuses images."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.context_len = context_len
        self.default_seed = default_seed
        self.adapters = adapters
        self.sessions = sessions
        self.images = images

    def lora_path(self, name: Any) -> str | None:
        """A request's adapter: None (the base model) or the name of a loaded one."""
        if name is None:
            return None
        if not isinstance(name, str):
            raise ValueError("lora_path: must be an adapter's name (a string) or null")
        if self.adapters is None:
            raise ValueError(f"lora_path: {name!r} names an adapter, but the server runs without --enable-lora")
        loaded = self.adapters()
        if name not in loaded:
            raise ValueError(f"lora_path: adapter {name!r} is not loaded (loaded: {', '.join(sorted(loaded)) or 'none'})")
        return name

    def prompt_ids(self, text: Any = None, input_ids: Any = None, *, text_field: str = "text",
                   ids_field: str = "input_ids") -> list[int]:
        return prompt_token_ids(self.tokenizer, text, input_ids, self.vocab_size, self.context_len,
                                text_field, ids_field)

    def prompt_images(self, ids: list[int], items: list[tuple[str, Any]], count_field: str,
                      ids_field: str) -> tuple[list[int], list[ImageInput]]:
        """A prompt's images, each a (field, what the client sent): decoded, processed and hashed,
        and the prompt's placeholders expanded into their tokens. Slow (image decoding): call
        it off the event loop."""
        return self.expand_images(ids, self.load_images(items, count_field), ids_field)

    def load_images(self, items: list[tuple[str, Any]], count_field: str) -> list[Any]:
        """Each (field, item) decoded, processed and hashed (multimodal/inputs.py's PreparedImage)."""
        if self.images is None:
            if items:
                raise ValueError(f"{items[0][0]}: this model is text-only; images need a vision-language model")
            return []
        return self.images.load(items, count_field)

    def expand_images(self, ids: list[int], images: list[Any], field: str) -> tuple[list[int], list[ImageInput]]:
        """The prompt with each of its prepared images' placeholders expanded (`load_images`);
        for a vision-language model, a placeholder without its image is refused too."""
        if self.images is None:
            return ids, []
        ids, records = self.images.expand(ids, images, field)
        if len(ids) >= self.context_len:
            raise ValueError(f"{field}: with its images the prompt has {len(ids)} tokens, which do not fit the "
                             f"context length {self.context_len}")
        return ids, records

    def samples(self, input_ids: list[int], sampling_params: dict[str, Any] | None, *, rid: Any = None,
                return_logprob: Any = False, logprob_start_len: Any = None, top_logprobs_num: Any = None,
                stream: bool = False, cache_salt: Any = None, lora_path: Any = None,
                session_id: Any = None, images: list[ImageInput] = ()) -> list[TokenizedGenerateReq]:
        """One message per sample of one tokenized prompt (its images expanded already, see
        `prompt_images`). With n > 1, sample i gets seed + i and rid "{rid}-{i}"; without a rid
        each sample gets a fresh one."""
        sp = self.sampling_params(input_ids, sampling_params)
        logprob = check_logprob_options(return_logprob, logprob_start_len, top_logprobs_num)
        salt = check_cache_salt(cache_salt)
        lora = self.lora_path(lora_path)
        session = check_session_id(session_id)
        if rid is not None and not isinstance(rid, str):
            raise ValueError("rid: must be a string")
        out = []
        for i in range(sp.n):
            sample_rid = uuid.uuid4().hex if rid is None else (rid if sp.n == 1 else f"{rid}-{i}")
            out.append(TokenizedGenerateReq(
                rid=sample_rid, input_ids=input_ids, sampling_params=sp.for_sample(i), return_logprob=logprob[0],
                logprob_start_len=logprob[1], top_logprobs_num=logprob[2], stream=stream, cache_salt=salt,
                lora_path=lora, session_id=session, images=list(images)))
        if session is not None and self.sessions is not None:  # last: a request refused otherwise claims nothing
            self.sessions.claim(session, (salt, lora))
        return out

    def sampling_params(self, input_ids: list[int], params: Any) -> SamplingParams:
        """Validated parameters with max_new_tokens clamped to the context the prompt leaves (as
        SGLang does): a request asking for 10**9 tokens reserves no more than it can use."""
        sp = SamplingParams.from_dict(params, vocab_size=self.vocab_size)
        if sp.seed is None and self.default_seed is not None:
            sp = dataclasses.replace(sp, seed=self.default_seed)
        for name in _BOUNDED_INT_FIELDS:
            if getattr(sp, name) > _INT64_MAX:
                raise ValueError(f"sampling_params.{name}: must be at most {_INT64_MAX}")
        room = self.context_len - len(input_ids)
        if sp.max_new_tokens > room:
            sp = dataclasses.replace(sp, max_new_tokens=room)
        return sp

    def batch(self, text: Any, input_ids: Any, sampling_params: Any, rid: Any = None, *,
              text_field: str = "text", lora_path: Any = None, image_data: Any = None,
              **options: Any) -> tuple[bool, list[list[TokenizedGenerateReq]]]:
        """SGLang's request shape: one prompt (text or ids) or a list of them, with
        `sampling_params` and `rid` given once for all prompts or as a list with one per prompt.
        `lora_path` too may be given once or per prompt (SGLang's). `image_data`: one prompt's
        image or list of images, or for a batch a list with one such entry per prompt (SGLang's);
        each image's placeholder token sits in the prompt where it goes. Returns whether the input
        was a batch, and each prompt's samples in prompt order; `options` go to `samples` for
        every prompt."""
        if text is not None and input_ids is not None:
            raise ValueError(f"{text_field}: give exactly one of {text_field} or input_ids")
        batched = isinstance(text, list) or (
            isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list))
        given = text if text is not None else input_ids
        prompts = given if batched else [given]
        if not prompts:
            raise ValueError(f"{text_field}: a batch must not be empty")
        params_list = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params_list) != len(prompts) or not all(p is None or isinstance(p, dict) for p in params_list):
            raise ValueError("sampling_params: must be an object, or a list with one object per prompt")
        rids = rid if isinstance(rid, list) else [rid] * len(prompts)
        if len(rids) != len(prompts):
            raise ValueError("rid: a list must have one entry per prompt")
        loras = lora_path if isinstance(lora_path, list) else [lora_path] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError("lora_path: a list must have one entry per prompt")
        image_lists = _image_items(image_data, len(prompts), batched)
        groups = []
        for prompt, params, one_rid, lora, images in zip(prompts, params_list, rids, loras, image_lists):
            ids = self.prompt_ids(prompt if text is not None else None, prompt if text is None else None,
                                  text_field=text_field)
            ids, records = self.prompt_images(ids, images, "image_data", text_field if text is not None else "input_ids")
            groups.append(self.samples(ids, params, rid=one_rid, lora_path=lora, images=records, **options))
        seen: set[str] = set()
        for msg in (m for group in groups for m in group):
            if msg.rid in seen:  # the second would be refused only once the first is running
                raise ValueError(f"rid: {msg.rid!r} is given twice")
            seen.add(msg.rid)
        return batched, groups


def _image_items(image_data: Any, count: int, batched: bool) -> list[list[tuple[str, Any]]]:
    """Per prompt, its images as (field, item)."""
    if image_data is None:
        return [[] for _ in range(count)]
    if not batched:
        return [_prompt_images(image_data, "image_data")]
    if not isinstance(image_data, list) or len(image_data) != count:
        raise ValueError("image_data: for a batch of prompts, a list with one entry per prompt (an image, a list of "
                         "images, or null)")
    return [_prompt_images(entry, f"image_data[{p}]") for p, entry in enumerate(image_data)]


def _prompt_images(entry: Any, field: str) -> list[tuple[str, Any]]:
    if entry is None:
        return []
    if isinstance(entry, (list, tuple)):
        return [(f"{field}[{i}]", item) for i, item in enumerate(entry)]
    return [(field, entry)]
