"""The `tfq` command's app, on which every subcommand module registers itself, and helpers they share."""
from __future__ import annotations

import typer

from tfq.errors import TfqError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="tfq: exact inference for Qwen-family models. Replies do not change with batching, paging or drafting.",
)


def output_file(path: str | None, option: str = "--json") -> None:
    """Refuse, before any work, a file the run could not write at its end ('-' is stdout)."""
    import os
    from pathlib import Path

    if path is None or path == "-":
        return
    target = Path(path)
    folder = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        raise TfqError(f"{option} {path} is a folder; give a file path")
    if not folder.is_dir():
        raise TfqError(f"{option} {path}: folder {folder} does not exist; create it or give another path")
    if not os.access(folder, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise TfqError(f"{option} {path}: not writable here; give another path")
