"""`tfq plan [PLAN.yaml]`: what the plan takes and whether it fits; `resolve_plan` prints the same lines for every command."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional, Sequence

import typer
from rich.console import Console

from tfq.cli.app import app
from tfq.model.config import ModelConfig
from tfq.plan import Layout, Plan, load_plan, plan_json, plan_lines


def resolve_plan(
    path: str | Path | None,
    model: str | None,
    sets: Sequence[str],
    quiet: bool,
    console: Console | None,
) -> tuple[Plan, ModelConfig, Layout]:
    """Load the plan (file, TFQ_* variables, --set, then --model), check it against the model, print its lines."""
    from tfq.model.source import model_config  # reads configs only; imported late to keep start-up light

    plan = load_plan(path, os.environ, sets or ())
    if model is not None:
        plan = plan.set("model", model, "--model")
    config = model_config(plan.model)
    layout = plan.layout(config)
    if not quiet:
        console = console or Console()
        for line in plan_lines(plan, config, layout):
            console.print(line, markup=False, highlight=False, soft_wrap=True)
    return plan, config, layout


@app.command("plan")
def plan_command(
    plan_file: Optional[str] = typer.Argument(None, metavar="PLAN.yaml", help="A plan file; the default plan when left out."),
    as_json: bool = typer.Option(False, "--json", help="Print the same facts as JSON."),
    model: Optional[str] = typer.Option(None, "--model", help="'default', an HF checkpoint folder or a .gguf file."),
    sets: Optional[list[str]] = typer.Option(None, "--set", metavar="KEY=VALUE", help="Override a plan key, e.g. --set kv.pages=256 (repeatable)."),
) -> None:
    """Show what a plan takes (window, lanes, cache rows, pages, pool, budget) and whether it fits. Reads configs, never weights."""
    plan, config, layout = resolve_plan(plan_file, model, sets or (), quiet=as_json, console=None)
    if as_json:
        print(json.dumps(plan_json(plan, config, layout), indent=2))
