"""/tokenize (also /v1/tokenize): the server's tokenizer over HTTP, with SGLang's names.

Clients that need token ids (the language's `select` finds where a prompt ends and a choice
begins) ask the server, so they never need the model's files or the runtime's loader: a client
on another machine gets the same ids as one beside the server. The chat template and special
tokens come from /get_model_info.

Body: `{"prompt": str | [str, ...], "add_special_tokens": bool = true, "model": ignored}`.
Reply: `{"tokens": ids | [ids, ...], "count": n | [n, ...], "max_model_len": context length}`,
a list for a list. /generate tokenizes text with `add_special_tokens=false`; send that to get
the ids it will see.
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response

from .errors import error_response
from .generate_route import field_of

_FIELDS = {"prompt", "add_special_tokens", "model"}


def add_tokenize_routes(app: FastAPI, state: Any) -> None:
    """Registers the routes on `app`; `state` is the app's ServerState (its `tm` tokenizes)."""
    @app.post("/tokenize")
    @app.post("/v1/tokenize")
    async def tokenize(request: Request) -> Response:
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError as e:
            return error_response(400, f"body: malformed JSON: {e}")
        try:
            prompts, batched, add_special = _parse(body)
        except ValueError as e:
            return error_response(400, str(e), field_of(str(e)))
        tok = state.tm.tokenizer
        ids = [list(tok.encode(p, add_special_tokens=add_special)) for p in prompts]
        reply = {"tokens": ids if batched else ids[0], "count": [len(i) for i in ids] if batched else len(ids[0]),
                 "max_model_len": state.tm.context_len}
        return Response(orjson.dumps(reply), media_type="application/json")


def _parse(body: Any) -> tuple[list[str], bool, bool]:
    """(prompts, whether the body held a list, add_special_tokens); ValueError names the field."""
    if not isinstance(body, dict):
        raise ValueError("body: must be a JSON object")
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise ValueError(f"{unknown[0]}: unknown field")
    prompt = body.get("prompt")
    batched = isinstance(prompt, list)
    prompts = prompt if batched else [prompt]
    if not all(isinstance(p, str) for p in prompts):
        raise ValueError("prompt: must be a string or a list of strings")
    add_special = body.get("add_special_tokens", True)
    if not isinstance(add_special, bool):
        raise ValueError("add_special_tokens: must be true or false")
    return prompts, batched, add_special
