"""The `tfq` command: one module per subcommand, each registering itself on the app (tfq/cli/app.py)."""
from __future__ import annotations

import sys

from tfq.errors import TfqError


def main() -> None:
    # Subcommands register themselves on import.
    from tfq.cli import bench, chat, kernels, plan, replay, serve, together, verify  # noqa: F401
    from tfq.cli.app import app

    try:
        app(standalone_mode=True)
    except TfqError as e:
        print(f"tfq: {e}", file=sys.stderr)
        sys.exit(2)
