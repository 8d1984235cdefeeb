"""Resident memory of this process around one run, torch-free: tfq measures itself with it, and so does the
peer's child process (tfq.bench.peers.child_end), so the peer's figure is its own process's."""
from __future__ import annotations

import os
import resource


class MemoryProbe:
    """Resident memory of this process around one run. On Linux, writing 5 to /proc/self/clear_refs resets
    the peak (VmHWM) to the present, so each run's peak is its own; elsewhere the peak is the process's
    lifetime peak (ru_maxrss) and a run's own growth is unknown (None)."""

    def __init__(self):
        self.resettable = self._reset()
        self.before = 0

    @staticmethod
    def _reset() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return _status("VmHWM") is not None
        except OSError:
            return False

    def start(self) -> None:
        if self.resettable:
            self._reset()
        self.before = _status("VmRSS") or 0

    def stop(self) -> tuple[int, int | None]:
        """(peak resident bytes, bytes the run added above the resident memory it started with)."""
        if self.resettable:
            peak = _status("VmHWM") or 0
            return peak, max(0, peak - self.before)
        usage = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return usage * (1 if os.uname().sysname == "Darwin" else 1024), None


def _status(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
