"""The tests start their servers as the benchmarks do: this re-exports benchmarks/harness.py for
the test files that still import it by this name (new code imports benchmarks.harness)."""

from benchmarks.harness import RouterProcess, ServerProcess, free_port, pid_alive, wait_until

__all__ = ["RouterProcess", "ServerProcess", "free_port", "pid_alive", "wait_until"]
