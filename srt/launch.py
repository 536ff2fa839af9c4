"""`radixlm serve`: starts the scheduler and detokenizer processes, waits until both are ready,
then serves HTTP from this process. Exits non-zero if a child dies."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from typing import Any

import zmq

from .children import ChildProcesses, wait_ready
from .process_utils import bind_port, exit_now, show_progress_bars_in_log, stage
from .server_args import ServerArgs
from .server_flags import parse_flags

logger = logging.getLogger("radixlm.launch")


def _local_tokenizer_dir(args: ServerArgs) -> str | None:
    """The tokenizer's local directory when nothing must be converted or fetched first: a
    directory, or a GGUF that an earlier run converted (the embedded default model included)."""
    from .executor.default_model import default_model_path
    from .executor.gguf_loader import converted_dir, converted_tokenizer_dir

    try:
        model = args.model.model_path or default_model_path()
    except FileNotFoundError:
        return None  # read_meta says what to install
    if str(model).endswith(".gguf") and converted_dir(model) is None:
        return None  # converted once, here, before the scheduler would race to convert it too
    source = str(args.model.tokenizer_path or model)
    if source.endswith(".gguf"):
        found = converted_tokenizer_dir(source)
        return str(found) if found is not None else None
    return source if os.path.isdir(source) else None


def launch_server(args: ServerArgs) -> int:
    """Runs the server until SIGINT/SIGTERM (returns 0) or a child process dies (returns 1)."""
    if args.parallel.node_rank > 0:  # tensor-parallel ranks only; node 0 serves
        from .tp_launch import serve_follower_node

        return serve_follower_node(args)
    try:
        sock = bind_port(args.http.host, args.http.port)
    except OSError as e:
        logger.error("%s", e)
        return 1
    try:
        return _launch(args, sock)
    finally:
        sock.close()


def _launch(args: ServerArgs, sock: Any) -> int:
    # Only what starting the children needs is imported before they start: torch and the HTTP
    # stack take seconds to import, and the children need not wait for them.
    from .entrypoints.detokenizer import run_detokenizer_process
    from .entrypoints.scheduler import run_scheduler_process

    def read_meta():
        from .executor.model_loader import load_model

        meta = load_model(args.model.model_path, load_format=args.model.load_format,
                          tokenizer_path=args.model.tokenizer_path, with_weights=False)
        if meta.tokenizer is None:
            raise SystemExit("the model has no tokenizer; pass --tokenizer-path")
        if args.api.chat_template is not None:  # chats render in this process only
            with open(args.api.chat_template) as f:
                meta.tokenizer.chat_template = f.read()
        return meta

    # Config and tokenizer for this process. Read while the children start (it takes seconds)
    # when the tokenizer is a local directory or a GGUF converted by an earlier run; first
    # otherwise: a GGUF is converted once, and a hub model is fetched once, before the children
    # race for them.
    if args.parallel.tp_size > 1:
        from .executor.parallel import check_devices

        try:
            check_devices(args)
        except ValueError as e:
            logger.error("%s", e)
            return 1
    tokenizer_dir = _local_tokenizer_dir(args)
    stage(f"loading {args.model.model_path or 'the embedded SmolLM2-135M-Instruct'}"
          + ("" if tokenizer_dir else " (a GGUF is converted once, on its first use)"))
    started = time.perf_counter()
    try:
        meta = None if tokenizer_dir else read_meta()
    except (OSError, ValueError) as e:  # no network for a hub id, a file that is not a model
        print(f"radixlm serve: error: model_path: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    children = ChildProcesses()
    logger.info("ipc directory: %s", children.ipc_dir)
    ctx = zmq.Context()
    ready = ctx.socket(zmq.PULL)
    ready.setsockopt(zmq.LINGER, 0)
    ready.bind(children.addr("ready"))
    try:
        stage("starting the scheduler (loads the weights) and the detokenizer")
        children.start("detokenizer", run_detokenizer_process,
                       tokenizer_dir or args.model.tokenizer_path or meta.local_dir,
                       children.addr("detokenizer"), children.addr("tokenizer"), children.addr("ready"))
        starting = {"scheduler", "detokenizer"}
        addr = None
        if args.parallel.tp_size > 1:
            from .tp_launch import dist_addr, start_node_ranks

            addr = dist_addr(args)
            starting |= start_node_ranks(children, args, addr, skip_rank0=True)
        children.start("scheduler", run_scheduler_process, args.to_dict(),
                       children.addr("scheduler"), children.addr("detokenizer"), children.addr("ready"), addr)
        logger.info("children: %s", ", ".join(f"{n} pid {p.pid}" for n, p in children.procs.items()))
        meta = meta or read_meta()
        info = wait_ready(ready, children, starting)
    except BaseException as e:
        children.stop()
        ready.close()
        ctx.term()
        if isinstance(e, RuntimeError):
            logger.error("%s", e)
            return 1
        if isinstance(e, KeyboardInterrupt):
            return 130
        raise
    ready.close()
    ctx.term()
    stage(f"model loaded in {time.perf_counter() - started:.1f}s; warming up")
    import uvicorn

    from .server.chat import ChatOptions
    from .server.http_server import ServerState, create_app
    from .server.lifecycle import Server
    from .server.openai_api import register_openai_routes
    from .intake import deterministic_seed
    from .multimodal.inputs import ImageInputs
    from .multimodal.limits import limits_from_settings
    from .server.lora_routes import AdapterNames
    from .server.session_routes import SessionOwners
    from .server.tokenizer_manager import TokenizerManager

    args = args.replace(**info["device_defaults"])

    model_name = args.api.served_model_name or (args.model.model_path or "default")
    adapters = AdapterNames(model_name, args.lora.lora_paths) if args.lora.enable_lora else None
    try:  # a vision-language model's image processor (preprocessor_config.json)
        images = ImageInputs.for_model(meta.config, meta.tokenizer, meta.local_dir,
                                       limits_from_settings(args.multimodal))
    except ValueError as e:
        logger.error("%s", e)
        children.stop()
        return 1
    tm = TokenizerManager(meta.tokenizer, meta.config, info["context_len"], children.addr("scheduler"),
                          children.addr("tokenizer"),
                          max_in_flight=args.scheduler.max_running_requests + args.scheduler.max_queued_requests,
                          default_seed=deterministic_seed(args), adapters=adapters,
                          sessions=SessionOwners(args.session.session_ttl), images=images)
    state = ServerState(tm, args.model.model_path or meta.model_path, args.to_dict(), warm=False)
    app = create_app(state, args.http.api_key, args.http.max_request_bytes, args.http.rate_limit_rpm,
                     args.api.incremental_streaming_output)
    register_openai_routes(app, lambda: tm, model_name,
                           ChatOptions(args.api.tool_call_parser, args.api.reasoning_parser))
    host, port = sock.getsockname()[:2]
    server = Server(uvicorn.Config(app, host=host, port=port, log_level=args.http.log_level,
                                   timeout_graceful_shutdown=5),
                    state, children.dead, args.http.graceful_shutdown_timeout)
    try:
        asyncio.run(server.run(sock))
    except KeyboardInterrupt:  # a signal before uvicorn took the handlers over
        pass
    finally:
        tm.close()
        children.stop()
    stage("stopped")
    return server.exit_code


def main(argv: list[str] | None = None) -> None:
    args = parse_flags(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=args.http.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    show_progress_bars_in_log()
    if args.parallel.dp_size > 1:  # replicas behind the cache-aware router
        from .router.dp_launcher import launch_dp

        exit_now(launch_dp(args))
    exit_now(launch_server(args))


_USAGE = """usage: radixlm serve [--model-path PATH] [--port N] [...]
       radixlm router --worker-urls URL [URL ...] [--port N] [...]

commands:
  serve    serve a model over HTTP (radixlm serve --help lists every flag with its default)
  router   route requests over running servers by cached prefix (radixlm router --help)
"""


def cli() -> None:
    """`radixlm serve ...` (the console script)."""
    argv = sys.argv[1:]
    if argv and argv[0] in ("-h", "--help", "help"):
        print(_USAGE, end="")
        sys.exit(0)
    if argv and argv[0] == "router":
        from .router.cli import main as router_main

        router_main(argv[1:])
    if not argv or argv[0] != "serve":
        print(_USAGE, end="", file=sys.stderr)
        sys.exit(2)
    main(argv[1:])


if __name__ == "__main__":
    main()
