"""`tfq kernels`: the kernel check (kernels/check.py) as a table; exit 0 only if every case passes and
every control comes out RED."""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from tfq.cli.app import app, output_file
from tfq.errors import TfqError


def _lengths(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise TfqError(f"--lengths {text!r}: give stream lengths separated by commas, e.g. 5,130,290") from None


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2e}"


@app.command("kernels")
def kernels_command(
    backends: List[str] = typer.Option([], "--backend", help="torch or triton (repeatable; default: both, triton "
                                       "on CUDA or else under TRITON_INTERPRET=1)."),
    dtypes: List[str] = typer.Option([], "--dtype",
                                     help="Cache dtype fp32, bf16, fp16 or fp8 (repeatable; default: all)."),
    kernels: List[str] = typer.Option([], "--kernel",
                                      help="rows, partial (attention) or rowwise (linear layers and RMS norm); "
                                           "repeatable, default: all three."),
    heads: int = typer.Option(8, "--heads", help="Query heads."),
    kv_heads: int = typer.Option(2, "--kv-heads", help="Key/value heads (GQA groups)."),
    head_dim: int = typer.Option(64, "--head-dim", help="Head size (a power of two)."),
    lengths: str = typer.Option("5,130,290", "--lengths", help="Stream lengths; on a GPU try 1000,8000,32000."),
    page_rows: int = typer.Option(64, "--page-rows", help="Rows per page (a multiple of the key tile, 64)."),
    chunk_rows: int = typer.Option(8, "--chunk-rows", help="Rows of each stream's causal chunk."),
    repeats: int = typer.Option(5, "--repeats", help="Runs of every kernel call; all must give the same bits."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random keys, values, queries and page order."),
    json_file: Optional[Path] = typer.Option(None, "--json", metavar="FILE", help="Also write the results as JSON."),
) -> None:
    """Check the kernels: attention paged == contiguous in bits and within a float64 bound for queries, rows,
    stores and keep; linear layers and RMS norm invariant to the batch and within a float64 bound; repeats
    identical; canaries untouched; controls RED."""
    from tfq.kernels.backend import torch_backend, triton_backend
    from tfq.proofs.kernel_check import CheckConfig, passed, report_json, run_check, steps

    console = Console()
    defaults = CheckConfig()
    cfg = CheckConfig(heads=heads, kv_heads=kv_heads, head_dim=head_dim, lengths=_lengths(lengths),
                      page_rows=page_rows, chunk_rows=chunk_rows, repeats=repeats, seed=seed,
                      dtypes=tuple(dtypes) or defaults.dtypes, kernels=tuple(kernels) or defaults.kernels)
    cfg.validate()
    output_file(None if json_file is None else str(json_file))
    for b in backends:
        if b not in ("torch", "triton"):
            raise TfqError(f"--backend {b!r}: choose torch or triton")
    chosen = []
    if not backends or "torch" in backends:
        chosen.append(torch_backend())
    if not backends or "triton" in backends:
        tb, why = triton_backend()
        if tb is None and backends:
            raise TfqError(f"the triton backend cannot run: {why}")
        if tb is None:
            console.print(f"[yellow]triton skipped: {why}[/yellow]")
        else:
            chosen.append(tb)
    for b in chosen:
        console.print(f"backend {b.name}: {b.where}", highlight=False)

    with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=console,
                  transient=True) as bar:
        task = bar.add_task("kernel check", total=steps(cfg) * len(chosen))
        first = [True]

        def step(what: str) -> None:
            if not first[0]:
                bar.advance(task)
            first[0] = False
            bar.update(task, description=what)

        cases = run_check(cfg, chosen, step)

    table = Table(title="kernel check")
    for col in ("check", "kernel", "backend", "dtype", "result", "worst error", "bound", "note"):
        table.add_column(col, justify="right" if col in ("worst error", "bound") else "left", no_wrap=col != "note")
    for c in cases:
        style = "green" if c.ok else "bold red"
        table.add_row(c.check, c.kernel, c.backend, c.dtype, f"[{style}]{c.result}[/{style}]", _num(c.worst),
                      _num(c.bound), c.note)
    Console(width=max(console.width, 120)).print(table)  # a narrow pipe would cut the numbers
    ok = passed(cases)
    bad = sum(not c.ok for c in cases)
    console.print("[green]kernel check passed[/green]" if ok
                  else f"[bold red]kernel check failed: {bad} case(s)[/bold red]")
    if json_file is not None:
        json_file.write_text(json.dumps(report_json(cfg, chosen, cases), indent=2))
    raise typer.Exit(0 if ok else 1)
