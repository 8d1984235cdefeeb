"""The memory plan: a YAML file, then TFQ_* environment overrides, then --set overrides; its layout in bytes.

By job: words (one-line errors, sizes, "set by"), fields (what each key accepts), schema (the keys, the
TFQ_* variables, Plan and KVPlan, derived plans), load (file, environment, --set), layout (the bytes the
engine allocates, the device), lines (plan lines and JSON), streams (lanes sized to the streams a command
knows). `from tfq.plan import X` reaches all of them.
"""
from tfq.plan.fields import (
    ATTENTION,
    DTYPE_BYTES,
    NGRAM_MAX,
    PAGED,
    parse_bytes,
    parse_draft,
)
from tfq.plan.layout import (
    AUTO_BUDGET_SHARE,
    Layout,
    available_memory,
    compute_layout,
    lane_split,
    pages_for,
    resolve_device,
    row_bytes,
)
from tfq.plan.lines import plan_json, plan_lines
from tfq.plan.load import apply_env, apply_sets, load_plan, parse_plan_text
from tfq.plan.schema import (
    DEFAULT_LANES,
    DEFAULT_PREFILL_CHUNK,
    DEFAULT_WINDOW,
    ENV_FLAGS,
    ENV_VALUES,
    SCHEMA,
    KVPlan,
    Plan,
    derive,
)
from tfq.plan.streams import Streams, size_lanes
from tfq.plan.words import human_bytes, one_line

__all__ = [
    "ATTENTION", "AUTO_BUDGET_SHARE", "DEFAULT_LANES", "DEFAULT_PREFILL_CHUNK", "DEFAULT_WINDOW", "DTYPE_BYTES",
    "ENV_FLAGS", "ENV_VALUES", "KVPlan", "Layout", "NGRAM_MAX", "PAGED", "Plan", "SCHEMA", "apply_env",
    "apply_sets", "available_memory", "compute_layout", "derive", "human_bytes", "lane_split", "load_plan",
    "one_line", "pages_for", "parse_bytes", "parse_draft", "parse_plan_text", "plan_json", "plan_lines",
    "resolve_device", "row_bytes", "Streams", "size_lanes",
]
