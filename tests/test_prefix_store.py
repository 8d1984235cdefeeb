"""The prefix cache on disk (kv.prefix_store): a prompt's full pages written by one engine are read back by the
next (a restart), and its reply equals the cold run's, ids and logits bit for bit. A damaged file, or one whose
header names another root, is ignored with one log line and the rows are computed; the control maps a page whose
rows were changed (its checksum made to match) and must part from the cold run. A server stopped and started on the
same folder: its metrics show the rows read back, and the reply and the prompt's scores equal the cold run's."""
from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from served import TINY_PLAN, metrics, until
from tfq.engine.core import Engine
from tfq.engine.prefix_store import MAGIC, PrefixStore, Shape, checksum
from tfq.engine.stream import Request
from tfq.plan.resolve import resolve_plan
from tiny import CORPUS

PAGE = 64


def engine(tiny_dirs, tiny_models, *sets) -> Engine:
    plan, _, layout = resolve_plan(TINY_PLAN, str(tiny_dirs["qwen2"]), ["kv.paged=all", *sets], True, None)
    return Engine.from_plan(plan, layout, tiny_models["qwen2"])


def prompt(tiny_models, tokens: int) -> tuple[int, ...]:
    ids = tiny_models["qwen2"].tokenizer.encode(CORPUS * 4)
    assert len(ids) >= tokens
    return tuple(ids[:tokens])


def run(e: Engine, p: tuple[int, ...]):
    r = e.generate([Request(p, max_tokens=12, temperature=0.8, seed=3)])[0]
    e.cache.pages.store and e.cache.pages.store.flush()
    return r


@pytest.fixture(scope="module")
def cold(tiny_dirs, tiny_models):
    p = prompt(tiny_models, 5 * PAGE + 17)
    return p, run(engine(tiny_dirs, tiny_models), p)


def stored(tiny_dirs, tiny_models, folder: Path, *sets) -> Engine:
    return engine(tiny_dirs, tiny_models, "kv.prefix_cache=on", f"kv.prefix_store={folder}", *sets)


def page_files(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.page"))


def chain_files(e: Engine, p: tuple[int, ...]) -> list[Path]:
    """The files of the prompt's full pages, in the prompt's order."""
    from tfq.engine.prefix import page_key

    key, out = e.cache.pages.prefix.root, []
    for i in range(len(p) // PAGE):
        key = page_key(key, list(p[i * PAGE:(i + 1) * PAGE]))
        out.append(e.cache.pages.store.path(key))
    return out


def test_pages_written_by_one_engine_make_the_next_warm_with_the_cold_bits(tiny_dirs, tiny_models, cold, tmp_path):
    p, want = cold
    first = run(stored(tiny_dirs, tiny_models, tmp_path), p)
    assert len(page_files(tmp_path)) == 5  # the prompt's full pages, not its last partial one
    again = stored(tiny_dirs, tiny_models, tmp_path)  # a new engine: nothing in memory
    got = run(again, p)
    assert again.cache.pages.store.loaded == 5 and got.reused == 5 * PAGE
    assert (got.ids, got.digests) == (want.ids, want.digests) == (first.ids, first.digests)


def test_a_damaged_page_or_another_roots_is_ignored_and_computed(tiny_dirs, tiny_models, cold, tmp_path, caplog):
    p, want = cold
    first = stored(tiny_dirs, tiny_models, tmp_path)
    run(first, p)
    files = chain_files(first, p)
    assert sorted(files) == page_files(tmp_path)
    damaged = bytearray(files[1].read_bytes())
    damaged[-5] ^= 0x10
    files[1].write_bytes(bytes(damaged))
    other = files[3].read_bytes()
    files[3].write_bytes(other.replace(files[3].parent.name.encode(), b"0" * len(files[3].parent.name), 1))
    with caplog.at_level(logging.WARNING, logger="tfq.engine.prefix_store"):
        e = stored(tiny_dirs, tiny_models, tmp_path)
        got = run(e, p)
    ignored = [r for r in caplog.records if "ignored" in r.getMessage()]
    assert len(ignored) == 1 and files[1].name in ignored[0].getMessage()  # the chain stops at the damaged page
    assert e.cache.pages.store.ignored == 1 and got.reused == PAGE
    assert (got.ids, got.digests) == (want.ids, want.digests)
    e = stored(tiny_dirs, tiny_models, tmp_path)  # the page rewritten by that run; the other root's next
    assert run(e, p).digests == want.digests and e.cache.pages.store.ignored == 1


def test_control_a_page_with_other_rows_and_a_matching_checksum_parts_from_cold(tiny_dirs, tiny_models, cold,
                                                                                 tmp_path):
    p, want = cold
    first = stored(tiny_dirs, tiny_models, tmp_path)
    run(first, p)
    path = chain_files(first, p)[2]
    data = path.read_bytes()
    size = int.from_bytes(data[len(MAGIC):len(MAGIC) + 4], "little")
    start = len(MAGIC) + 4 + size
    payload = bytearray(data[start:])
    rows = torch.frombuffer(payload, dtype=torch.float32)
    rows[7] = rows[7] + 1.0  # one key value of one row: the page a run one row off would have given
    header = json.loads(data[len(MAGIC) + 4:start])
    header["checksum"] = checksum(bytes(payload))
    text = json.dumps(header).encode()
    path.write_bytes(MAGIC + len(text).to_bytes(4, "little") + text + bytes(payload))
    e = stored(tiny_dirs, tiny_models, tmp_path)
    got = run(e, p)
    assert e.cache.pages.store.loaded == 5 and got.digests != want.digests


def test_a_hybrid_keeps_its_states_on_disk_too_and_a_restart_resumes_from_them(tmp_path_factory, tmp_path):
    """A hybrid's pages and the DeltaNet states at their ends both go to disk: a new engine maps the pages, reads
    the state at the last one back and equals the cold run; with the state files gone it maps nothing."""
    from tfq.model.load import load_model
    from tiny import tiny_model_dir

    kinds = ("linear_attention", "full_attention", "linear_attention", "full_attention")
    folder = tiny_model_dir(tmp_path_factory, "qwen3_5", layers=4, layer_types=kinds)
    hybrid = load_model(str(folder), progress=False)

    def fresh(*sets) -> Engine:
        plan, _, layout = resolve_plan(TINY_PLAN, str(folder), ["kv.paged=all", *sets], True, None)
        return Engine.from_plan(plan, layout, hybrid)

    p = tuple(range(5, 5 + 3 * PAGE + 9))
    want = run(fresh(), p)
    run(fresh("kv.prefix_cache=on", f"kv.prefix_store={tmp_path}"), p)
    assert len(list(tmp_path.rglob("*.page"))) == len(list(tmp_path.rglob("*.state"))) == 3
    e = fresh("kv.prefix_cache=on", f"kv.prefix_store={tmp_path}")
    got = run(e, p)
    assert got.reused == 3 * PAGE and e.cache.pages.store.loaded == 4  # three pages, the state at the third
    assert (got.ids, got.digests) == (want.ids, want.digests)
    for f in tmp_path.rglob("*.state"):
        f.unlink()
    assert run(fresh("kv.prefix_cache=on", f"kv.prefix_store={tmp_path}"), p).reused == 0


HANDED_OVER_THEN_EXIT = """
import sys, torch
from tfq.engine.prefix_store import PrefixStore, Shape
shape = Shape.page(64, 4, 8, 128, torch.bfloat16)
store = PrefixStore(sys.argv[1], bytes(16), [shape], 1 << 40)
rows = [torch.full(t, i, dtype=torch.bfloat16) for i, t in enumerate(shape.tensors)]
for key in range(int(sys.argv[2])):
    store.save(key.to_bytes(16, "little"), rows)
"""  # the process ends while its store's thread writes: that thread once aborted the exit, and lost the pages


def test_a_process_that_ends_right_after_handing_pages_over_exits_cleanly_with_every_page_on_disk(tmp_path):
    shape = Shape.page(64, 4, 8, 128, torch.bfloat16)
    for folder in (tmp_path / str(n) for n in range(3)):  # the race lost the pages in every try, aborted in some
        done = subprocess.run([sys.executable, "-c", HANDED_OVER_THEN_EXIT, str(folder), "60"], capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        store = PrefixStore(folder, bytes(16), [shape], 1 << 40)
        for key in range(60):
            rows = store.load(key.to_bytes(16, "little"))
            assert rows is not None and all(torch.equal(r, torch.full_like(r, i)) for i, r in enumerate(rows))
        store.close()
    store.save(bytes(15) + b"\xff", rows)  # after close a page is not kept (no thread writes it)
    assert not store.has(bytes(15) + b"\xff") and len(page_files(folder)) == 60


def test_the_store_needs_the_prefix_cache(tiny_dirs, tiny_models, tmp_path):
    from tfq.errors import TfqError

    with pytest.raises(TfqError, match="set kv.prefix_cache: on"):
        engine(tiny_dirs, tiny_models, f"kv.prefix_store={tmp_path}")


# -- a server stopped and started again ---------------------------------------------------------------------
def start(tiny_dirs, folder: Path, log: list[str] | None = None) -> tuple[subprocess.Popen, str]:
    """`tfq serve` on the tiny model with the prefix store in `folder`; its base URL. What it writes to stderr after
    it serves goes to `log` (read off the pipe as it comes, so the pipe never fills)."""
    proc = subprocess.Popen([sys.executable, "-m", "tfq", "serve", "--model", str(tiny_dirs["qwen2"]), "--plan",
                             TINY_PLAN, "--set", "window=4096", "--set", "kv.paged=all", "--set", "kv.prefix_cache=on",
                             "--set", f"kv.prefix_store={folder}", "--port", "0", "--quiet"],
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "TFQ_THREADS": "2"})
    for line in proc.stderr:
        found = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", line)
        if found:
            kept = log if log is not None else []
            threading.Thread(target=lambda: kept.extend(proc.stderr), daemon=True).start()
            return proc, found.group(1)
    raise AssertionError(f"tfq serve exited {proc.wait()} before it served")


def ask(base: str, text: str, echo: bool) -> dict:
    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=600)
    r = client.completions.create(model="qwen2", prompt=text, max_tokens=8, temperature=0, logprobs=1, echo=echo,
                                  extra_body={"return_token_ids": True, "return_digests": True})
    c = r.choices[0]
    return {"ids": c.token_ids, "digests": c.digests, "scores": c.logprobs.token_logprobs}


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0


def test_a_server_restarted_on_its_folder_finds_a_long_prompt_warm_with_the_cold_bits(tiny_dirs, tiny_models,
                                                                                       tmp_path):
    text = (CORPUS * 8)[:9000]
    assert len(tiny_models["qwen2"].tokenizer.encode(text)) > 2000
    proc, base = start(tiny_dirs, tmp_path)
    try:
        cold_reply, cold_scores = ask(base, text, False), ask(base, text, True)
        written = until(base, lambda m: m['tfq_prefix_store_pages{event="written"}'] >= 2000 // PAGE)
    finally:
        stop(proc)
    assert written['tfq_prefix_store_pages{event="written"}'] >= 2000 // PAGE
    proc, base = start(tiny_dirs, tmp_path)
    try:
        warm_reply, warm_scores = ask(base, text, False), ask(base, text, True)
        after = metrics(base)
    finally:
        stop(proc)
    assert after["tfq_prefix_cache_reused_rows_total"] >= 2000 and after['tfq_prefix_store_pages{event="read"}'] > 30
    assert warm_reply == cold_reply and warm_scores == cold_scores

    ids = tuple(tiny_models["qwen2"].tokenizer.encode(text))
    read = chain_files(stored(tiny_dirs, tiny_models, tmp_path, "window=4096"), ids)  # the prompt's pages, in order
    damaged = bytearray(read[len(read) // 2].read_bytes())
    damaged[-1] ^= 0x01
    read[len(read) // 2].write_bytes(bytes(damaged))
    log: list[str] = []
    proc, base = start(tiny_dirs, tmp_path, log)
    try:
        again = ask(base, text, False)
        damaged_run = metrics(base)
    finally:
        stop(proc)
    assert damaged_run['tfq_prefix_store_pages{event="ignored"}'] == 1
    assert damaged_run["tfq_prefix_cache_reused_rows_total"] == len(read) // 2 * PAGE
    assert len([line for line in log if "prefix store: ignored" in line]) == 1, log
    assert again == cold_reply
