"""The plan's keys: the table of dotted keys and their checks, the TFQ_* variables that set them, and the
Plan itself (frozen: every change makes a new Plan, which remembers who set the key)."""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any, Mapping

from tfq.model.config import ModelConfig
from tfq.plan.fields import (
    ATTENTION,
    DTYPE_ALIASES,
    DTYPE_BYTES,
    PAGED,
    WEIGHTS,
    Bad,
    Check,
    budget,
    choice,
    device,
    draft,
    logits_rows,
    model,
    pages,
    pool,
    positive,
    step_tokens,
    store,
    store_size,
    switch,
)
from tfq.plan.layout import Layout, compute_layout, over_budget
from tfq.plan.words import fail

# The shipped default plan (plans/default.yaml holds the same values with comments; a test keeps them equal).
# lanes 8: one fp32 decode step costs about the same at 8 rows as at 4 (measured: docs/contract.md), and the default
# model's cache for 8 x 4096 rows is 768 MiB, so weights (2.35 GiB) + cache fit a 24 GiB machine many times.
DEFAULT_WINDOW = 4096
DEFAULT_LANES = 8
DEFAULT_PREFILL_CHUNK = 512

# Every key a plan file or --set may name, dotted, with its check (which also normalizes).
SCHEMA: dict[str, Check] = {
    "model": model,
    "weights": choice("weights", WEIGHTS),
    "window": positive("window"),
    "lanes": positive("lanes"),
    "prefill_chunk": positive("prefill_chunk"),
    "logits_rows": logits_rows,
    "step_tokens": step_tokens,
    "kv.dtype": choice("kv.dtype", tuple(DTYPE_BYTES), DTYPE_ALIASES),
    "kv.pages": pages,
    "kv.paged": choice("kv.paged", PAGED),
    "kv.pool": pool,
    "kv.prefix_cache": switch("kv.prefix_cache"),
    "kv.prefix_store": store,
    "kv.prefix_store_size": store_size,
    "attention": choice("attention", ATTENTION),
    "budget": budget,
    "draft": draft,
    "device": device,
    "tp": positive("tp"),
}

# Environment variables that set one key from their text.
ENV_VALUES = {
    "TFQ_MODEL": "model", "TFQ_WEIGHTS": "weights", "TFQ_WINDOW": "window", "TFQ_LANES": "lanes",
    "TFQ_PREFILL_CHUNK": "prefill_chunk", "TFQ_LOGITS_ROWS": "logits_rows", "TFQ_STEP_TOKENS": "step_tokens",
    "TFQ_KV_DTYPE": "kv.dtype", "TFQ_KV_PAGES": "kv.pages", "TFQ_KV_POOL": "kv.pool",
    "TFQ_KV_PREFIX_CACHE": "kv.prefix_cache", "TFQ_KV_PREFIX_STORE": "kv.prefix_store",
    "TFQ_BUDGET": "budget", "TFQ_DRAFT": "draft", "TFQ_DEVICE": "device",
    "TFQ_TP": "tp",
}
# Environment switches: 1 sets the key to the value, 0 or unset leaves the plan alone.
ENV_FLAGS = {
    "TFQ_KV_PAGES_ALL": ("kv.paged", "all", "put every stream on pages"),
    "TFQ_FORCE_PARTIAL": ("attention", "partial", "use the partial attention arithmetic"),
}


def checked(key: str, value: Any) -> Any:
    """`value` as key `key` holds it; a TfqError (the reason alone) when the key's check refuses it."""
    try:
        return SCHEMA[key](value)
    except Bad as e:
        raise fail(str(e)) from None


@dataclass(frozen=True)
class KVPlan:
    dtype: str = "fp32"
    pages: int = 0  # page rows; 0: no pages, every lane contiguous
    paged: str = "more"  # more: streams beyond the first take pages; all: every stream does
    pool: int | str = "auto"
    prefix_cache: str = "off"  # on: full pages are found again by their tokens (tfq/engine/prefix.py)
    prefix_store: str = "off"  # a folder: the prefix cache's pages kept on disk too (tfq/engine/prefix_store.py)
    prefix_store_size: int = 4 * 2**30  # the most the folder holds; least recently used pages go first

    def __post_init__(self) -> None:
        for name in ("dtype", "pages", "paged", "pool", "prefix_cache", "prefix_store", "prefix_store_size"):
            object.__setattr__(self, name, checked(f"kv.{name}", getattr(self, name)))


@dataclass(frozen=True)
class Plan:
    model: str = "default"
    weights: str = "auto"  # auto: a GGUF's blocks (gguf) or an MLX checkpoint's groups (mlx) where tfq's CPU
    # kernels run, else fp32
    window: int = DEFAULT_WINDOW
    lanes: int = DEFAULT_LANES
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    logits_rows: int | str = "auto"  # logits rows one forward may hold; auto: tfq.plan.layout.auto_logits_rows
    step_tokens: int | str = "auto"  # rows a forward holds at most while a stream decodes; auto: layout.step_tokens
    kv: KVPlan = field(default_factory=KVPlan)
    attention: str = "rows"
    budget: int | str = "auto"
    draft: str = "none"
    device: str = "auto"  # auto: a CUDA GPU when torch sees one (Triton kernels), else the CPU (torch kernels)
    tp: int = 1  # ranks the model is split over (tfq/parallel), each a process tfq starts
    sources: tuple[tuple[str, str], ...] = ()  # (dotted key, what set it: "TFQ_X", "--set", "--model")
    # dotted keys the plan file wrote: a choice a command's sizing keeps (tfq/plan/streams.py); not part of equality,
    # so plans/default.yaml equals Plan()
    named: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        for name in ("model", "weights", "window", "lanes", "prefill_chunk", "logits_rows", "step_tokens", "attention",
                     "budget", "draft", "device", "tp"):
            object.__setattr__(self, name, checked(name, getattr(self, name)))
        if not isinstance(self.kv, KVPlan):
            raise fail(f"kv must be a KVPlan, not {self.kv!r}")

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
        return override(self, key, value, source, label)

    def layout(self, config: ModelConfig) -> Layout:
        """The bytes this plan takes for `config`; a TfqError when it does not suit the model or the budget."""
        lay = compute_layout(self, config)
        if not lay.fits:
            raise fail(over_budget(self, lay))
        return lay


def override(plan: Plan, key: str, value: Any, source: str, label: str) -> Plan:
    """`plan` with `key` set by `source`; errors start with `label` (`TFQ_X=...`, `--set k=v`)."""
    if key not in SCHEMA:
        raise fail(f"{label}: {unknown_key(key)}")
    try:
        value = SCHEMA[key](value)
    except Bad as e:
        raise fail(f"{label}: {e}") from None
    if key.startswith("kv."):
        new = plan.replace(kv=dataclasses.replace(plan.kv, **{key[3:]: value}))
    else:
        new = plan.replace(**{key: value})
    sources = tuple((k, s) for k, s in plan.sources if k != key) + ((key, source),)
    return new.replace(sources=sources)


def derive(base: Plan, changes: Mapping[str, Any], source: str) -> Plan:
    """`base` with each changed key set and tagged `source` (e.g. "arm paged"); keys already at their value
    stay as they are, so a plan line says "set by" only where the derived plan differs from its base."""
    plan = base
    for key, value in changes.items():
        if plan.get(key) != value:
            plan = plan.set(key, value, source)
    return plan


def unknown_key(key: str) -> str:
    names = list(SCHEMA) + ["kv"]
    near = difflib.get_close_matches(key, names, n=1, cutoff=0.5)
    if not near:  # a kv key written at the top level, e.g. `pages`
        near = [k for k in SCHEMA if k.split(".")[-1] == key]
    hint = f"did you mean {near[0]}?" if near else f"valid keys: {', '.join(SCHEMA)}"
    return f"unknown key {key!r}; {hint}"
