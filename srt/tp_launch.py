"""Starting the tensor-parallel ranks of `radixlm serve --tp-size N [--nnodes M --node-rank R]`.

Node 0 runs the HTTP server, the detokenizer and the scheduler (rank 0) as usual, plus its
other local ranks; every other node runs only its ranks (`tp_size / nnodes` of them, one per
GPU) and exits when they do. Ranks meet at `--dist-init-addr` (node 0's address; a free local
port when there is one node).
"""

from __future__ import annotations

import logging
import signal
import socket
import time
from typing import Any

from .children import ChildProcesses, wait_ready
from .server_args import ServerArgs

logger = logging.getLogger("radixlm.launch")


def dist_addr(args: ServerArgs) -> str:
    if args.parallel.dist_init_addr:
        return args.parallel.dist_init_addr
    with socket.socket() as s:  # one node: a free port on the loopback
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def start_node_ranks(children: Any, args: ServerArgs, addr: str, skip_rank0: bool) -> set[str]:
    """Starts this node's ranks (rank 0 excepted on node 0: it is the scheduler process);
    returns the names their ready signals carry."""
    from .entrypoints.tp_follower import follower_name, run_tp_follower_process

    per_node = args.parallel.tp_size // args.parallel.nnodes
    names = set()
    for local_rank in range(per_node):
        rank = args.parallel.node_rank * per_node + local_rank
        if rank == 0 and skip_rank0:
            continue
        children.start(follower_name(rank), run_tp_follower_process, args.to_dict(), rank, local_rank,
                       addr, children.addr("ready"))
        names.add(follower_name(rank))
    return names


class LocalRanks:
    """An in-process Engine's other ranks on this node (it is rank 0), as child processes."""

    def __init__(self, args: ServerArgs):
        import zmq

        from .executor import parallel

        if args.parallel.nnodes > 1:
            raise ValueError("nnodes: an Engine runs on one node; serve several with `radixlm serve --nnodes`")
        parallel.check_devices(args)
        self.addr = dist_addr(args)
        self.children = ChildProcesses()
        self._ctx = zmq.Context()
        self._ready = self._ctx.socket(zmq.PULL)
        self._ready.setsockopt(zmq.LINGER, 0)
        self._ready.bind(self.children.addr("ready"))
        self._names = start_node_ranks(self.children, args, self.addr, skip_rank0=True)

    def wait_ready(self) -> None:
        wait_ready(self._ready, self.children, set(self._names))

    def stop(self, grace_s: float = 10.0) -> None:
        """Waits for the ranks to exit (rank 0 told them to), then stops any left."""
        deadline = time.monotonic() + grace_s
        for proc in self.children.procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
        self._ready.close()
        self._ctx.term()
        self.children.stop()


def serve_follower_node(args: ServerArgs) -> int:
    """A node other than 0: runs its ranks until they stop (0), one fails (1) or a signal."""
    import zmq

    from .executor import parallel
    from .process_utils import stage

    try:
        parallel.check_devices(args)
    except ValueError as e:
        logger.error("%s", e)
        return 1
    children = ChildProcesses()
    ctx = zmq.Context()
    ready = ctx.socket(zmq.PULL)
    ready.setsockopt(zmq.LINGER, 0)
    ready.bind(children.addr("ready"))
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    try:
        parallel = args.parallel
        stage(f"node {parallel.node_rank} of {parallel.nnodes}: starting its tensor-parallel ranks; they meet at "
              f"{parallel.dist_init_addr}")
        wait_ready(ready, children, start_node_ranks(children, args, parallel.dist_init_addr, skip_rank0=False))
        stage(f"node {parallel.node_rank}: ranks ready; serving node 0's requests")
        while not stopping:
            if children.dead():
                codes = [p.exitcode for p in children.procs.values()]
                return 0 if all(code == 0 for code in codes) else 1
            time.sleep(0.5)
        return 0
    except RuntimeError as e:
        logger.error("%s", e)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        ready.close()
        ctx.term()
        children.stop()
