"""The plan's layout in bytes, and where it runs: what the engine allocates, computed once.

Per attention layer one K and one V tensor of shape [rows_total, num_kv_heads, head_dim] in the cache dtype:
first `contiguous_lanes` lanes of `window` rows, then the pool, `pool_pages` pages of `page_rows` rows. A
hybrid's DeltaNet layers add a fixed-size state per lane (and, when drafting, a copy from before a verify and
the verify's inputs, to roll rejected guesses back). Nothing here reads weights: a model's config is enough.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Protocol

from tfq.model.config import ModelConfig
from tfq.plan.fields import DTYPE_BYTES
from tfq.plan.words import Sourced, fail, human_bytes, tag

AUTO_BUDGET_SHARE = 0.8  # budget: auto takes this share of the memory available now
SNAPSHOTS_A_LANE = 4  # a hybrid's prefix cache keeps this many DeltaNet states a lane (tfq/engine/cache.py)


def pages_for(rows: int, page_rows: int) -> int:
    """Pages that hold `rows` rows (the last one partly); the page pool counts with it too."""
    return -(-rows // page_rows)


class KVView(Protocol):
    @property
    def dtype(self) -> str: ...
    @property
    def pages(self) -> int: ...
    @property
    def paged(self) -> str: ...
    @property
    def pool(self) -> int | str: ...


class PlanView(Sourced, Protocol):
    """What the layout reads of a plan (tfq.plan.schema.Plan). A protocol, not an import: Plan.layout()
    calls this module, and the package has no import circle (tests/unit/test_layout.py)."""

    @property
    def window(self) -> int: ...
    @property
    def lanes(self) -> int: ...
    @property
    def kv(self) -> KVView: ...
    @property
    def budget(self) -> int | str: ...
    @property
    def device(self) -> str: ...


def lane_split(lanes: int, page_rows: int, paged: str) -> tuple[int, int]:
    """(contiguous lanes, paged lanes): without pages every lane is contiguous; with them stream 0 keeps a
    lane (kv.paged more) or none does (kv.paged all)."""
    if page_rows == 0:
        return lanes, 0
    if paged == "all":
        return 0, lanes
    return 1, lanes - 1


@dataclass(frozen=True)
class Layout:
    row_bytes: int  # one cached row of one stream, all layers, K and V
    window: int
    lanes: int
    contiguous_lanes: int  # lanes 0..contiguous_lanes-1 hold `window` rows each; the others take pages
    paged_lanes: int
    page_rows: int  # 0: no pages
    pool_pages: int
    cache_bytes: int
    weights_bytes: int
    budget_bytes: int
    total_bytes: int
    available_bytes: int | None = None  # the memory available when budget is auto
    device: str = "cpu"  # where the engine runs: cpu, or cuda:N
    state_bytes: int = 0  # a hybrid's DeltaNet states, every lane (in cache_bytes too)
    verify_rows: int = 0  # drafting on a hybrid: each lane keeps its state from before a verify, and the
    # inputs of this many verify rows, to roll rejected guesses back
    logits_rows: int = 0  # logits rows one forward may hold: every lane's drawing rows, and prompt rows scored
    logits_bytes: int = 0  # those rows in fp32 (in total_bytes)
    step_tokens: int = 0  # rows a forward holds at most while a stream decodes
    step_steps: int = 0  # or, once the engine has learned what its steps cost, decode steps of every running stream
    forward_rows: int = 0  # rows of the largest forward: every lane's prompt chunk
    activation_bytes: int = 0  # what those rows hold at once in fp32 (in total_bytes)
    overhead_bytes: int = 0  # fixed: torch, the kernels, the tokenizer (not in total_bytes; the plan states it)

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.budget_bytes

    @property
    def pool_base(self) -> int:
        """The store row where the pool starts: after the contiguous lanes."""
        return self.contiguous_lanes * self.window

    @property
    def rows_total(self) -> int:
        """Rows of each layer's K (and V) tensor: the contiguous lanes, then the pool's pages."""
        return self.pool_base + self.pool_pages * self.page_rows

    @property
    def pages_per_stream(self) -> int:
        """Pages one stream needs to reach the full window."""
        return pages_for(self.window, self.page_rows) if self.page_rows else 0

    @property
    def pool_full(self) -> int:
        """Pages that hold every paged stream at the full window."""
        return self.paged_lanes * self.pages_per_stream


def resolve_device(plan: PlanView) -> str:
    """The plan's device as torch names it: cpu or cuda:N; a TfqError when the plan asks for a GPU not here."""
    import torch

    if plan.device == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    if plan.device == "cpu":
        return "cpu"
    index = int(plan.device.partition(":")[2] or 0)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if index >= count:
        seen = (f"sees {count} CUDA GPU{'s' * (count != 1)}" if count
                else f"sees no CUDA GPU (torch {torch.__version__})")
        raise fail(f"device {plan.device}{tag(plan, 'device')}: this machine {seen}; use device: cpu or auto")
    return f"cuda:{index}"


def available_memory(device: str = "cpu") -> int:
    """Bytes of memory the plan may take: what is available now (on a GPU its free memory; on the CPU
    MemAvailable from /proc/meminfo, else the OS's free pages) and what this process holds already (torch's
    reserved GPU memory; the CPU's anonymous resident pages). So a plan laid out after the model loaded (an arm
    of `tfq together` or `tfq bench`) still has the weights' memory in its budget, as the plan before did."""
    if device.startswith("cuda"):
        import torch

        dev = torch.device(device)
        return torch.cuda.mem_get_info(dev)[0] + torch.cuda.memory_reserved(dev)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 + _held_anon()
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        raise fail("cannot tell how much memory is available; set budget (e.g. budget: 12GiB)") from None


def _held_anon() -> int:
    """This process's anonymous resident bytes (RssAnon in /proc/self/status), 0 where it cannot be read."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def row_bytes(config: ModelConfig, dtype: str) -> int:
    return len(config.attention_layers) * 2 * config.num_kv_heads * config.head_dim * DTYPE_BYTES[dtype]


def verify_rows(draft: str) -> int:
    """Rows a draft verify brings at most: the stream's token and its guesses (0 without drafting)."""
    from tfq.plan.fields import parse_draft

    kind, k = parse_draft(draft)
    return 0 if kind == "none" else 1 + (k or 4)  # tfq.engine.draft's drafters guess 4 tokens unless told


def prefix_snapshots(lanes: int) -> int:
    """DeltaNet states a hybrid's prefix cache keeps at page boundaries, least recently used replaced first."""
    return SNAPSHOTS_A_LANE * lanes


def state_bytes(config: ModelConfig, lanes: int, draft: str, prefix: bool = False) -> tuple[int, int]:
    """(bytes, verify rows): a hybrid's DeltaNet states for `lanes` lanes; drafting, each also keeps a copy
    from before a verify and the verify rows' inputs to the recurrence; with a prefix cache, the states kept at
    page boundaries (tfq.engine.cache.StateCache)."""
    if not config.hybrid:
        return 0, 0
    kept = prefix_snapshots(lanes) * config.state_bytes if prefix else 0
    rows = verify_rows(draft)
    if not rows:
        return lanes * config.state_bytes + kept, 0
    n = config.deltanet
    inputs = 4 * rows * (n.channels + 2 * n.value_heads) * len(config.deltanet_layers)
    return lanes * (2 * config.state_bytes + inputs) + kept, rows


def auto_logits_rows(lanes: int, prefill_chunk: int, drawing_rows: int) -> int:
    """logits_rows: auto: a prompt chunk scored whole, and never fewer than every lane's drawing rows."""
    return max(prefill_chunk, lanes * drawing_rows)


# step_tokens: auto on the CPU. A step that carries prompt rows lasts at most STEP_DECODE_STEPS decode steps of
# every stream running, by the cost of steps the engine learns as it runs (tfq/engine/step_cost.py): a prompt row costs
# more the longer its context, and a decode step more the more streams decode, so no one number of rows keeps
# the time between tokens (tfq bench serve) within a bound. 2, not 3: the learned cost is off by up to a
# quarter either way (95th percentiles, docs/serve.md), and with 2 the measured p99 stays near 3 decode steps.
# Until the cost is learned (the first few steps), STEP_PROMPT_ROWS prompt rows beside every lane's drawing
# rows: on the default model here a prompt row costs 2.5-4 ms and a decode step of 8 lanes 75-85 ms.
STEP_DECODE_STEPS = 2
STEP_PROMPT_ROWS = 32


def step_steps(plan: PlanView, device: str) -> int:
    """Decode steps a step with prompt rows may last (step_tokens: auto on the CPU), else 0: rows bound it."""
    return STEP_DECODE_STEPS if getattr(plan, "step_tokens", "auto") == "auto" and not device.startswith("cuda") \
        else 0


def step_tokens(plan: PlanView, device: str) -> int:
    """Rows a forward holds at most while some stream decodes: every lane's drawing rows first, then prompt
    chunks. auto: on the CPU those rows and STEP_PROMPT_ROWS more (until the time bound, step_steps, takes
    over); on a GPU, where a prompt row costs a decode step's fraction, no bound beyond the lanes' prompt
    chunks. A TfqError when fewer than every lane drawing."""
    drawing = max(1, verify_rows(getattr(plan, "draft", "none")))
    least = plan.lanes * drawing
    chosen = getattr(plan, "step_tokens", "auto")
    if chosen == "auto":
        if device.startswith("cuda"):
            return plan.lanes * max(getattr(plan, "prefill_chunk", 1), drawing)
        return least + STEP_PROMPT_ROWS
    if chosen < least:
        raise fail(f"step_tokens {chosen}{tag(plan, 'step_tokens')} is fewer than the rows every lane decodes at "
                   f"once ({plan.lanes} lanes x {drawing}); set step_tokens to {least} or more, or auto")
    return int(chosen)


def logits_rows(plan: PlanView) -> int:
    """Logits rows one forward may hold; a TfqError when fewer than every lane drawing at once."""
    drawing = max(1, verify_rows(getattr(plan, "draft", "none")))
    least = plan.lanes * drawing
    chosen = getattr(plan, "logits_rows", "auto")
    if chosen == "auto":
        return auto_logits_rows(plan.lanes, getattr(plan, "prefill_chunk", 1), drawing)
    if chosen < least:
        raise fail(f"logits_rows {chosen}{tag(plan, 'logits_rows')} is fewer than the rows every lane draws from at "
                   f"once ({plan.lanes} lanes x {drawing}); set logits_rows to {least} or more, or auto")
    return int(chosen)


def compute_layout(plan: PlanView, config: ModelConfig) -> Layout:
    """The plan's bytes for `config`, whether or not they fit the budget."""
    if plan.window > config.max_positions:
        raise fail(
            f"window {plan.window}{tag(plan, 'window')} is past the model's {config.max_positions} positions; "
            f"use window: {config.max_positions} or less"
        )
    if config.hybrid and getattr(plan.kv, "prefix_cache", "off") == "on" and getattr(plan, "tp", 1) > 1:
        raise fail(f"kv.prefix_cache: on{tag(plan, 'kv.prefix_cache')} with tp {plan.tp}{tag(plan, 'tp')}: a hybrid's "
                   f"prefix cache keeps its DeltaNet states in one process so far; use tp: 1, or kv.prefix_cache: off")
    if getattr(plan.kv, "prefix_store", "off") != "off" and getattr(plan, "tp", 1) > 1:
        raise fail(f"kv.prefix_store{tag(plan, 'kv.prefix_store')} with tp {plan.tp}{tag(plan, 'tp')}: pages read back "
                   f"from disk reach one process's heads so far; use tp: 1, or kv.prefix_store: off")
    if getattr(plan.kv, "prefix_store", "off") != "off" and getattr(plan.kv, "prefix_cache", "off") != "on":
        raise fail(f"kv.prefix_store{tag(plan, 'kv.prefix_store')} keeps the prefix cache's pages on disk, and the "
                   f"prefix cache is off; set kv.prefix_cache: on (with kv.pages), or kv.prefix_store: off")
    tp = getattr(plan, "tp", 1)
    if tp > config.hidden_size:  # each rank a process holding a share of every split (tfq/parallel/shard.py)
        raise fail(f"tp {tp}{tag(plan, 'tp')} is more ranks than the model has hidden columns ({config.hidden_size}) "
                   f"to share among them; set tp to at most {config.hidden_size}")
    from tfq.model.footprint import FIXED_OVERHEAD, activation_row_bytes, weight_bytes

    row = row_bytes(config, plan.kv.dtype)
    device = resolve_device(plan)
    model = getattr(plan, "model", None)  # as `weights` keeps them; a plan without a model: fp32
    weights = config.param_count() * 4 if model is None else weight_bytes(model, plan.weights, config, device)
    forward_rows = plan.lanes * getattr(plan, "prefill_chunk", 1)
    activations = forward_rows * activation_row_bytes(config)
    prefix = getattr(plan.kv, "prefix_cache", "off") == "on" and plan.kv.pages > 0
    state, rows = state_bytes(config, plan.lanes, getattr(plan, "draft", "none"), prefix)
    available = None
    if plan.budget == "auto":
        available = available_memory(device)
        budget = int(available * AUTO_BUDGET_SHARE)
    else:
        budget = int(plan.budget)
    scored = logits_rows(plan)
    logits = scored * config.vocab_size * 4
    pages = plan.kv.pages
    contiguous, paged = lane_split(plan.lanes, pages, plan.kv.paged)
    pool = 0
    if pages:
        per_stream = pages_for(plan.window, pages)
        if plan.kv.pool == "auto":
            left = budget - weights - logits - activations - state - contiguous * plan.window * row
            pool = min(paged * per_stream, max(0, left // (pages * row)))
            if paged and pool < per_stream:
                pool = per_stream  # the least that lets one paged stream reach the window; it will not fit
        else:
            pool = int(plan.kv.pool)
            if paged and pool < per_stream:
                raise fail(
                    f"kv.pool {pool}{tag(plan, 'kv.pool')} pages hold {pool * pages} rows, less than one stream's "
                    f"window of {plan.window} rows ({per_stream} pages of {pages}); set kv.pool to at least "
                    f"{per_stream}, or auto, or shorten the window"
                )
    lay = Layout(
        row_bytes=row, window=plan.window, lanes=plan.lanes, contiguous_lanes=contiguous, paged_lanes=paged,
        page_rows=pages, pool_pages=pool, cache_bytes=0, weights_bytes=weights, budget_bytes=budget,
        total_bytes=0, available_bytes=available, device=device, state_bytes=state, verify_rows=rows,
    )
    cache = lay.rows_total * row + state  # the bytes are the rows the engine allocates, counted in one place
    return dataclasses.replace(lay, cache_bytes=cache, logits_rows=scored, logits_bytes=logits,
                               step_tokens=step_tokens(plan, device), step_steps=step_steps(plan, device),
                               forward_rows=forward_rows, activation_bytes=activations, overhead_bytes=FIXED_OVERHEAD,
                               total_bytes=weights + cache + logits + activations)


def budget_words(plan: PlanView, lay: Layout) -> str:
    """How the budget was set: ` (auto: 80% of the 12.00 GiB available)`, or who set it."""
    if plan.budget == "auto" and lay.available_bytes is not None:
        share = round(AUTO_BUDGET_SHARE * 100)
        by = plan.source("budget")
        by = f", set by {by}" if by else ""
        where = " on the GPU" if lay.device.startswith("cuda") else ""
        return f" (auto: {share}% of the {human_bytes(lay.available_bytes)} available{where}{by})"
    return tag(plan, "budget")


def over_budget(plan: PlanView, lay: Layout) -> str:
    """Why a plan does not fit, and what to cut, in one line."""
    over = lay.total_bytes - lay.budget_bytes
    budget = f"the budget is {human_bytes(lay.budget_bytes)}{budget_words(plan, lay)}"
    need_gib = math.ceil(lay.total_bytes / 2**30 * 10) / 10
    if lay.weights_bytes > lay.budget_bytes:
        return (
            f"plan over budget by {human_bytes(over)}: the weights alone take {human_bytes(lay.weights_bytes)} "
            f"({getattr(plan, 'weights', 'fp32')}) but {budget}; this model needs a larger budget (budget: "
            f"{need_gib}GiB at least)"
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
        f"{human_bytes(lay.weights_bytes)} + cache {human_bytes(lay.cache_bytes)}, {what} + logits "
        f"{human_bytes(lay.logits_bytes)} + activations {human_bytes(lay.activation_bytes)}) but {budget}; "
        f"use {cut}{smaller}or a larger budget (budget: {need_gib}GiB)"
    )
