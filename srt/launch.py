"""`radixlm serve`: starts the scheduler and detokenizer processes, waits until both are ready,
then serves HTTP from this process. Exits non-zero if a child dies."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import time
from typing import Any

import zmq

from radixlm.srt import io_struct
from radixlm.srt.server_args import ServerArgs

logger = logging.getLogger("radixlm.launch")

READY_TIMEOUT_S = 900.0
_CHILD_STOP_TIMEOUT_S = 10.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixlm serve", description="Serve a model over HTTP.")
    for f in dataclasses.fields(ServerArgs):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            parser.add_argument(flag, action="store_true", default=f.default)
        else:
            kind = {"int": int, "float": float}.get(str(f.type).split(" |")[0], str)
            parser.add_argument(flag, type=kind, default=f.default)
    parser.add_argument("--served-model-name", default=None, help="model id in /v1/models")
    parser.add_argument("--log-level", default="info")
    return parser


def parse_args(argv: list[str]) -> tuple[ServerArgs, argparse.Namespace]:
    ns = build_parser().parse_args(argv)
    fields = {f.name for f in dataclasses.fields(ServerArgs)}
    try:
        args = ServerArgs(**{k: v for k, v in vars(ns).items() if k in fields})
    except ValueError as e:
        build_parser().error(str(e))
    return args, ns


class _Children:
    """The scheduler and detokenizer processes and their private ipc directory."""

    def __init__(self) -> None:
        self.ipc_dir = tempfile.mkdtemp(prefix="radixlm-ipc-")  # mode 0700: private sockets
        self.procs: dict[str, mp.Process] = {}

    def addr(self, name: str) -> str:
        return f"ipc://{os.path.join(self.ipc_dir, name)}"

    def start(self, name: str, target: Any, *args: Any) -> None:
        proc = mp.get_context("spawn").Process(target=target, args=args, name=f"radixlm-{name}", daemon=False)
        proc.start()
        self.procs[name] = proc

    def dead(self) -> list[str]:
        return [f"{n} exited with code {p.exitcode}" for n, p in self.procs.items() if not p.is_alive()]

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + _CHILD_STOP_TIMEOUT_S
        for proc in self.procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def _wait_ready(ready: zmq.Socket, children: _Children, names: set[str]) -> dict[str, Any]:
    info: dict[str, Any] = {}
    deadline = time.monotonic() + READY_TIMEOUT_S
    while names:
        if ready.poll(500):
            signal_msg = io_struct.decode(ready.recv())
            if not signal_msg.ok:
                raise RuntimeError(f"{signal_msg.process} failed to start: {signal_msg.error}")
            names.discard(signal_msg.process)
            info.update(signal_msg.info)
        elif children.dead():
            raise RuntimeError("; ".join(children.dead()))
        elif time.monotonic() > deadline:
            raise RuntimeError(f"{', '.join(sorted(names))} not ready after {READY_TIMEOUT_S:.0f}s")
    return info


def _local_tokenizer_dir(args: ServerArgs) -> str | None:
    """The tokenizer's local directory when nothing must be converted or fetched first."""
    paths = [p for p in (args.model_path, args.tokenizer_path) if p]
    if any(str(p).endswith(".gguf") for p in paths):
        return None
    candidate = args.tokenizer_path or args.model_path
    return candidate if candidate and os.path.isdir(candidate) else None


def launch_server(args: ServerArgs, served_model_name: str | None = None, log_level: str = "info") -> int:
    """Runs the server until SIGINT/SIGTERM (returns 0) or a child process dies (returns 1)."""
    import uvicorn

    from radixlm.srt.detokenizer.process import run_detokenizer_process
    from radixlm.srt.server.http_server import ServerState, create_app
    from radixlm.srt.server.chat import ChatOptions
    from radixlm.srt.server.openai_api import register_openai_routes
    from radixlm.srt.executor.model_loader import load_model
    from radixlm.srt.scheduler.process import run_scheduler_process
    from radixlm.srt.server.tokenizer_manager import TokenizerManager

    def read_meta():
        meta = load_model(args.model_path, load_format=args.load_format, tokenizer_path=args.tokenizer_path,
                          with_weights=False)
        if meta.tokenizer is None:
            raise SystemExit("the model has no tokenizer; pass --tokenizer-path")
        return meta

    # Config and tokenizer for this process. Read while the children start (it takes seconds)
    # when the tokenizer is a local directory; first otherwise: a GGUF is converted once, and a
    # hub model is fetched once, before the children race for them.
    tokenizer_dir = _local_tokenizer_dir(args)
    meta = None if tokenizer_dir else read_meta()
    children = _Children()
    logger.info("ipc directory: %s", children.ipc_dir)
    ctx = zmq.Context()
    ready = ctx.socket(zmq.PULL)
    ready.setsockopt(zmq.LINGER, 0)
    ready.bind(children.addr("ready"))
    try:
        children.start("detokenizer", run_detokenizer_process, tokenizer_dir or args.tokenizer_path or meta.local_dir,
                       children.addr("detokenizer"), children.addr("tokenizer"), children.addr("ready"))
        children.start("scheduler", run_scheduler_process, dataclasses.asdict(args),
                       children.addr("scheduler"), children.addr("detokenizer"), children.addr("ready"))
        meta = meta or read_meta()
        info = _wait_ready(ready, children, {"scheduler", "detokenizer"})
    except BaseException as e:
        children.stop()
        ready.close()
        ctx.term()
        if isinstance(e, RuntimeError):
            logger.error("%s", e)
            return 1
        raise
    ready.close()
    ctx.term()

    model_name = served_model_name or (args.model_path or "default")
    tm = TokenizerManager(meta.tokenizer, meta.config, info["context_len"], children.addr("scheduler"),
                          children.addr("tokenizer"))
    state = ServerState(tm, args.model_path or meta.model_path, dataclasses.asdict(args))
    app = create_app(state, args.api_key)
    register_openai_routes(app, lambda: tm, model_name, ChatOptions(args.tool_call_parser, args.reasoning_parser))
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=log_level,
                                           timeout_graceful_shutdown=5))
    exit_code = 0

    async def watch_children() -> None:
        nonlocal exit_code
        while not server.should_exit:
            await asyncio.sleep(0.5)
            dead = children.dead()
            if dead:
                state.healthy, state.unhealthy_reason = False, "; ".join(dead)
                logger.error("child process died (%s); shutting down", state.unhealthy_reason)
                exit_code = 1
                await asyncio.sleep(1.0)  # let health probes see 503 before the port closes
                server.should_exit = True

    async def serve() -> None:
        tm.start()
        watcher = asyncio.ensure_future(watch_children())
        try:
            await server.serve()
        finally:
            watcher.cancel()

    # uvicorn re-raises the SIGINT/SIGTERM it caught once it has shut down; with a Python
    # handler in place that lands here instead of killing us before the children are stopped.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: logger.info("got signal %d; shutting down", signum))
    try:
        asyncio.run(serve())
    finally:
        tm.close()
        children.stop()
    return exit_code


def main(argv: list[str] | None = None) -> None:
    args, ns = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    sys.exit(launch_server(args, ns.served_model_name, ns.log_level))


def cli() -> None:
    """`radixlm serve ...` (the console script)."""
    argv = sys.argv[1:]
    if not argv or argv[0] != "serve":
        print("usage: radixlm serve [--model-path PATH] [--port N] ... (radixlm serve --help)", file=sys.stderr)
        sys.exit(2)
    main(argv[1:])


if __name__ == "__main__":
    main()
