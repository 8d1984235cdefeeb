"""A rank other than 0 (`python -m tfq.parallel.rank_main RANK WORLD PORT DEVICE`, started by rank 0, the run's
secret on its stdin): load the shards rank 0 loads, run the forwards it runs, until it says stop
(tfq/parallel/ranks.py says how they talk)."""
from __future__ import annotations

import os
import signal
import sys
import threading
import traceback
from typing import NoReturn

import torch

from tfq.errors import TfqError
from tfq.model.load import load_shard
from tfq.parallel.ranks import SECRET_BYTES, TIMEOUT, Group, ModelSpec, exit_with_parent, joined_key, proof, rank_device


def rank_main(rank: int, world: int, port: int, device: str) -> None:
    """A spawned rank: load what rank 0 loads, run the forwards it runs, until it says stop (or is orphaned)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when this rank stops: its stop, or its death
    threading.Thread(target=exit_with_parent, args=(os.getppid(),), daemon=True).start()
    serve_rank(rank, world, "127.0.0.1", port, device, _secret(rank))


def serve_rank(rank: int, world: int, store_host: str, port: int, device: str, secret: bytes,
               host: str | None = None) -> None:
    """Join rank 0's group (its store at store_host:port, gloo on `host`: tfq.parallel.ranks.Group), then do what
    it says until it says stop: a process started here, or an actor Ray placed on another node (tfq/ray/ranks.py)."""
    fixed = os.environ.get("TFQ_THREADS", "").strip()  # --threads N on rank 0 fixes every rank's count
    torch.set_num_threads(int(fixed) if fixed.isdigit() else max(1, (os.cpu_count() or 1) // world))
    store = torch.distributed.TCPStore(store_host, port, world, False, timeout=TIMEOUT)
    store.set(joined_key(rank), proof(secret, rank))
    try:
        group = Group(rank, world, store, rank_device(torch.device(device), rank), secret, host)
    except TfqError as e:  # a TFQ_TP_INTERFACE gloo cannot use (rank 0 says so too)
        _refuse(f"tfq rank {rank}: {e}")
    models: dict[ModelSpec, object] = {}
    caches: dict[int, object] = {}
    while True:
        try:
            message = group.receive()
        except TfqError as e:  # a message rank 0 did not sign (nothing in it is read), or rank 0 gone
            _refuse(f"tfq rank {rank}: {e}")
        if message[0] == "stop":
            return
        if message[0] == "load":
            loaded, problem = load_shard(message[1], group)
            group.agree(problem)
            if loaded is not None:
                models[message[1]] = loaded.model
            continue
        if message[0] == "prove":  # the start-up guard on this rank's shard, at its own thread count
            group.agree(_proved(models[message[1]], *message[3]))
            continue
        try:
            if message[0] != "forward":  # a hybrid's state kept in step with rank 0's: roll_back, copy_state
                kind, what, cache, args = message
                getattr(models[what], kind)(caches[cache], *args)
                continue
            _, what, cache, spec, dropped, args = message
            for serial in dropped:
                caches.pop(serial, None)
            model = models[what]
            if cache not in caches:
                from tfq.engine.cache import KVCache

                caches[cache] = KVCache(model.config, spec, backend=model.backend)
            caches[cache].ahead.before(args[2].numpy())  # its cache rows resident first, as rank 0's forward does
            model.forward(*args[:2], caches[cache], *args[2:])
        except Exception:  # noqa: BLE001 - the group cannot go on without this rank: say why, then stop
            traceback.print_exc()
            os._exit(1)


def _secret(rank: int) -> bytes:
    secret = sys.stdin.buffer.read(SECRET_BYTES + 1)  # rank 0 writes it and closes the pipe
    if len(secret) != SECRET_BYTES:
        _refuse(f"tfq rank {rank}: got {len(secret)} bytes of the run's secret on stdin, not {SECRET_BYTES}; ranks are "
                "started by rank 0 (tp: N), not by hand")
    return secret


def _refuse(line: str) -> NoReturn:
    print(line, file=sys.stderr, flush=True)
    os._exit(1)  # at once: a rank must not stay in a group it cannot trust


def _proved(model, kv_dtype: str, partial: bool, rows: int, chunk: int, draws: int) -> str:
    """"" when this rank's shard is proved row-invariant at its thread count, else the guard's one line."""
    from tfq.engine.layer_guard import prove
    from tfq.errors import TfqError

    try:
        prove(model, kv_dtype, partial, torch.get_num_threads(), rows, chunk, draws)
        return ""
    except TfqError as e:
        return f"rank {model.shard.rank}: {e}"
    except Exception as e:  # noqa: BLE001 - a guard that breaks refuses too, and rank 0 must hear it
        return f"rank {model.shard.rank}: the start-up guard could not run: {type(e).__name__}: {e}"


if __name__ == "__main__":
    rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])

