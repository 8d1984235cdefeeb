"""The memory plan: a YAML file, then TFQ_* environment overrides, then --set overrides; its layout in bytes.

The layout is what the engine allocates: per layer one K and one V tensor of shape
[rows_total, num_kv_heads, head_dim] in the cache dtype, rows_total = contiguous_lanes * window +
pool_pages * page_rows. Nothing here reads weights: a model's config is enough.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import yaml

from tfq.errors import TfqError
from tfq.model.config import ModelConfig
from tfq.kernels.contract import KEY_TILE, SPLIT_ROWS

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
_DTYPE_ALIASES = {
    "float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16",
    "fp8_e4m3": "fp8", "fp8e4m3": "fp8", "e4m3": "fp8", "float8_e4m3fn": "fp8",
}
PAGED = ("more", "all")
ATTENTION = ("rows", "partial")
AUTO_BUDGET_SHARE = 0.8  # budget: auto takes this share of the memory available now
NGRAM_MAX = 16
_MAX_INT = 2**62  # any size past this is a typo, and keeps byte arithmetic printable

# The shipped default plan (plans/default.yaml holds the same values with comments; a test keeps them equal).
# lanes 8: one fp32 decode step costs about the same at 8 rows as at 4 (DESIGN.md section 6), and the default
# model's cache for 8 x 4096 rows is 768 MiB, so weights (2.35 GiB) + cache fit a 24 GiB machine many times.
DEFAULT_WINDOW = 4096
DEFAULT_LANES = 8
DEFAULT_PREFILL_CHUNK = 512


class _Bad(ValueError):
    """A value that a field rejects; the caller adds where the value came from."""


def one_line(text: str) -> str:
    """`text` as one printable line: user text (a path, an env value) may hold line breaks."""
    return text if text.isprintable() else repr(text)[1:-1]


def _fail(message: str) -> TfqError:
    return TfqError(one_line(message))


# ---------------------------------------------------------------------------------------------- fields

def _as_int(value: Any) -> int | None:
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


def _positive(name: str) -> Callable[[Any], int]:
    def check(value: Any) -> int:
        n = _as_int(value)
        if n is None or n <= 0:
            raise _Bad(f"{name} must be a positive integer, not {value!r}")
        if n > _MAX_INT:
            raise _Bad(f"{name} {n} is past any machine; give a realistic size")
        return n
    return check


def _choice(name: str, options: Sequence[str], aliases: Mapping[str, str] | None = None) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        if isinstance(value, str):
            key = value.strip().lower()
            key = (aliases or {}).get(key, key)
            if key in options:
                return key
        raise _Bad(f"{name} must be one of {' | '.join(options)}, not {value!r}")
    return check


def _model(value: Any) -> str:
    if isinstance(value, str) and value.strip():
        return value.strip()
    raise _Bad(f"model must be 'default', an HF checkpoint folder or a .gguf file (a path as text), not {value!r}")


_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def _device(value: Any) -> str:
    text = value.strip().lower() if isinstance(value, str) else None
    if text is None or not _DEVICE.match(text):
        raise _Bad(f"device must be auto, cpu, cuda or cuda:N (a GPU's index), not {value!r}")
    return text


def _pages(value: Any) -> int:
    n = _as_int(value)
    if n is None or n < 0 or n > _MAX_INT:
        raise _Bad(f"kv.pages must be 0 (no pages) or page rows, a positive multiple of {KEY_TILE}, not {value!r}")
    if n % KEY_TILE:
        up = (n // KEY_TILE + 1) * KEY_TILE
        raise _Bad(f"kv.pages {n} is not a multiple of the {KEY_TILE}-row key tile; try {up}")
    return n


def _pool(value: Any) -> int | str:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    n = _as_int(value)
    if n is None or n <= 0 or n > _MAX_INT:
        raise _Bad(f"kv.pool must be auto or a positive number of pages, not {value!r}")
    return n


_UNITS = {
    "": 1, "b": 1,
    "k": 2**10, "kib": 2**10, "kb": 10**3,
    "m": 2**20, "mib": 2**20, "mb": 10**6,
    "g": 2**30, "gib": 2**30, "gb": 10**9,
    "t": 2**40, "tib": 2**40, "tb": 10**12,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(value: Any) -> int:
    """`12GiB`, `500MB`, `1.5G` (bare K/M/G/T are binary), or a plain number of bytes."""
    if isinstance(value, bool):
        raise _Bad(f"budget must be auto or a size such as 12GiB, 500MB or 1.5G, not {value!r}")
    if isinstance(value, (int, float)):
        number, unit = value, 1
    else:
        m = _SIZE.match(value) if isinstance(value, str) else None
        if not m or m.group(2).lower() not in _UNITS:
            raise _Bad(f"budget must be auto or a size such as 12GiB, 500MB or 1.5G, not {value!r}")
        digits, unit = m.group(1), _UNITS[m.group(2).lower()]
        number = int(digits) if digits.isdigit() else float(digits)
    if not math.isfinite(number) or number * unit < 1:
        raise _Bad(f"budget must be a positive size such as 12GiB, not {value!r}")
    if number * unit > _MAX_INT:
        raise _Bad(f"budget {value!r} is past any machine; give a realistic size such as 12GiB")
    return int(number * unit)


def _budget(value: Any) -> int | str:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    return parse_bytes(value)


def parse_draft(value: str) -> tuple[str, int | None]:
    """('none', None) | ('ngram', K or None) | ('checkpoint', None) for a normalized draft value."""
    if value == "none":
        return "none", None
    if value == "ngram":
        return "ngram", None
    if value.startswith("ngram:"):
        return "ngram", int(value[6:])
    return "checkpoint", None


def _draft(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _Bad(f"draft must be none, ngram, ngram:K (K 1..{NGRAM_MAX}) or a draft checkpoint path, not {value!r}")
    text = value.strip()
    low = text.lower()
    if low in ("none", "ngram"):
        return low
    if low.startswith("ngram:"):
        k = _as_int(low[6:])
        if k is None or not 1 <= k <= NGRAM_MAX:
            raise _Bad(f"draft {value!r}: ngram:K takes K from 1 to {NGRAM_MAX}, e.g. ngram:4")
        return f"ngram:{k}"
    return text


def _flag(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise _Bad(f"must be 1 (on) or 0 (off), not {value!r}")


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}

# Every key a plan file or --set may name, dotted, with its check (which also normalizes).
SCHEMA: dict[str, Callable[[Any], Any]] = {
    "model": _model,
    "window": _positive("window"),
    "lanes": _positive("lanes"),
    "prefill_chunk": _positive("prefill_chunk"),
    "kv.dtype": _choice("kv.dtype", tuple(DTYPE_BYTES), _DTYPE_ALIASES),
    "kv.pages": _pages,
    "kv.paged": _choice("kv.paged", PAGED),
    "kv.pool": _pool,
    "attention": _choice("attention", ATTENTION),
    "budget": _budget,
    "draft": _draft,
    "device": _device,
}

# Environment variables that set one key from their text.
ENV_VALUES = {
    "TFQ_MODEL": "model", "TFQ_WINDOW": "window", "TFQ_LANES": "lanes", "TFQ_PREFILL_CHUNK": "prefill_chunk",
    "TFQ_KV_DTYPE": "kv.dtype", "TFQ_KV_PAGES": "kv.pages", "TFQ_KV_POOL": "kv.pool",
    "TFQ_BUDGET": "budget", "TFQ_DRAFT": "draft", "TFQ_DEVICE": "device",
}
# Environment switches: 1 sets the key to the value, 0 or unset leaves the plan alone.
ENV_FLAGS = {
    "TFQ_KV_PAGES_ALL": ("kv.paged", "all", "put every stream on pages"),
    "TFQ_FORCE_PARTIAL": ("attention", "partial", "use the partial attention arithmetic"),
    "TFQ_PAGED_PARTIAL": ("paged_partial", True, "run the paged/partial split control"),
}


def _checked(key: str, value: Any) -> Any:
    try:
        return SCHEMA[key](value)
    except _Bad as e:
        raise _fail(str(e)) from None


# ------------------------------------------------------------------------------------------------ plan

@dataclass(frozen=True)
class KVPlan:
    dtype: str = "fp32"
    pages: int = 0  # page rows; 0: no pages, every lane contiguous
    paged: str = "more"  # more: streams beyond the first take pages; all: every stream does
    pool: int | str = "auto"

    def __post_init__(self) -> None:
        for name in ("dtype", "pages", "paged", "pool"):
            object.__setattr__(self, name, _checked(f"kv.{name}", getattr(self, name)))


@dataclass(frozen=True)
class Plan:
    model: str = "default"
    window: int = DEFAULT_WINDOW
    lanes: int = DEFAULT_LANES
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    kv: KVPlan = field(default_factory=KVPlan)
    attention: str = "rows"
    budget: int | str = "auto"
    draft: str = "none"
    device: str = "auto"  # auto: a CUDA GPU when torch sees one (Triton kernels), else the CPU (torch kernels)
    paged_partial: bool = False  # TFQ_PAGED_PARTIAL=1: the check's control, never a real setting
    sources: tuple[tuple[str, str], ...] = ()  # (dotted key, what set it: "TFQ_X", "--set", "--model")

    def __post_init__(self) -> None:
        for name in ("model", "window", "lanes", "prefill_chunk", "attention", "budget", "draft", "device"):
            object.__setattr__(self, name, _checked(name, getattr(self, name)))
        if not isinstance(self.kv, KVPlan):
            raise _fail(f"kv must be a KVPlan, not {self.kv!r}")
        try:
            object.__setattr__(self, "paged_partial", _flag(self.paged_partial))
        except _Bad as e:
            raise _fail(f"paged_partial {e}") from None

    def replace(self, **changes: Any) -> "Plan":
        return dataclasses.replace(self, **changes)

    def get(self, key: str) -> Any:
        """The value of a dotted key (`kv.pages`)."""
        return getattr(self.kv, key[3:]) if key.startswith("kv.") else getattr(self, key)

    def source(self, key: str) -> str | None:
        """What overrode `key` (e.g. "TFQ_KV_PAGES"), or None when the plan file or the default set it."""
        return dict(self.sources).get(key)

    def set(self, key: str, value: Any, source: str = "--set") -> "Plan":
        """This plan with one dotted key set from `value` (text or YAML value), remembering who set it."""
        label = f"{source}={value}" if source.startswith("TFQ_") else f"{source} {key}={value}"
        return _override(self, key, value, source, label)

    def layout(self, config: ModelConfig) -> "Layout":
        """The bytes this plan takes for `config`; a TfqError when it does not suit the model or the budget."""
        lay = compute_layout(self, config)
        if not lay.fits:
            raise _fail(_over_budget(self, config, lay))
        return lay


def _override(plan: Plan, key: str, value: Any, source: str, label: str) -> Plan:
    if key == "paged_partial":
        try:
            new = plan.replace(paged_partial=_flag(value))
        except _Bad as e:
            raise _fail(f"{label}: paged_partial {e}") from None
    else:
        if key not in SCHEMA:
            raise _fail(f"{label}: {_unknown_key(key)}")
        try:
            checked = SCHEMA[key](value)
        except _Bad as e:
            raise _fail(f"{label}: {e}") from None
        if key.startswith("kv."):
            new = plan.replace(kv=dataclasses.replace(plan.kv, **{key[3:]: checked}))
        else:
            new = plan.replace(**{key: checked})
    sources = tuple((k, s) for k, s in plan.sources if k != key) + ((key, source),)
    return new.replace(sources=sources)


def _unknown_key(key: str) -> str:
    names = list(SCHEMA) + ["kv"]
    near = difflib.get_close_matches(key, names, n=1, cutoff=0.5)
    if not near:  # a kv key written at the top level, e.g. `pages`
        near = [k for k in SCHEMA if k.split(".")[-1] == key]
    hint = f"did you mean {near[0]}?" if near else f"valid keys: {', '.join(SCHEMA)}"
    return f"unknown key {key!r}; {hint}"


# ----------------------------------------------------------------------------------------------- loading

def _flatten(doc: Any, where: str) -> dict[str, Any]:
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise _fail(f"{where}: a plan is a YAML mapping of keys (window: 4096, lanes: 8, ...), not {type(doc).__name__}")
    flat: dict[str, Any] = {}
    for key, value in doc.items():
        if key == "kv":
            if value is None:
                continue
            if not isinstance(value, dict):
                raise _fail(f"{where}: kv must be a mapping (dtype, pages, paged, pool), not {value!r}")
            for sub, subvalue in value.items():
                dotted = f"kv.{sub}"
                if dotted not in SCHEMA:
                    raise _fail(f"{where}: {_unknown_key(dotted)}")
                flat[dotted] = subvalue
        elif isinstance(key, str) and key in SCHEMA:
            flat[key] = value
        else:
            raise _fail(f"{where}: {_unknown_key(str(key))}")
    return flat


def parse_plan_text(text: str, where: str = "plan") -> Plan:
    """A plan from YAML text alone (no overrides); `where` names it in errors."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise _fail(f"{where}: not valid YAML: {' '.join(str(e).split())}") from None
    except RecursionError:
        raise _fail(f"{where}: not valid YAML: nested too deeply") from None
    kv: dict[str, Any] = {}
    top: dict[str, Any] = {}
    for key, value in _flatten(doc, where).items():
        if value is None:  # `window:` with no value keeps the default
            continue
        try:
            checked = SCHEMA[key](value)
        except _Bad as e:
            raise _fail(f"{where}: {e}") from None
        if key.startswith("kv."):
            kv[key[3:]] = checked
        else:
            top[key] = checked
    return Plan(**top, kv=KVPlan(**kv))


def load_plan(path: str | Path | None, env: Mapping[str, str] = os.environ, sets: Sequence[str] = ()) -> Plan:
    """The plan file (None: the shipped default), then TFQ_* variables from `env`, then `key=value` sets."""
    if path is None:
        plan = Plan()
    else:
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise _fail(f"plan file {str(path)!r} not found; give a plan YAML (plans/ holds examples)") from None
        except UnicodeDecodeError:
            raise _fail(f"{str(path)!r}: not a text file; a plan is YAML") from None
        except OSError as e:
            raise _fail(f"plan file {str(path)!r}: cannot read it ({e.strerror or e})") from None
        plan = parse_plan_text(text, str(path))
    return apply_sets(apply_env(plan, env), sets)


def apply_env(plan: Plan, env: Mapping[str, str]) -> Plan:
    for var, key in ENV_VALUES.items():
        text = env.get(var)
        if text is not None and text.strip():
            plan = _override(plan, key, text, var, f"{var}={text}")
    for var, (key, value, what) in ENV_FLAGS.items():
        text = env.get(var)
        if text is None:
            continue
        try:
            on = _flag(text)
        except _Bad:
            raise _fail(f"{var}={text}: use {var}=1 to {what}, or 0 (or unset) to leave the plan alone") from None
        if on:
            plan = _override(plan, key, value, var, f"{var}={text}")
    return plan


def apply_sets(plan: Plan, sets: Sequence[str]) -> Plan:
    for item in sets:
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise _fail(f"--set {item}: write --set key=value, e.g. --set kv.pages=256")
        if key == "kv":
            raise _fail(f"--set {item}: kv is a section; set kv.dtype, kv.pages, kv.paged or kv.pool")
        plan = _override(plan, key, value, "--set", f"--set {item}")
    return plan


# ------------------------------------------------------------------------------------------------ layout

@dataclass(frozen=True)
class Layout:
    row_bytes: int  # one cached row of one stream, all layers, K and V
    window: int
    lanes: int
    contiguous_lanes: int
    paged_lanes: int
    page_rows: int  # 0: no pages
    pool_pages: int
    cache_bytes: int
    weights_bytes: int
    budget_bytes: int
    total_bytes: int
    available_bytes: int | None = None  # the memory available when budget is auto
    device: str = "cpu"  # where the engine runs: cpu, or cuda:N

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.budget_bytes

    @property
    def rows_total(self) -> int:
        """Rows of each layer's K (and V) tensor: the contiguous lanes, then the pool's pages."""
        return self.contiguous_lanes * self.window + self.pool_pages * self.page_rows

    @property
    def pages_per_stream(self) -> int:
        """Pages one stream needs to reach the full window."""
        return -(-self.window // self.page_rows) if self.page_rows else 0

    @property
    def pool_full(self) -> int:
        """Pages that hold every paged stream at the full window."""
        return self.paged_lanes * self.pages_per_stream


def resolve_device(plan: Plan) -> str:
    """The plan's device as torch names it: cpu or cuda:N; a TfqError when the plan asks for a GPU not here."""
    import torch

    if plan.device == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    if plan.device == "cpu":
        return "cpu"
    index = int(plan.device.partition(":")[2] or 0)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if index >= count:
        seen = f"sees {count} CUDA GPU{'s' * (count != 1)}" if count else f"sees no CUDA GPU (torch {torch.__version__})"
        raise _fail(f"device {plan.device}{_tag(plan, 'device')}: this machine {seen}; use device: cpu or auto")
    return f"cuda:{index}"


def available_memory(device: str = "cpu") -> int:
    """Bytes of memory available now: on a GPU its free memory; on the CPU MemAvailable from
    /proc/meminfo, else the OS's free pages."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.mem_get_info(torch.device(device))[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        raise _fail("cannot tell how much memory is available; set budget (e.g. budget: 12GiB)") from None


def row_bytes(config: ModelConfig, dtype: str) -> int:
    return config.num_layers * 2 * config.num_kv_heads * config.head_dim * DTYPE_BYTES[dtype]


def compute_layout(plan: Plan, config: ModelConfig) -> Layout:
    """The plan's bytes for `config`, whether or not they fit the budget."""
    if plan.window > config.max_positions:
        raise _fail(
            f"window {plan.window}{_tag(plan, 'window')} is past the model's {config.max_positions} positions; "
            f"use window: {config.max_positions} or less"
        )
    row = row_bytes(config, plan.kv.dtype)
    weights = config.param_count() * 4  # tfq computes in fp32, whatever the checkpoint stores
    device = resolve_device(plan)
    available = None
    if plan.budget == "auto":
        available = available_memory(device)
        budget = int(available * AUTO_BUDGET_SHARE)
    else:
        budget = int(plan.budget)
    pages = plan.kv.pages
    if pages == 0:
        contiguous, paged = plan.lanes, 0
    elif plan.kv.paged == "all":
        contiguous, paged = 0, plan.lanes
    else:
        contiguous, paged = 1, plan.lanes - 1
    pool = 0
    if pages:
        per_stream = -(-plan.window // pages)
        if plan.kv.pool == "auto":
            left = budget - weights - contiguous * plan.window * row
            pool = min(paged * per_stream, max(0, left // (pages * row)))
            if paged and pool < per_stream:
                pool = per_stream  # the least that lets one paged stream reach the window; it will not fit
        else:
            pool = int(plan.kv.pool)
            if paged and pool < per_stream:
                raise _fail(
                    f"kv.pool {pool}{_tag(plan, 'kv.pool')} pages hold {pool * pages} rows, less than one stream's "
                    f"window of {plan.window} rows ({per_stream} pages of {pages}); set kv.pool to at least "
                    f"{per_stream}, or auto, or shorten the window"
                )
    cache = (contiguous * plan.window + pool * pages) * row
    return Layout(
        row_bytes=row, window=plan.window, lanes=plan.lanes, contiguous_lanes=contiguous, paged_lanes=paged,
        page_rows=pages, pool_pages=pool, cache_bytes=cache, weights_bytes=weights, budget_bytes=budget,
        total_bytes=weights + cache, available_bytes=available, device=device,
    )


def _over_budget(plan: Plan, config: ModelConfig, lay: Layout) -> str:
    over = lay.total_bytes - lay.budget_bytes
    budget = f"the budget is {human_bytes(lay.budget_bytes)}{_budget_words(plan, lay)}"
    need_gib = math.ceil(lay.total_bytes / 2**30 * 10) / 10
    if lay.weights_bytes > lay.budget_bytes:
        return (
            f"plan over budget by {human_bytes(over)}: the weights alone take {human_bytes(lay.weights_bytes)} "
            f"(fp32) but {budget}; this model needs a larger budget (budget: {need_gib}GiB at least)"
        )
    smaller = "a smaller cache dtype (kv.dtype: bf16 halves the cache), " if plan.kv.dtype == "fp32" else ""
    cut = "fewer lanes, a shorter window, "
    if lay.paged_lanes and plan.kv.pool == "auto":
        what = f"one paged stream's full window ({lay.pages_per_stream} pages) does not fit beside the weights"
        cut = "a shorter window, "
    else:
        what = f"{lay.lanes} streams x {lay.window} rows"
    return (
        f"plan over budget by {human_bytes(over)}: it needs {human_bytes(lay.total_bytes)} (weights "
        f"{human_bytes(lay.weights_bytes)} + cache {human_bytes(lay.cache_bytes)}, {what}) but {budget}; "
        f"use {cut}{smaller}or a larger budget (budget: {need_gib}GiB)"
    )


# ---------------------------------------------------------------------------------------------- the lines

def human_bytes(n: int) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.{2 if unit in ('GiB', 'TiB') else 1}f} {unit}"
    return f"{n} bytes"


def _tag(plan: Plan, *keys: str) -> str:
    found = [plan.source(k) for k in keys]
    names = list(dict.fromkeys(s for s in found if s))
    return f" (set by {', '.join(names)})" if names else ""


def _budget_words(plan: Plan, lay: Layout) -> str:
    if plan.budget == "auto" and lay.available_bytes is not None:
        share = round(AUTO_BUDGET_SHARE * 100)
        by = plan.source("budget")
        by = f", set by {by}" if by else ""
        where = " on the GPU" if lay.device.startswith("cuda") else ""
        return f" (auto: {share}% of the {human_bytes(lay.available_bytes)} available{where}{by})"
    return _tag(plan, "budget")


def _streams(first: int, last: int) -> str:
    return f"stream {first}" if first == last else f"streams {first}-{last}"


def plan_lines(plan: Plan, config: ModelConfig, layout: Layout) -> list[str]:
    """One fact a line, in words a person reads without the docs."""
    lay, t = layout, lambda *keys: _tag(plan, *keys)
    dtype = plan.kv.dtype
    lines = [
        f"model: {plan.model}{t('model')}: {config.family}, {config.num_layers} layers, {config.num_heads} query "
        f"heads and {config.num_kv_heads} key-value heads, head dim {config.head_dim}",
        f"weights: stored as {config.weights_dtype}, computed in fp32: {config.param_count() / 1e6:.1f}M "
        f"parameters, {human_bytes(lay.weights_bytes)}",
        f"window: {plan.window} rows a stream may hold, prompt and reply together{t('window')}",
        f"lanes: {plan.lanes} stream{'s' * (plan.lanes > 1)} in one forward at most{t('lanes')}",
        f"prefill: prompts go in chunks of {plan.prefill_chunk} rows{t('prefill_chunk')}",
        f"cached row: {human_bytes(lay.row_bytes)} a row in {dtype}{t('kv.dtype')} ({config.num_layers} layers x "
        f"key and value x {config.num_kv_heads} heads x {config.head_dim} dims x {DTYPE_BYTES[dtype]} bytes)",
    ]
    one_window = plan.window * lay.row_bytes
    pages, page_tag = lay.page_rows, t("kv.pages")
    if pages == 0:
        lines.append(f"stream 0: contiguous, {plan.window} rows, {human_bytes(one_window)}")
        if plan.lanes > 1:
            each = f"{plan.window} rows each, {human_bytes((plan.lanes - 1) * one_window)} together"
            if plan.lanes == 2:
                each = f"{plan.window} rows, {human_bytes(one_window)}"
            lines.append(f"{_streams(1, plan.lanes - 1)}: contiguous too, {each}")
        lines.append(f"0 more taking pages: pages are off (kv.pages: 0){page_tag}")
        if plan.kv.pool != "auto":
            lines.append(f"pool: none; kv.pool {plan.kv.pool}{t('kv.pool')} is unused while pages are off")
    else:
        if lay.contiguous_lanes:
            lines.append(f"stream 0: contiguous, {plan.window} rows, {human_bytes(one_window)}{t('kv.paged')}")
        else:
            lines.append(f"stream 0: paged, on {pages}-row pages{page_tag} like every stream{t('kv.paged')}")
        more = plan.lanes - 1
        if lay.paged_lanes == 0:
            lines.append(f"0 more taking pages: lanes is {plan.lanes}{t('lanes')}, so stream 0 runs alone")
        else:
            lines.append(
                f"{more} more taking pages: {pages}-row pages{page_tag}, {human_bytes(pages * lay.row_bytes)} "
                f"a page, {lay.pages_per_stream} pages for a full window"
            )
        lines.append(_pool_line(plan, lay))
    if plan.attention == "rows":
        lines.append(
            f"attention: rows{t('attention')}: one pass over a stream's keys in {KEY_TILE}-row tiles, "
            f"online softmax in fp32"
        )
    else:
        lines.append(
            f"attention: partial{t('attention')}: keys in {SPLIT_ROWS}-row splits of {KEY_TILE}-row tiles, "
            f"merged in order by log-sum-exp in fp32 (exact against itself, other bits than rows)"
        )
    if plan.paged_partial:
        lines.append(
            f"control: on{t('paged_partial')}: forwards holding a paged stream run partial, the others rows "
            f"(the field report's fault, for the check only)"
        )
    lines.append(_device_line(plan, lay))
    kind, k = parse_draft(plan.draft)
    if kind == "none":
        lines.append(f"drafting: none{t('draft')}")
    elif kind == "ngram":
        steps = f", up to {k} tokens a step" if k else ""
        lines.append(f"drafting: n-gram lookup in the stream's own text{steps}{t('draft')}")
    else:
        lines.append(f"drafting: draft checkpoint {plan.draft}{t('draft')}")
    spare = lay.budget_bytes - lay.total_bytes
    verdict = f"fits, {human_bytes(spare)} to spare" if lay.fits else f"does not fit, over by {human_bytes(-spare)}"
    lines.append(
        f"total: {human_bytes(lay.total_bytes)} (weights {human_bytes(lay.weights_bytes)} + cache "
        f"{human_bytes(lay.cache_bytes)}) of a {human_bytes(lay.budget_bytes)} budget{_budget_words(plan, lay)}: "
        f"{verdict}"
    )
    return [one_line(line) for line in lines]


def _device_line(plan: Plan, lay: Layout) -> str:
    auto = ""
    if plan.device == "auto":
        auto = " (auto: a CUDA GPU is here)" if lay.device != "cpu" else " (auto: no CUDA GPU here)"
    if lay.device == "cpu":
        kernels = "torch kernels: oneDNN linear layers, attention as one-row bmm items"
    else:
        import torch

        kernels = f"{torch.cuda.get_device_name(torch.device(lay.device))}, Triton kernels for linear layers, " \
                  f"norms, attention and cache stores"
    return f"device: {lay.device}{auto}{_tag(plan, 'device')}: {kernels}"


def _pool_line(plan: Plan, lay: Layout) -> str:
    size = (
        f"pool: {lay.pool_pages} pages, {lay.pool_pages * lay.page_rows} rows, "
        f"{human_bytes(lay.pool_pages * lay.page_rows * lay.row_bytes)}{_tag(plan, 'kv.pool')}"
    )
    if lay.paged_lanes == 0:
        return f"{size}; no stream takes pages"
    full, streams = lay.pool_full, f"{lay.paged_lanes} paged stream{'s' * (lay.paged_lanes > 1)}"
    if lay.pool_pages >= full:
        how = "auto: " if plan.kv.pool == "auto" else ""
        return f"{size} ({how}enough for {streams} at the full window)"
    how = "auto: what the budget leaves; " if plan.kv.pool == "auto" else ""
    return (
        f"{size} ({how}{streams} at the full window need {full}; when it runs out, "
        f"streams are preempted and recomputed later)"
    )


def plan_json(plan: Plan, config: ModelConfig, layout: Layout) -> dict:
    """The same facts as plan_lines, as JSON-ready data."""
    values = {
        "model": plan.model, "window": plan.window, "lanes": plan.lanes, "prefill_chunk": plan.prefill_chunk,
        "kv": dataclasses.asdict(plan.kv), "attention": plan.attention, "budget": plan.budget,
        "draft": plan.draft, "device": plan.device, "paged_partial": plan.paged_partial,
    }
    model = {
        "family": config.family, "layers": config.num_layers, "query_heads": config.num_heads,
        "kv_heads": config.num_kv_heads, "head_dim": config.head_dim, "max_positions": config.max_positions,
        "weights_dtype": config.weights_dtype, "parameters": config.param_count(),
    }
    lay = dataclasses.asdict(layout)
    lay.update(fits=layout.fits, rows_total=layout.rows_total, pages_per_stream=layout.pages_per_stream,
               key_tile=KEY_TILE, split_rows=SPLIT_ROWS)
    return {
        "plan": values, "sources": dict(plan.sources), "model": model, "layout": lay,
        "lines": plan_lines(plan, config, layout),
    }
