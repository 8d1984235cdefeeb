"""The bench peer's child process: `python -m tfq.bench.peers.child_end ENGINE`, one JSON object a line each way.
ENGINE is `llama.cpp` (the default; llama.cpp on a GGUF file, through llama-cpp-python), `ik_llama.cpp` (the fork,
built by benchmarks/build_ik_llama.sh, on the same file) or `hf` (HF transformers' `generate` on a checkpoint folder).

A crash of the peer (SIGILL on a CPU llama.cpp's build does not suit, a segfault, memory) ends this process,
never tfq's; and its resident memory is the peer's own, measured here (for llama.cpp torch is never
imported). tfq's end is tfq.bench.peers.parent_end.ChildPeer.

On start it says {"version": V} (the engine's package's), or {"error": LINE} when that package is missing, and
exits. Then, a request a line:

    {"op": "load", "path": P, "threads": N, "name": NAME} -> {"ok": true, "rss_peak_is_per_run": BOOL}
    {"op": "prepare", "lanes": N, "rows": R}             -> {"ok": true}
    {"op": "run", "prompts": [[id, ...]], "tokens": N, "round": R} -> {"run": {Run's fields}}
    {"op": "close"}, or the end of stdin                 -> exits 0

A request that fails is answered {"error": LINE}; a load the peer refuses (an error marked `refused`, as
tfq.bench.peers.ik_llama.Refused is, for a model its build does not know) is answered {"error": LINE,
"refused": true}, and the bench goes on with tfq's rows alone. A run's peak resident memory is this process's
VmHWM, reset before each run through /proc/self/clear_refs (tfq.bench.memory.MemoryProbe); where that cannot be
reset it is the process's lifetime peak, and the load reply's rss_peak_is_per_run says so.
"""
from __future__ import annotations

import dataclasses
import json
import os
import resource
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from tfq.bench.memory import MemoryProbe
from tfq.errors import TfqError

ENGINES = ("llama.cpp", "ik_llama.cpp", "hf")


def main() -> None:
    # A crash must not write a core of a model's size.
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # The answers keep stdout's pipe to themselves; anything llama.cpp prints to fd 1 goes to stderr instead.
    answers = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    engine = sys.argv[1] if len(sys.argv) > 1 else "llama.cpp"
    try:
        version = _require(engine)
    except TfqError as e:
        _say(answers, {"error": str(e)})
        return
    _say(answers, {"version": version})
    child = Child(engine)
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "close":
            break
        try:
            _say(answers, child.answer(request))
        except TfqError as e:  # a refusal by its mark (tfq.bench.peers.ik_llama.Refused)
            _say(answers, {"error": str(e), "refused": True} if getattr(e, "refused", False) else {"error": str(e)})
        except Exception as e:  # noqa: BLE001 - tfq needs the line, not this process's traceback
            _say(answers, {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"})
    if child.peer is not None:
        child.peer.close()


def _require(engine: str) -> str:
    """The engine's package's version, or one line on how to install it."""
    if engine == "llama.cpp":
        from tfq.bench.peers.llama import require_llama

        return require_llama()
    if engine == "ik_llama.cpp":
        from tfq.bench.peers.ik_llama import require_ik_llama

        return require_ik_llama()
    if engine == "hf":
        try:
            import transformers
        except ImportError:
            raise TfqError('--peer hf needs HF transformers, which is not installed; install it with: '
                           'pip install -e ".[peer]", or pass --peer none') from None
        return transformers.__version__
    raise TfqError(f"no such peer engine: {engine} (one of {', '.join(ENGINES)})")


@dataclass
class Child:
    """The peer on one model, once loaded, and the probe of this process's memory."""

    engine: str
    probe: MemoryProbe = field(default_factory=MemoryProbe)
    peer: object | None = None  # LlamaPeer, IkLlamaPeer or HfPeer: prepare(lanes, rows), run(...), close()

    def answer(self, request: dict) -> dict:
        op = request["op"]
        if op == "load":
            path, threads = Path(request["path"]), request["threads"]
            if self.engine == "hf":
                from tfq.bench.peers.hf import HfPeer

                self.peer = HfPeer(path, threads)
            elif self.engine == "ik_llama.cpp":
                from tfq.bench.peers.ik_llama import IkLlamaPeer

                self.peer = IkLlamaPeer(path, threads, request["name"])
            else:
                from tfq.bench.peers.llama import LlamaPeer

                self.peer = LlamaPeer(path, threads, request["name"])
            return {"ok": True, "rss_peak_is_per_run": self.probe.resettable}
        if self.peer is None:
            raise TfqError(f"{op} before load")
        if op == "prepare":
            self.peer.prepare(request["lanes"], request["rows"])
            return {"ok": True}
        if op == "run":
            run = self.peer.run(request["prompts"], request["tokens"], request["round"], self.probe)
            return {"run": dataclasses.asdict(run)}
        raise TfqError(f"no such request: {op}")


def _say(answers: TextIO, reply: dict) -> None:
    answers.write(json.dumps(reply) + "\n")
    answers.flush()


if __name__ == "__main__":
    main()
