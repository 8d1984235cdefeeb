"""The llama.cpp peer's child process: `python -m tfq.bench.llama_child`, one JSON object a line each way.

A crash of llama.cpp (SIGILL on a CPU its build does not suit, a segfault) ends this process, never tfq's;
and its resident memory is llama.cpp's own, measured here (torch is never imported). tfq's end is
tfq.bench.child_peer.ChildPeer.

On start it says {"version": V} (llama-cpp-python's), or {"error": LINE} when llama-cpp-python is missing, and
exits. Then, a request a line:

    {"op": "load", "path": P, "threads": N, "name": NAME} -> {"ok": true, "rss_peak_is_per_run": BOOL}
    {"op": "prepare", "lanes": N, "rows": R}             -> {"ok": true}
    {"op": "run", "prompts": [[id, ...]], "tokens": N, "round": R} -> {"run": {Run's fields}}
    {"op": "close"}, or the end of stdin                 -> exits 0

A request that fails is answered {"error": LINE}. A run's peak resident memory is this process's VmHWM, reset
before each run through /proc/self/clear_refs (tfq.bench.memory.MemoryProbe); where that cannot be reset it
is the process's lifetime peak, and the load reply's rss_peak_is_per_run says so.
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

from tfq.bench.llama_peer import LlamaPeer, require_llama
from tfq.bench.memory import MemoryProbe
from tfq.errors import TfqError


def main() -> None:
    # A crash must not write a core of a model's size.
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # The answers keep stdout's pipe to themselves; anything llama.cpp prints to fd 1 goes to stderr instead.
    answers = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        version = require_llama()
    except TfqError as e:
        _say(answers, {"error": str(e)})
        return
    _say(answers, {"version": version})
    child = Child()
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "close":
            break
        try:
            _say(answers, child.answer(request))
        except TfqError as e:
            _say(answers, {"error": str(e)})
        except Exception as e:  # noqa: BLE001 - tfq needs the line, not this process's traceback
            _say(answers, {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"})
    if child.peer is not None:
        child.peer.close()


@dataclass
class Child:
    """llama.cpp on one file, once loaded, and the probe of this process's memory."""

    probe: MemoryProbe = field(default_factory=MemoryProbe)
    peer: LlamaPeer | None = None

    def answer(self, request: dict) -> dict:
        op = request["op"]
        if op == "load":
            self.peer = LlamaPeer(Path(request["path"]), request["threads"], request["name"])
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
