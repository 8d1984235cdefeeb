"""How the plan speaks: one printable line, sizes in binary units, and who set a key.

A leaf: the other plan modules all print through these, so they import nothing of the plan.
"""
from __future__ import annotations

from typing import Protocol

from tfq.errors import TfqError


class Sourced(Protocol):
    """Anything that says what set a key (a Plan); a protocol, so this leaf needs no Plan."""

    def source(self, key: str) -> str | None: ...


def one_line(text: str) -> str:
    """`text` as one printable line: user text (a path, an env value) may hold line breaks."""
    return text if text.isprintable() else repr(text)[1:-1]


def fail(message: str) -> TfqError:
    return TfqError(one_line(message))


def human_bytes(n: int) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.{2 if unit in ('GiB', 'TiB') else 1}f} {unit}"
    return f"{n} bytes"


# A source that is no one's override but a command's sizing (tfq/plan/streams.py): said as it is, not "set by".
SIZED = "sized to "


def tag(plan: Sourced, *keys: str) -> str:
    """` (set by TFQ_X, --set)` for the keys an override set, else nothing: a line names who changed it. A key a
    command sized says so: ` (sized to 1 prompt; --set lanes=N to change)`."""
    found = [plan.source(k) for k in keys]
    names = list(dict.fromkeys(s for s in found if s))
    by = [n for n in names if not n.startswith(SIZED)]
    said = ([f"set by {', '.join(by)}"] if by else []) + [n for n in names if n.startswith(SIZED)]
    return f" ({'; '.join(said)})" if said else ""
