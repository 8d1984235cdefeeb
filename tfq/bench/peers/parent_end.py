"""tfq's end of the bench peer's child process (tfq.bench.peers.child_end): the in-process peer's interface
(`prepare`, `run`, `name`, `version`, `close`), each call one JSON line to the child and one back.

A child that dies (a signal, an exit, the end of its output, a line that is not JSON, no answer in time)
raises PeerFailed, whose message is the one line the bench prints before it carries on without the peer.
An {"error": ...} answer to start or load is bad input (llama-cpp-python or transformers missing, a file the
peer does not know): a TfqError, one line, as it was when the peers ran in tfq's process. A load the child marks
"refused" (ik_llama.cpp on a model its build does not know) is a PeerFailed instead: tfq's rows stand without it."""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import tfq
from tfq.bench.memory import MemoryProbe
from tfq.bench.record import Run
from tfq.errors import TfqError

CHILD = [sys.executable, "-m", "tfq.bench.peers.child_end"]  # the child's command, its engine appended (tests put a
# fake child here)
START_TIMEOUT_S = 120.0  # importing llama-cpp-python, or transformers
LOAD_TIMEOUT_S = 1800.0  # mapping a 16 GB file and repacking its Q4_K tensors, on a machine short of memory
EXIT_TIMEOUT_S = 30.0  # from the end of the child's output, or a close, to its exit
# llama.cpp's native build dies with an illegal instruction on some machines (x86-64 with AVX-512 and AMX in a
# VM); one that names the instruction sets runs (benchmarks/ggml_flags.sh names them, AMX off)
FLAGS_SCRIPT = Path(tfq.__file__).resolve().parents[1] / "benchmarks" / "ggml_flags.sh"
REBUILD = ('reinstall llama-cpp-python built for this CPU without -march=native: CMAKE_ARGS="$(bash '
           f'{FLAGS_SCRIPT})" pip install --force-reinstall --no-cache-dir llama-cpp-python')
IK_REBUILD = "rebuild ik_llama.cpp for this CPU with: nice -n 10 bash benchmarks/build_ik_llama.sh"
STDERR_TAIL = 64 * 1024  # bytes of the child's stderr kept: drained always, so llama.cpp's noise never blocks it


class PeerFailed(Exception):
    """The peer's process died or broke its protocol; the message is one line saying what happened."""


class ChildPeer:
    """The peer (llama.cpp or HF transformers, by `name`) in a process of its own. A run's memory is the child's (its
    own probe); the `probe` passed to `run` is tfq's and is not used."""

    def __init__(self, name: str, engine: str):
        self.name, self.engine = name, engine  # the peer as the bench names it; the child's engine
        self.version: str | None = None
        self.rss_peak_is_per_run: bool | None = None  # the child's: VmHWM reset a run, or its lifetime peak
        self.proc: subprocess.Popen | None = None
        self.lines: queue.Queue = queue.Queue()  # the child's stdout lines; None at its end
        self.stderr = bytearray()
        self.doing = "while starting"
        self.mend = ""  # how to mend what ended it, when that is known
        self.drainer: threading.Thread | None = None

    def start(self) -> None:
        """Start the child and take its first line: its engine's version, or why it cannot run."""
        root = str(Path(tfq.__file__).resolve().parent.parent)  # the child imports this tfq, installed or not
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        try:
            # its own session: a Ctrl-C reaches tfq, which closes the child, not both at once
            self.proc = subprocess.Popen([*CHILD, self.engine], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, env=env, start_new_session=True)
        except OSError as e:
            raise self._failed(f"could not start ({e})") from None
        threading.Thread(target=self._read_lines, args=(self.proc.stdout,), daemon=True).start()
        self.drainer = threading.Thread(target=self._drain_stderr, args=(self.proc.stderr,), daemon=True)
        self.drainer.start()
        reply = self._ask(None, START_TIMEOUT_S)
        self._refuse(reply)
        self.version = str(self._expect(reply, "version"))

    def load(self, path: Path, threads: int) -> None:
        self.doing = "while loading"
        reply = self._ask({"op": "load", "path": str(path), "threads": threads, "name": self.name}, LOAD_TIMEOUT_S)
        if reply.get("refused"):
            raise self._failed(f"refused the model ({reply.get('error')})")
        self._refuse(reply)
        self._expect(reply, "ok")
        self.rss_peak_is_per_run = bool(reply.get("rss_peak_is_per_run"))

    def prepare(self, lanes: int, rows: int) -> None:
        self.doing = f"while making its context for lanes {lanes}"
        self._expect(self._ask({"op": "prepare", "lanes": lanes, "rows": rows}, LOAD_TIMEOUT_S), "ok")

    def run(self, prompts: list[list[int]], tokens: int, round_: int, probe: MemoryProbe) -> Run:
        self.doing = f"during lanes {len(prompts)}, {'the warm-up' if round_ < 0 else f'round {round_ + 1}'}"
        fields = self._expect(self._ask({"op": "run", "prompts": prompts, "tokens": tokens, "round": round_}, None),
                              "run")
        try:
            return Run(**fields)
        except TypeError:
            raise self._failed(f"answered a run without a run's fields ({str(fields)[:100]})") from None

    def close(self) -> None:
        """Ask the child to exit; kill it if it does not."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for say in (lambda: proc.stdin.write(b'{"op": "close"}\n'), proc.stdin.close):
            try:
                say()
            except OSError:
                pass  # gone already
        try:
            proc.wait(EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def __del__(self):
        self.close()

    # ------------------------------------------------------------------------------------- the pipes

    def _read_lines(self, stdout) -> None:
        with stdout:
            for line in stdout:
                self.lines.put(line)
        self.lines.put(None)

    def _drain_stderr(self, stderr) -> None:
        with stderr:
            while chunk := stderr.read1(65536):
                self.stderr += chunk
                del self.stderr[:-STDERR_TAIL]

    def _ask(self, request: dict | None, timeout: float | None) -> dict:
        """Send `request` (None: only read) and take the child's answer."""
        if self.proc is None:
            raise self._failed("was closed")
        if request is not None:
            try:
                self.proc.stdin.write(json.dumps(request).encode() + b"\n")
                self.proc.stdin.flush()
            except OSError:
                pass  # the child is gone: the end of its output says how
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise self._failed(f"did not answer within {timeout:g} s") from None
        if line is None:
            raise self._failed(self._death())
        try:
            reply = json.loads(line)
        except ValueError:
            reply = None
        if not isinstance(reply, dict):
            text = line[:100].decode(errors="replace").strip()
            raise self._failed(f"answered with a line that is not a JSON object ({text!r})")
        return reply

    def _death(self) -> str:
        """How the child ended, once its output has."""
        try:
            code = self.proc.wait(EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return "closed its output without exiting"
        if code < 0:
            if -code == signal.SIGILL:  # a build for another CPU: say how to build one for this
                self.mend = f"; {IK_REBUILD if self.engine == 'ik_llama.cpp' else REBUILD}"
            try:
                return f"died with {signal.Signals(-code).name} ({(signal.strsignal(-code) or '?').lower()})"
            except ValueError:
                return f"died with signal {-code}"
        return f"exited with code {code}" if code else "exited"

    def _expect(self, reply: dict, key: str):
        if "error" in reply:
            raise self._failed(f"failed: {reply['error']}")
        if key not in reply:
            raise self._failed(f"answered {str(reply)[:100]} where {key!r} was due")
        return reply[key]

    def _refuse(self, reply: dict) -> None:
        """An error at start or load is bad input, one line: the child is closed and the line raised."""
        if "error" in reply:
            self.close()
            raise TfqError(str(reply["error"]))

    def _failed(self, what: str) -> PeerFailed:
        """The one line for a failure; the child is ended first."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        self.close()
        if self.drainer is not None:
            self.drainer.join(EXIT_TIMEOUT_S)  # the child has exited: its stderr's end is near
        last = next((ln.strip() for ln in reversed(self.stderr.decode(errors="replace").splitlines()) if ln.strip()),
                    "")
        said = f" (its stderr ended: {last[:200]!r})" if last else ""
        return PeerFailed(f"the peer ({self.name}) {what} {self.doing}{said}: tfq's rows stand without it{self.mend}")
