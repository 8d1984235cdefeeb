"""What each plan key accepts: one check a key, which also normalizes (`BF16` -> `bf16`, `1.5G` -> bytes).

A check raises `Bad` with the reason alone; the caller adds where the value came from (a file, a variable,
--set), so each error is one line that names its source.
"""
from __future__ import annotations

import math
import re
from typing import Any, Callable, Mapping, Sequence

from tfq.kernels.contract import KEY_TILE

# Bytes of one cached value in each cache dtype (the layout's row size multiplies by these).
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
DTYPE_ALIASES = {
    "float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
    "fp8_e4m3": "fp8", "fp8e4m3": "fp8", "e4m3": "fp8", "float8_e4m3fn": "fp8",
}
PAGED = ("more", "all")
ATTENTION = ("rows", "partial")
WEIGHTS = ("auto", "fp32", "gguf", "gguf-q8", "mlx")
NGRAM_MAX = 16
MAX_INT = 2**62  # any size past this is a typo, and keeps byte arithmetic printable

Check = Callable[[Any], Any]


class Bad(ValueError):
    """A value that a field rejects; the caller adds where the value came from."""


def as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            return None
    return None


def positive(name: str) -> Callable[[Any], int]:
    def check(value: Any) -> int:
        n = as_int(value)
        if n is None or n <= 0:
            raise Bad(f"{name} must be a positive integer, not {value!r}")
        if n > MAX_INT:
            raise Bad(f"{name} {n} is past any machine; give a realistic size")
        return n
    return check


def choice(name: str, options: Sequence[str], aliases: Mapping[str, str] | None = None) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        if isinstance(value, str):
            key = value.strip().lower()
            key = (aliases or {}).get(key, key)
            if key in options:
                return key
        raise Bad(f"{name} must be one of {' | '.join(options)}, not {value!r}")
    return check


def switch(name: str) -> Callable[[Any], str]:
    """on | off. YAML reads a bare on/off/yes/no as a boolean, so booleans are taken too."""
    def check(value: Any) -> str:
        if isinstance(value, bool):
            return "on" if value else "off"
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE - {""}:
            return "on" if value.strip().lower() in _TRUE else "off"
        raise Bad(f"{name} must be on or off, not {value!r}")
    return check


def model(value: Any) -> str:
    if isinstance(value, str) and value.strip():
        return value.strip()
    raise Bad(f"model must be 'default', an HF checkpoint folder or a .gguf file (a path as text), not {value!r}")


_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def device(value: Any) -> str:
    text = value.strip().lower() if isinstance(value, str) else None
    if text is None or not _DEVICE.match(text):
        raise Bad(f"device must be auto, cpu, cuda or cuda:N (a GPU's index), not {value!r}")
    return text


def pages(value: Any) -> int:
    n = as_int(value)
    if n is None or n < 0 or n > MAX_INT:
        raise Bad(f"kv.pages must be 0 (no pages) or page rows, a positive multiple of {KEY_TILE}, not {value!r}")
    if n % KEY_TILE:  # a key tile never straddles pages: attention reads pages tile by tile
        up = (n // KEY_TILE + 1) * KEY_TILE
        raise Bad(f"kv.pages {n} is not a multiple of the {KEY_TILE}-row key tile; try {up}")
    return n


def auto_or_positive(name: str, what: str) -> Check:
    def check(value: Any) -> int | str:
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        n = as_int(value)
        if n is None or n <= 0 or n > MAX_INT:
            raise Bad(f"{name} must be auto or a positive number of {what}, not {value!r}")
        return n
    return check


pool = auto_or_positive("kv.pool", "pages")
logits_rows = auto_or_positive("logits_rows", "rows")
step_tokens = auto_or_positive("step_tokens", "rows")


_UNITS = {
    "": 1, "b": 1,
    "k": 2**10, "kib": 2**10, "kb": 10**3,
    "m": 2**20, "mib": 2**20, "mb": 10**6,
    "g": 2**30, "gib": 2**30, "gb": 10**9,
    "t": 2**40, "tib": 2**40, "tb": 10**12,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(value: Any, name: str = "budget", auto: str = "auto or ") -> int:
    """`12GiB`, `500MB`, `1.5G` (bare K/M/G/T are binary), or a plain number of bytes."""
    if isinstance(value, bool):
        raise Bad(f"{name} must be {auto}a size such as 12GiB, 500MB or 1.5G, not {value!r}")
    if isinstance(value, (int, float)):
        number, unit = value, 1
    else:
        m = _SIZE.match(value) if isinstance(value, str) else None
        if not m or m.group(2).lower() not in _UNITS:
            raise Bad(f"{name} must be {auto}a size such as 12GiB, 500MB or 1.5G, not {value!r}")
        digits, unit = m.group(1), _UNITS[m.group(2).lower()]
        number = int(digits) if digits.isdigit() else float(digits)
    if not math.isfinite(number) or number * unit < 1:
        raise Bad(f"{name} must be a positive size such as 12GiB, not {value!r}")
    if number * unit > MAX_INT:
        raise Bad(f"{name} {value!r} is past any machine; give a realistic size such as 12GiB")
    return int(number * unit)


def budget(value: Any) -> int | str:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    return parse_bytes(value)


def store_size(value: Any) -> int:
    return parse_bytes(value, "kv.prefix_store_size", "")


def store(value: Any) -> str:
    """off, or the folder the prefix cache's pages are kept in on disk."""
    if value is False or (isinstance(value, str) and value.strip().lower() in ("off", "none", "")):
        return "off"
    if isinstance(value, str):
        return value.strip()
    raise Bad(f"kv.prefix_store must be off or a folder (a path as text), not {value!r}")


def parse_draft(value: str) -> tuple[str, int | None]:
    """('none', None) | ('ngram', K or None) | ('checkpoint', None) for a normalized draft value."""
    if value == "none":
        return "none", None
    if value == "ngram":
        return "ngram", None
    if value.startswith("ngram:"):
        return "ngram", int(value[6:])
    return "checkpoint", None


def draft(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise Bad(f"draft must be none, ngram, ngram:K (K 1..{NGRAM_MAX}) or a draft checkpoint path, not {value!r}")
    text = value.strip()
    low = text.lower()
    if low in ("none", "ngram"):
        return low
    if low.startswith("ngram:"):
        k = as_int(low[6:])
        if k is None or not 1 <= k <= NGRAM_MAX:
            raise Bad(f"draft {value!r}: ngram:K takes K from 1 to {NGRAM_MAX}, e.g. ngram:4")
        return f"ngram:{k}"
    return text


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def flag(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise Bad(f"must be 1 (on) or 0 (off), not {value!r}")
