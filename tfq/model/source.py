"""Where a model comes from: `default`, an HF checkpoint folder, or a .gguf file (converted once, cached)."""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

from tfq.errors import TfqError
from tfq.model import default, gguf_file
from tfq.model.config import ModelConfig

# Bump when a conversion's output changes, so stale cached folders are not reused.
CONVERTER_VERSION = 1
SHIPPED_DEFAULT_CONFIG = Path(__file__).with_name("default_config.json")
_HASHES = "sha256.json"
_LOCK = ".lock"  # beside a temporary entry being written


def cache_dir() -> Path:
    """$TFQ_CACHE, else $XDG_CACHE_HOME/tfq, else ~/.cache/tfq."""
    if os.environ.get("TFQ_CACHE"):
        return Path(os.environ["TFQ_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "tfq"
    return Path.home() / ".cache" / "tfq"


def converted_dir(sha256: str) -> Path:
    """The cached HF folder converted from the GGUF file with this sha256."""
    return cache_dir() / "converted" / f"{sha256}-v{CONVERTER_VERSION}"


def resolve_model(spec: str, progress: bool = True, weights: bool = True) -> Path:
    """An HF checkpoint folder for `spec` ("default", an HF folder, or a .gguf file). A GGUF file's folder is
    made once from its header (config and tokenizer); its fp32 weights are written into it only when `weights`
    asks for them (weights: fp32, or a peer that loads the folder), once."""
    if spec == "default":
        target = converted_dir(default.SHA256)
        if _complete(target, weights):
            return target
        joined = gguf_path("default", progress)
        return _converted(joined, target, weights, progress, "the default model")
    path = _existing(spec)
    if path.is_dir():
        ModelConfig.from_folder(path)
        return path
    _require_gguf(path)
    sha = file_sha256(path, progress)
    target = converted_dir(sha)
    if _complete(target, weights):
        return target
    return _converted(path, target, weights, progress)


def _complete(folder: Path, weights: bool) -> bool:
    return (folder / "config.json").is_file() and (not weights or (folder / gguf_file.WEIGHTS).is_file())


def _converted(path: Path, target: Path, weights: bool, progress: bool, label: str | None = None) -> Path:
    """The folder of GGUF file `path`: its header's config and tokenizer (once), then its fp32 weights if asked."""
    if not (target / "config.json").is_file():
        header = gguf_file.read_header(path)
        gguf_file.hf_config(header)  # an unsupported architecture fails here, before any work
        _convert_once(target, lambda out: gguf_file.convert(path, out, progress, header, label, weights=weights))
    if weights and not (target / gguf_file.WEIGHTS).is_file():
        write_once(target / gguf_file.WEIGHTS, lambda tmp: gguf_file.write_weights(path, tmp, progress, label=label))
    return target


def default_gguf() -> Path:
    """Where the default model's parts are joined into one GGUF file, once (it may not be there yet)."""
    return cache_dir() / "gguf" / f"{default.SHA256}.gguf"


def gguf_path(spec: str, progress: bool = True) -> Path | None:
    """The GGUF file behind `spec`: the file itself, the default model's parts joined once into the cache
    (`default_gguf`), or None for an HF folder."""
    if spec == "default":
        target = default_gguf()
        if not target.is_file():
            default.part_paths()  # not installed or incomplete: say so before any work
            write_once(target, lambda tmp: default.join_parts(tmp, progress))
        return target
    path = _existing(spec)
    if path.is_dir():
        return None
    _require_gguf(path)
    return path


def write_once(target: Path, produce: Callable[[Path], None]) -> None:
    """Run `produce` into a temporary file beside `target`, then rename it into place (atomic)."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
        os.close(fd)
    except OSError as e:
        raise TfqError(f"cannot write the cache folder {target.parent} ({e.strerror or e}); "
                       "set TFQ_CACHE to a writable folder") from None
    tmp = Path(name)
    try:
        produce(tmp)
        os.replace(tmp, target)
    except OSError as e:
        raise TfqError(f"cannot write {target} ({e.strerror or e}); "
                       "is the disk full? set TFQ_CACHE elsewhere") from None
    finally:
        tmp.unlink(missing_ok=True)


def model_config(spec: str) -> ModelConfig:
    """The model's shape, fast: never reads or converts weights."""
    if spec == "default":
        target = converted_dir(default.SHA256)
        if (target / "config.json").is_file():
            return ModelConfig.from_folder(target)
        if not default.installed():
            raise TfqError(f"the default model is not installed; install it with: {default.INSTALL}")
        return ModelConfig.from_dict(json.loads(SHIPPED_DEFAULT_CONFIG.read_text()), "the default model's config")
    path = _existing(spec)
    if path.is_dir():
        return ModelConfig.from_folder(path)
    _require_gguf(path)
    sha = _known_sha256(path)
    if sha and (converted_dir(sha) / "config.json").is_file():
        return ModelConfig.from_folder(converted_dir(sha))
    return ModelConfig.from_dict(gguf_file.hf_config(gguf_file.read_header(path)), str(path))


def _existing(spec: str) -> Path:
    path = Path(spec).expanduser()
    if not path.exists():
        raise TfqError(f"{spec}: no such file or folder; a model is 'default', an HF checkpoint folder or a .gguf file")
    return path


def _require_gguf(path: Path) -> None:
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise TfqError(f"{path}: cannot read it ({e.strerror or e})") from None
    if magic != gguf_file.MAGIC:
        what = "a GGUF file that is empty or damaged" if path.suffix == ".gguf" else "neither a folder nor a GGUF file"
        raise TfqError(f"{path}: {what}; a model is 'default', an HF checkpoint folder or a .gguf file")


def _convert_once(target: Path, produce: Callable[[Path], None]) -> Path:
    """Run `produce` into a temporary folder beside `target`, then rename it into place (atomic)."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale(target.parent)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        lock = _hold(_lock_of(tmp))  # fresh, so no clean-up takes it before the lock is held
    except OSError as e:
        raise TfqError(f"cannot write the cache folder {target.parent} ({e.strerror or e}); "
                       "set TFQ_CACHE to a writable folder") from None
    try:
        produce(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp made it private; the cache is an ordinary folder
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # not a concurrent conversion that finished first
                raise
    except OSError as e:
        raise TfqError(f"converting into {target} failed ({e.strerror or e}); "
                       "is the disk full? set TFQ_CACHE elsewhere") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        _let_go(lock, _lock_of(tmp))
    return target


def _lock_of(entry: Path) -> Path:
    """The lock file beside a temporary entry: held while its writer lives (the kernel lets go when it dies)."""
    return entry.with_name(entry.name + _LOCK)


def _hold(lock: Path) -> int:
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _let_go(fd: int, lock: Path) -> None:
    lock.unlink(missing_ok=True)  # before letting go: a clean-up that opens it then finds nothing
    os.close(fd)


def _remove_stale(folder: Path, age_s: float = 3600.0) -> None:
    """Delete what a killed conversion left behind: hidden temporary entries untouched for an hour whose writer
    is gone. An entry with a lock file is another process's conversion while that process holds the lock (a
    conversion may write one file for longer than an hour, so age alone cannot tell); one without is from a
    tfq that did not lock, or its lock file is gone with its writer."""
    now = time.time()
    for p in folder.glob(".*"):
        try:
            if p.name.endswith(_LOCK):
                if not p.with_name(p.name[:-len(_LOCK)]).exists() and now - p.stat().st_mtime > age_s:
                    _remove_unheld(p, p)  # a lock file left without its entry
            elif now - p.stat().st_mtime > age_s:
                _remove_unheld(p, _lock_of(p))
        except OSError:
            pass


def _remove_unheld(entry: Path, lock: Path) -> None:
    """Remove `entry` (and its lock file) unless a live writer holds the lock."""
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        fd = None
    try:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return  # its writer lives
        shutil.rmtree(entry) if entry.is_dir() else entry.unlink(missing_ok=True)
        lock.unlink(missing_ok=True)
    finally:
        if fd is not None:
            os.close(fd)


def _hash_memo() -> tuple[Path, dict]:
    memo = cache_dir() / "converted" / _HASHES
    try:
        return memo, json.loads(memo.read_text())
    except (OSError, ValueError):
        return memo, {}


def _stat_key(path: Path) -> list:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


def _known_sha256(path: Path) -> str | None:
    """The sha256 recorded for this file if it is unchanged since (size and mtime), else None."""
    entry = _hash_memo()[1].get(str(path.resolve()))
    return entry[2] if entry and entry[:2] == _stat_key(path) else None


def file_sha256(path: Path, progress: bool = True) -> str:
    """sha256 of a file, remembered by (path, size, mtime) so a big GGUF is hashed once."""
    known = _known_sha256(path)
    if known:
        return known
    from tqdm import tqdm

    digest = hashlib.sha256()
    with open(path, "rb") as f, tqdm(
        total=path.stat().st_size, unit="B", unit_scale=True, desc=f"hashing {path.name}", disable=not progress,
        leave=False,
    ) as bar:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
            bar.update(len(chunk))
    sha = digest.hexdigest()
    memo, entries = _hash_memo()
    entries[str(path.resolve())] = _stat_key(path) + [sha]
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, indent=1))
        os.replace(tmp, memo)
    except OSError:
        pass  # the memo only saves time
    return sha
