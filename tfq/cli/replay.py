"""`tfq replay RECEIPT...`: each receipt's reply computed again here, equal or where it parts."""
from __future__ import annotations

import time
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.table import Table

from tfq.cli.app import app, output_file
from tfq.engine.threads import fix_threads


@app.command()
def replay(
    receipts: List[str] = typer.Argument(..., help="Receipt files: one receipt, a JSON list, or JSON lines."),
    model: Optional[str] = typer.Option(None, "--model", help="The model to replay with (default: the name each "
                                        "receipt holds); its weights' sha256 must be the receipt's."),
    key: Optional[str] = typer.Option(None, "--key", help="A file holding the issuer's key: every receipt must "
                                      "carry its signature."),
    sets: List[str] = typer.Option([], "--set", help="Plan override key=value (the bits must not change)."),
    threads: Optional[int] = typer.Option(None, "--threads",
                                          help="Exactly N torch threads (default: follow the free cores)."),
    json_file: Optional[str] = typer.Option(None, "--json", help="Also write the verdicts as JSON ('-': stdout)."),
) -> None:
    """Replay receipts on this machine: each reply's tokens and logits digests step by step against its receipt.
    Receipts of one model and arithmetic run together. Exit 0 only when every receipt is equal (1 when one parts
    or is refused)."""
    from tfq.receipts.receipt import read_key, read_receipts
    from tfq.receipts.replay import as_json
    from tfq.receipts.replay import replay as run

    output_file(json_file)
    secret = read_key(key, "--key")
    docs = [(f"{path}" + (f"[{i}]" if len(found) > 1 else ""), d)
            for path in receipts for found in [read_receipts(Path(path))] for i, d in enumerate(found)]
    fix_threads(threads)
    err, out = Console(stderr=True), Console()
    t0 = time.perf_counter()
    with err.status(f"replaying {len(docs)} receipts") as status:
        verdicts = run(docs, model, secret, sets, lambda g: status.update(
            f"replaying {len(g.items)} receipts of {g.name} ({g.settings['weights']})"))
    table = Table(title="tfq replay: each receipt's reply computed here")
    for col in ("receipt", "tokens", "verdict"):
        table.add_column(col)
    for v in verdicts:
        table.add_row(v.where, str(v.tokens), "equal" if v.equal else f"[red]{v.what}[/]")
    out.print(table)
    equal = sum(v.equal for v in verdicts)
    verdict = "[green]EQUAL[/]" if equal == len(verdicts) else "[red]PARTS[/]"
    out.print(f"{verdict}: {equal}/{len(verdicts)} receipts equal; {time.perf_counter() - t0:.0f} s", highlight=False)
    if json_file == "-":
        print(as_json(verdicts))
    elif json_file:
        Path(json_file).write_text(as_json(verdicts) + "\n", encoding="utf-8")
    raise typer.Exit(0 if equal == len(verdicts) else 1)
