"""`ruff check` is clean over the repository under pyproject.toml's [tool.ruff] (line length, import order,
complexity, argument count, pyflakes), as .ci/run checks before the tests; the control shows the same
configuration finds each kind of fault."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def ruff_check(folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                          cwd=folder, capture_output=True, text=True, timeout=120)


def test_ruff_check_is_clean():
    done = ruff_check(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr


def test_control_the_configuration_finds_each_kind_of_fault(tmp_path):
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    (tmp_path / "tfq").mkdir()
    branches = "".join(f"    if x == {i}:\n        return {i}\n" for i in range(16))
    (tmp_path / "tfq" / "bad.py").write_text(
        "import sys\nimport os\n\n\n"  # imports out of order, one unused
        f"LONG = '{'x' * 120}'\n\n\n"  # a line past 120 characters
        "def many(a, b, c, d, e, f, g, h, i, j, k):\n    return a\n\n\n"  # 11 parameters
        f"def tangled(x):\n{branches}    return sys.argv\n")  # complexity 17
    found = {line.split()[1] for line in ruff_check(tmp_path).stdout.splitlines() if line.startswith("tfq/")}
    assert {"I001", "F401", "E501", "PLR0913", "C901"} <= found, found
