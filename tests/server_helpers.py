"""The tests start their servers as the benchmarks do: this re-exports benchmarks/harness.py for
the test files that still import it by this name (new code imports benchmarks.harness)."""

from benchmarks.harness import ServerProcess, free_port, pid_alive

__all__ = ["ServerProcess", "free_port", "pid_alive"]
