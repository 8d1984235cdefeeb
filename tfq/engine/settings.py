"""What the engine takes from a plan, in one record: the engine, its cache and its scheduler read their settings
from it (tfq.engine.core re-exports it, where the engine's callers find it)."""
from __future__ import annotations

from dataclasses import dataclass

from tfq.plan.layout import lane_split


@dataclass(frozen=True)
class EngineSettings:
    """What the engine takes from a plan (tfq.plan.Plan + its Layout)."""

    window: int
    lanes: int
    prefill_chunk: int = 512
    kv_dtype: str = "fp32"
    page_rows: int = 0
    paged_all: bool = False
    pool_pages: int = 0
    partial: bool = False
    prefix_cache: bool = False  # full pages found again by their tokens (tfq/engine/prefix.py)
    prefix_store: str = ""  # a folder: the prefix cache's full pages kept on disk too (tfq/engine/prefix_store.py)
    prefix_store_bytes: int = 0  # the most that folder holds
    # what names the weights for the store's root (the model's sha256 and weights kind): Engine.from_plan sets it
    model_identity: str = ""
    # logits rows one forward may hold; 0: auto (tfq.plan.layout.auto_logits_rows: the engine gives its scheduler
    # the number; a scheduler's own 0 is no bound)
    logits_rows: int = 0
    step_tokens: int = 0  # rows a forward holds at most while a stream decodes; 0: no bound
    step_steps: int = 0  # or, once the cost of steps is learned, decode steps of every running stream; 0: rows

    @property
    def contiguous_lanes(self) -> int:
        return lane_split(self.lanes, self.page_rows, "all" if self.paged_all else "more")[0]

    @classmethod
    def from_plan(cls, plan, layout) -> "EngineSettings":
        """The plan's arithmetic and the layout's rows and pages (computed once, in tfq.plan.layout)."""
        return cls(window=layout.window, lanes=layout.lanes, prefill_chunk=plan.prefill_chunk, kv_dtype=plan.kv.dtype,
                   page_rows=layout.page_rows, paged_all=plan.kv.paged == "all", pool_pages=layout.pool_pages,
                   partial=plan.attention == "partial", prefix_cache=plan.kv.prefix_cache == "on",
                   prefix_store="" if plan.kv.prefix_store == "off" else plan.kv.prefix_store,
                   prefix_store_bytes=plan.kv.prefix_store_size,
                   logits_rows=layout.logits_rows, step_tokens=layout.step_tokens,
                   step_steps=layout.step_steps)
