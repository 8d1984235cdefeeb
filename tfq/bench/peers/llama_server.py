"""llama.cpp's own server (`llama-server`) as the peer of `tfq bench serve`: the same GGUF, prompts, levels and
client, a fresh server process each level, as tfq's levels get a fresh engine each.

The peer runs in a process of its own: one that exits, crashes or stops answering costs its rows and one line
saying what happened and how to mend it; tfq's rows are measured and printed all the same. The binary is built
once by benchmarks/build_llama_server.sh (from the llama.cpp sources the llama-cpp-python sdist carries) into
$TFQ_CACHE/llama-server/, or named by TFQ_LLAMA_SERVER.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from tfq.errors import TfqError

NAME = "llama-server"
START_S = 300.0  # loading a GGUF and warming up; past it the peer is called stuck
PEER_TIMEOUT_S = 600.0  # one request's wait for the peer; past it the peer is called stuck
BUILD = "bash benchmarks/build_llama_server.sh"
FLAGS_HINT = ("rebuild it for this CPU's instruction sets without -march=native (`bash benchmarks/"
              "build_llama_server.sh` builds with GGML_NATIVE=OFF, AVX-512 only where the CPU has it, AMX off)")


class PeerDown(RuntimeError):
    """The peer exited, crashed or stopped answering: the one line saying so (and how to mend it)."""


def binary() -> Path:
    """The llama-server to run: TFQ_LLAMA_SERVER, else the one the build script left in the cache."""
    named = os.environ.get("TFQ_LLAMA_SERVER")
    path = Path(named) if named else Path(os.environ.get("TFQ_CACHE", Path.home() / ".cache" / "tfq")) / NAME / NAME
    if not path.is_file() or not os.access(path, os.X_OK):
        raise TfqError(f"--peer llama-server: no llama-server at {path}; build it once with `{BUILD}` (minutes), "
                       f"or set TFQ_LLAMA_SERVER to a llama-server binary")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _why(code: int | None, log: Path) -> str:
    """One line on how the process ended, with the last line of its log."""
    tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-1:] if log.exists() else []
    if code is not None and code < 0:
        name = signal.Signals(-code).name
        how = f"died of {name}" + (f"; {FLAGS_HINT}" if name in ("SIGILL", "SIGSEGV") else "")
    else:
        how = f"exited with status {code}"
    return f"llama-server {how}" + (f" (its log ends: {tail[0][:160]})" if tail else "")


@contextmanager
def llama_server(gguf: Path, window: int, slots: int, threads: int):
    """A llama-server on `gguf` with `slots` parallel sequences of `window` rows each; yields its base URL.
    Raises PeerDown when it ends before answering /health, or does not answer in START_S."""
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="tfq-llama-server-") as tmp:
        log = Path(tmp) / "server.log"
        args = [str(binary()), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-c", str(window * slots),
                "-np", str(slots), "-t", str(threads), "-tb", str(threads), "--no-webui"]
        with open(log, "wb") as out:
            proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            _wait_ready(proc, port, log)
            yield f"http://127.0.0.1:{port}", lambda: None if proc.poll() is None else _why(proc.returncode, log)
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def _wait_ready(proc: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise PeerDown(_why(proc.returncode, log))
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:  # not listening yet, or 503 while it loads
            pass
        try:
            proc.wait(timeout=0.2)  # at once if it ends; else a fifth of a second before the next look
        except subprocess.TimeoutExpired:
            pass
    raise PeerDown(f"llama-server did not answer /health within {START_S:.0f} s; see whether the GGUF loads with "
                   f"`llama-server -m FILE` by hand")
