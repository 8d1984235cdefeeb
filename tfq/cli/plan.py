"""`tfq plan [PLAN.yaml]`: what the plan takes and whether it fits; every command prints the same lines
(tfq/plan/resolve.py)."""
from __future__ import annotations

import json
from typing import Optional

import typer

from tfq.cli.app import app
from tfq.plan import plan_json
from tfq.plan.resolve import resolve_plan


@app.command("plan")
def plan_command(
    plan_file: Optional[str] = typer.Argument(None, metavar="PLAN.yaml",
                                              help="A plan file; the default plan when left out."),
    as_json: bool = typer.Option(False, "--json", help="Print the same facts as JSON."),
    model: Optional[str] = typer.Option(None, "--model", help="'default', an HF checkpoint folder or a .gguf file."),
    sets: Optional[list[str]] = typer.Option(None, "--set", metavar="KEY=VALUE",
                                             help="Override a plan key, e.g. --set kv.pages=256 (repeatable)."),
) -> None:
    """Show what a plan takes (window, lanes, cache rows, pages, pool, budget) and whether it fits. Reads configs,
    never weights."""
    plan, config, layout = resolve_plan(plan_file, model, sets or (), quiet=as_json, console=None)
    if as_json:
        print(json.dumps(plan_json(plan, config, layout), indent=2))
