"""The quickstart as a newcomer runs it (issue 15, item 1): it says what happens while the server
starts, prints answers, and a Ctrl-C ends it with one line, no traceback, no server left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from server_helpers import pid_alive

QUICKSTART = os.path.join(os.path.dirname(__file__), "..", "examples", "quickstart.py")


def test_quickstart_explains_its_start_and_prints_answers():
    out = subprocess.run([sys.executable, QUICKSTART], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    stages = [line for line in out.stderr.replace("\r", "\n").splitlines() if line.startswith("[radixlm]")]
    order = ["starting a server", "loading", "starting the scheduler", "model loaded", "warmed up"]
    positions = [next(i for i, line in enumerate(stages) if key in line) for key in order]
    assert positions == sorted(positions), stages
    assert "== Paris" in out.stdout and "== Tokyo" in out.stdout and "radix cache hit rate" in out.stdout
    assert "continent: Europe" in out.stdout


def test_ctrl_c_in_the_quickstart_is_one_line_and_stops_the_server():
    proc = subprocess.Popen([sys.executable, QUICKSTART], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    server_pid = None
    deadline = time.monotonic() + 300
    while server_pid is None and time.monotonic() < deadline:
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        for pid in children:  # the server, not the `--help` call that reads its flags first
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    server_pid = int(pid) if b"--port" in f.read() else server_pid
            except (FileNotFoundError, ProcessLookupError):  # it exited between pgrep and the read
                pass
        time.sleep(0.2)
    time.sleep(3)  # the server is loading
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "interrupted"
    deadline = time.monotonic() + 30
    while pid_alive(server_pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not pid_alive(server_pid)
