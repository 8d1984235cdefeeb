"""The wheel carries every package, the shipped suite and the recorded bits: a plain (non-editable) install runs
`tfq together` and `tfq verify`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_is_listed():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "tfq").rglob("__init__.py")}
    found |= {"tfq.kernels", "tfq.examples"}  # kernels/ and examples/, installed inside tfq
    assert found <= listed, f"add {sorted(found - listed)} to [tool.setuptools] packages in pyproject.toml"


def test_torch_is_pinned_to_the_version_the_recorded_bits_came_from():
    """`tfq verify`'s reference names the torch it was recorded with; the package asks for that one."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    recorded = json.loads((ROOT / "tfq" / "reference" / "default.json").read_text())["recorded_on"]["torch"]
    assert f"torch=={recorded.split('+')[0]}" in deps


def test_a_wheel_install_finds_the_suite(tmp_path):
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                            str(tmp_path / "dist"), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-2000:]
    wheel = next((tmp_path / "dist").glob("tfq-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        z.extractall(tmp_path / "site")
    assert {"tfq/examples/chats.yaml", "tfq/examples/schemas.json", "tfq/kernels/triton_rowwise.py",
            "tfq/model/default_config.json", "tfq/reference/default.json"} <= names
    # one top-level name: a top-level `kernels` would overwrite (or be overwritten by) PyPI's `kernels` package
    assert {n.split("/")[0] for n in names if not n.startswith("tfq-")} == {"tfq"}
    # from another folder, with the unpacked wheel first on the path and no .pth files read (-S): the
    # editable install of this checkout, if any, stays out of the way
    import site

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), *site.getsitepackages()])}
    code = "import tfq, tfq.kernels.backend; from tfq.suite import default_suite; " \
           "from tfq.suite import load_suite; from tfq.proofs import verify as v; p = default_suite(); " \
           "assert v.read(v.REFERENCE)['suite_sha256'] == v.suite_sha(p); print(tfq.__file__, p, len(load_suite(p)))"
    run = subprocess.run([sys.executable, "-S", "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    module, path, count = run.stdout.split()
    site_dir = tmp_path / "site"
    assert Path(module).is_relative_to(site_dir) and Path(path).is_relative_to(site_dir) and int(count) == 14
