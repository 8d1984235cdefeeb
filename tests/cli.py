"""Run the `tfq` command in this process, as its console script would, for tests that read its output."""
from __future__ import annotations

import sys

import pytest


def tfq(args, monkeypatch, capsys):
    """(exit code, stdout, stderr) of `tfq ARGS`."""
    from tfq.cli import main

    monkeypatch.setattr(sys, "argv", ["tfq", *args])
    with pytest.raises(SystemExit) as exit_:
        main()
    out, err = capsys.readouterr()
    return exit_.value.code or 0, out, err
