"""The prefix cache on disk (plan key `kv.prefix_store: DIR`): full pages kept as files, so a prompt seen before a
restart is warm after it.

A page's rows are a function of the tokens up to its end and of the arithmetic (tfq/engine/prefix.py), so a file
named by the page's chained key, under a root that also holds the weights' sha256, the weights kind and tfq's
recipe, holds exactly the rows a cold run computes. Reading it back maps those bits into a page: warm from disk
equals cold. A file is trusted only whole: its header must name this root, this key and this page's shape, and
its checksum must match its rows; anything else is ignored (one log line) and the rows are computed.

Files are written to a temporary name and renamed (atomic), so several processes may share one folder; the folder
is kept under a size bound by removing the least recently used files (a file read is touched). Writes go to a
thread of their own from a copy of the page's rows, so a step never waits on the disk; close() (and the process's
exit) writes what is queued and ends that thread, since one still in torch when the interpreter ends aborts it.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import queue
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from tfq.errors import TfqError

log = logging.getLogger(__name__)

MAGIC = b"TFQPAGE1"
QUEUED = 64  # pages waiting to be written at most; past it a page is not kept (a cache, not a log)


@dataclass(frozen=True)
class Shape:
    """What every file of one kind holds, in order: a page's keys then values of each attention layer ([rows,
    heads, dim] in the cache dtype), or a hybrid's DeltaNet state at a page's end (each layer's convolution window,
    then each layer's recurrence, fp32)."""

    kind: str  # the files' suffix: page | state
    tensors: tuple[tuple[int, ...], ...]
    dtype: torch.dtype

    @classmethod
    def page(cls, rows: int, layers: int, heads: int, dim: int, dtype: torch.dtype) -> "Shape":
        return cls("page", ((rows, heads, dim),) * (2 * layers), dtype)

    def sizes(self) -> list[int]:
        one = torch.empty((), dtype=self.dtype).element_size()
        return [one * int(torch.Size(t).numel()) for t in self.tensors]

    def header(self, root: bytes, key: bytes, checksum: str) -> dict:
        return {"root": root.hex(), "key": key.hex(), "kind": self.kind, "tensors": [list(t) for t in self.tensors],
                "dtype": str(self.dtype), "byteorder": sys.byteorder, "checksum": checksum}


def checksum(payload: bytes) -> str:
    return hashlib.blake2b(payload, digest_size=16).hexdigest()


class PrefixStore:
    def __init__(self, folder: str | Path, root: bytes, shapes: list[Shape], most_bytes: int):
        """shapes: the kinds of file kept (a page's; a hybrid's state too)."""
        self.folder = Path(folder).expanduser() / root.hex()  # one folder a root: other models' files never listed
        self.root, self.most_bytes = root, most_bytes
        self.shapes = {s.kind: s for s in shapes}
        self.loaded = self.written = self.ignored = 0  # pages read back, written, and refused (counters)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._bytes = sum(f.stat().st_size for f in self._files())
        except OSError as e:
            raise TfqError(f"kv.prefix_store {folder}: cannot use it ({e.strerror or e}); give a folder this process "
                           f"may write, or kv.prefix_store: off") from None
        self._queue: queue.Queue = queue.Queue(QUEUED)
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name="tfq-prefix-store", daemon=True)
        self._writer.start()
        atexit.register(self.close)

    def path(self, key: bytes, kind: str = "page") -> Path:
        return self.folder / f"{key.hex()}.{kind}"

    def has(self, key: bytes, kind: str = "page") -> bool:
        return kind in self.shapes and self.path(key, kind).is_file()

    # -- reading ----------------------------------------------------------------------------------------------
    def load(self, key: bytes, kind: str = "page") -> list[torch.Tensor] | None:
        """The tensors kept under `key` (a page's rows, keys then values of each layer; or a state), or None: no
        such file, or one that is not exactly this root's, key's and shape's with a matching checksum (logged and
        ignored)."""
        path = self.path(key, kind)
        try:
            data = path.read_bytes()
        except OSError:
            return None  # never written, or removed by another process meanwhile
        rows = self._parse(data, key, self.shapes[kind])
        if rows is None:
            self.ignored += 1
            log.warning("prefix store: ignored %s (not this cache's page, or damaged); its rows are computed and "
                        "written again", path)
            path.unlink(missing_ok=True)
            return None
        self.loaded += 1
        try:
            os.utime(path)  # most recently used
        except OSError:
            pass
        return rows

    def _parse(self, data: bytes, key: bytes, s: Shape) -> list[torch.Tensor] | None:
        if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 4:
            return None
        size = int.from_bytes(data[len(MAGIC):len(MAGIC) + 4], "little")
        start = len(MAGIC) + 4 + size
        try:
            header = json.loads(data[len(MAGIC) + 4:start])
        except ValueError:
            return None
        payload = data[start:]
        if header != s.header(self.root, key, checksum(payload)) or len(payload) != sum(s.sizes()):
            return None
        flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return [t.view(s.dtype).reshape(shape) for t, shape in zip(flat.split(s.sizes()), s.tensors)]

    # -- writing ----------------------------------------------------------------------------------------------
    def save(self, key: bytes, tensors: list[torch.Tensor], kind: str = "page") -> None:
        """Keep a page's rows (or a state) under `key`: copied now, written by the store's thread; one already
        kept is not written again, nor any after close()."""
        if self._closed or self.has(key, kind):
            return
        copies = [t.detach().to("cpu", copy=True).contiguous() for t in tensors]
        try:
            self._queue.put_nowait((key, copies, kind))
        except queue.Full:
            log.info("prefix store: %d files wait to be written; %s %s is not kept", QUEUED, kind, key.hex())

    def flush(self) -> None:
        """Wait until every page handed over so far is on disk."""
        self._queue.join()

    def close(self) -> None:
        """Write every page handed over so far, then end the writing thread (the store keeps nothing after)."""
        atexit.unregister(self.close)
        self._closed = True
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:  # None: close(), and what came before it is written
            key, rows, kind = item
            try:
                self._write(key, rows, kind)
            except Exception as e:  # the thread goes on: a page not kept is computed again later
                log.warning("prefix store: cannot write %s %s in %s (%s)", kind, key.hex(), self.folder, e)
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _write(self, key: bytes, rows: list[torch.Tensor], kind: str) -> None:
        payload = b"".join(t.view(torch.uint8).numpy().tobytes() for t in rows)
        header = json.dumps(self.shapes[kind].header(self.root, key, checksum(payload))).encode()
        target = self.path(key, kind)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}")
        with open(tmp, "wb") as f:
            f.write(MAGIC + len(header).to_bytes(4, "little") + header + payload)
        os.replace(tmp, target)
        self.written += 1
        self._bytes += target.stat().st_size
        if self._bytes > self.most_bytes:
            self._evict()

    def _files(self) -> list[Path]:
        return [f for kind in self.shapes for f in self.folder.glob(f"*.{kind}") if f.is_file()]

    def _evict(self) -> None:
        """The least recently used files removed until the folder holds at most 90% of the bound (counted again
        from the folder: other processes write into it too)."""
        found = []
        for f in self._files():
            try:
                st = f.stat()
            except OSError:
                continue
            found.append((st.st_mtime_ns, st.st_size, f))
        found.sort()
        total = sum(size for _, size, _ in found)
        for _, size, f in found:
            if total <= 0.9 * self.most_bytes:
                break
            f.unlink(missing_ok=True)
            total -= size
        self._bytes = total
