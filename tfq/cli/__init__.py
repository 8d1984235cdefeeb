"""The `tfq` command: one module per subcommand, each registering itself on `app`."""
from __future__ import annotations

import sys

import typer

from tfq.errors import TfqError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="tfq: exact inference for Qwen-family models. Replies do not change with batching, paging or drafting.",
)


def main() -> None:
    # Subcommands register themselves on import.
    from tfq.cli import bench, chat, kernels, plan, together  # noqa: F401

    try:
        app(standalone_mode=True)
    except TfqError as e:
        print(f"tfq: {e}", file=sys.stderr)
        sys.exit(2)
