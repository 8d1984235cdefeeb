"""The plan every command runs under: the file, then TFQ_* variables, then --set, then --model, then lanes sized to
the streams the command knows (tfq/plan/streams.py); checked against the model's config and printed as plan lines."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from rich.console import Console

from tfq.model.config import ModelConfig
from tfq.plan import Layout, Plan, Streams, load_plan, plan_lines, size_lanes


def resolve_plan(
    path: str | Path | None,
    model: str | None,
    sets: Sequence[str],
    quiet: bool,
    console: Console | None,
    streams: Streams | None = None,
) -> tuple[Plan, ModelConfig, Layout]:
    """Load the plan (file, TFQ_* variables, --set, then --model), size its lanes to `streams` (None: not known, as
    a server's; the plan's lanes stay), check it against the model, print its lines."""
    from tfq.model.source import (
        model_config,  # reads configs only; imported late to keep start-up light
    )

    plan = load_plan(path, os.environ, sets or ())
    if model is not None:
        plan = plan.set("model", model, "--model")
    from tfq.model.hub import is_hub_name, local_model

    if is_hub_name(plan.model):  # ORG/REPO[:QUANT]: its files fetched (or found in the cache) once, then a path
        plan = plan.replace(model=local_model(plan.model))
    plan = size_lanes(plan, streams)
    config = model_config(plan.model)
    layout = plan.layout(config)
    if not quiet:
        console = console or Console()
        for line in plan_lines(plan, config, layout):
            console.print(line, markup=False, highlight=False, soft_wrap=True)
    return plan, config, layout
