"""Tensor parallelism (tfq/parallel): a stream's ids and logits bits on 1, 2 and 3 ranks equal one process's,
alone, together, paged, chunked, preempted, drafted and from a warm prefix; the usual all-reduce split is RED.

The ranks are real processes on gloo, started by tfq itself (`python -m tfq.parallel.rank_main`). The tiny models
split unevenly over 3 ranks: 2 key/value heads (1 + 1 + 0: the last rank holds no head), 128 hidden columns
(43 + 43 + 42), 256 intermediate (86 + 85 + 85) and 512 vocabulary entries (171 + 171 + 170).
"""
from __future__ import annotations

import json
import os
import pickle
import random
import secrets
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import yaml

import engines
from cli import tfq
from engines import all_same
from test_together import check_for, random_suite
from tfq.errors import TfqError, Unservable
from tfq.model.kernel_guard import check_columns
from tfq.model.load import load_model
from tfq.parallel.shard import Shard, part, sizes
from tfq.plan import load_plan
from tfq.proofs.together import EXACT, RED

ROOT = Path(__file__).resolve().parents[1]


def test_parts_cover_every_unit_once_in_rank_order():
    for n in (0, 1, 2, 5, 128, 896, 151936):
        for world in (1, 2, 3, 4, 7, 8):
            cuts = [part(n, r, world) for r in range(world)]
            assert cuts[0].start == 0 and cuts[-1].stop == n
            assert all(a.stop == b.start for a, b in zip(cuts, cuts[1:]))
            assert max(sizes(n, world)) - min(sizes(n, world)) <= 1
            assert sizes(n, world) == sorted(sizes(n, world), reverse=True)  # the first ranks take the extra


def test_a_shard_holds_whole_heads_and_its_columns(tiny_models):
    config = tiny_models["qwen3"].config  # 8 query heads, 2 key/value heads
    local = [Shard(config, r, 3).local_config() for r in range(3)]
    assert [c.num_kv_heads for c in local] == [1, 1, 0]
    assert [c.num_heads for c in local] == [4, 4, 0]
    assert [c.intermediate_size for c in local] == sizes(config.intermediate_size, 3)
    assert all(c.hidden_size == config.hidden_size and c.vocab_size == config.vocab_size for c in local)
    reduce = Shard(config, 1, 2, reduce=True)
    assert reduce.keep("model.layers.0.mlp.down_proj.weight") == (None, reduce.intermediate)
    assert Shard(config, 1, 2).keep("model.layers.0.mlp.down_proj.weight") == (Shard(config, 1, 2).hidden, None)
    assert Shard(config, 0, 2).keep("model.embed_tokens.weight") is None


@pytest.mark.parametrize("family, world", [("qwen2", 1), ("qwen2", 2), ("qwen3", 2), ("qwen2", 3), ("qwen3", 3)])
def test_every_arm_equals_one_process_alone_and_all_reduce_is_red(family, world, tiny_models, tmp_path):
    """tfq together's arms at tp = world against the reference at tp = 1: every arm EXACT in ids and logits,
    every control RED (the all-reduce control where there are ranks to reduce over)."""
    rng = random.Random(world * 10 + len(family))
    loaded = tiny_models[family]
    plan = load_plan(None, env={}, sets=["window=640", "lanes=4", "prefill_chunk=100", "kv.pages=128",
                                         "budget=1GiB", f"tp={world}", f"model={loaded.folder}"])
    check = check_for(loaded, random_suite(rng, loaded.tokenizer), plan, 3, tokens=6, evidence=tmp_path).run()
    assert check.reference.plan.tp == 1 and all(r.plan.tp == world for r in check.arms)
    wrong = {r.arm.name: (r.verdict, r.note) for r in check.arms if r.verdict != (RED if r.arm.control else EXACT)}
    assert not wrong, wrong
    n = len(check.requests)
    for run in check.arms:
        assert run.equal_ids == n or run.arm.control
        assert (run.equal_logits < n) == run.arm.control
    names = {r.arm.name for r in check.arms}
    assert ("all-reduce" in names) == (world > 1)
    assert {"paged-alone", "whole", "paged", "chunked", "preempted", "drafted", "drafted-model", "prefix"} <= names
    if world > 1:
        reduce = next(r for r in check.arms if r.arm.name == "all-reduce")
        assert reduce.equal_logits == 0  # every reply's logits differ: the split sums show at the first step


def test_ranks_run_the_same_forward_as_one_process(tiny_models):
    """Below the check: one forward's logits at 3 ranks equal one process's bit for bit, and the all-reduce
    split's differ (the control fails by construction: a sum cut in two and added)."""
    from tfq.engine.stream import Request

    folder = str(tiny_models["qwen3"].folder)
    requests = [Request(prompt=tuple(range(5 + 3 * i, 40 + 7 * i)), max_tokens=5) for i in range(4)]
    runs = {}
    for name, loaded in (("one", tiny_models["qwen3"]), ("tp3", load_model(folder, progress=False, tp=3)),
                         ("reduce", load_model(folder, progress=False, tp=2, reduce=True))):
        runs[name] = engines.run(loaded.model, requests, window=256, lanes=3, keep_logits=True)
    for one, tp3, reduce in zip(runs["one"], runs["tp3"], runs["reduce"]):
        assert one.ids == tp3.ids and all(torch.equal(a, b) for a, b in zip(one.logits, tp3.logits))
        assert not torch.equal(one.logits[0], reduce.logits[0])


def test_column_check_refuses_a_kernel_whose_columns_depend_on_their_neighbours(tiny_models):
    """The guard's column proof passes tfq's kernel on the model's own matrices and refuses, by construction,
    a linear layer whose outputs depend on how many columns it computes."""
    from tfq.model.weights import load_state_dict
    from tfq.parallel.model import _first_layer

    loaded = tiny_models["qwen2"]
    model = loaded.model
    matrices = _first_layer(load_state_dict(loaded.folder), loaded.config)
    check_columns(matrices, model.make_linear, model.backend)  # tfq's kernel: passes

    def by_width(w, b=None):  # the control: the sum picks up a term from the number of columns computed
        f = model.make_linear(w, b)
        return lambda x: f(x) + 1e-3 * (w.shape[0] % 2)

    with pytest.raises(TfqError, match="not column-invariant"):
        check_columns(matrices, by_width, model.backend)


@pytest.mark.parametrize("world", [2, 3])
def test_a_hybrid_split_by_deltanet_key_heads_every_arm(world, tmp_path_factory, tmp_path, monkeypatch, capsys):
    """A Qwen3.5 hybrid (test_hybrid's model with the real ratios: 1 key/value head, DeltaNet 2 key and 6 value
    heads) at 2 and 3 ranks: ranks without an attention head, at 3 one without a DeltaNet head too; drafting rolls
    every rank's state back. Every arm EXACT against one process alone, every control RED."""
    from test_hybrid import shipped_hybrid_suite
    from tiny import tiny_model_dir

    folder = tiny_model_dir(tmp_path_factory, "qwen3_5", tie=True, seed=4, layers=8, hidden=192, heads=6,
                            kv_heads=1, head_dim=64, intermediate=640, linear_heads=(2, 6), linear_dims=(32, 32),
                            branch_scale=0.3)
    summary = tmp_path / "summary.json"
    code, out, err = tfq(["together", "--model", str(folder), "--suite", str(shipped_hybrid_suite()), "--tokens",
                          "16", "--set", f"tp={world}", "--evidence", str(tmp_path / "ev"), "--json", str(summary)],
                         monkeypatch, capsys)
    assert code == 0, out + err
    arms = {a["arm"]: a for a in json.loads(summary.read_text())["arms"]}
    controls = {"partial", "paged-partial", "deltanet-chunks", "all-reduce"}
    assert set(arms) == {"whole", "paged-alone", "paged", "paged-all", "chunked", "preempted", "drafted",
                         "drafted-model"} | controls
    for name, arm in arms.items():
        assert arm["verdict"] == ("RED" if name in controls else "EXACT"), (name, arm["note"])
    assert arms["preempted"]["preemptions"] > 0


def test_plan_lines_count_each_rank(tiny_dirs, monkeypatch, capsys):
    code, out, err = tfq(["plan", "--model", str(tiny_dirs["qwen2"]), "--set", "tp=3", "--set", "window=512"],
                         monkeypatch, capsys)
    assert code == 0, err
    text = out + err
    assert "tp: 3 ranks (set by --set)" in text and "(1 + 1 + 0; 1 rank holds no attention head" in text
    assert "a rank holds: weights" in text and "cache" in text
    assert "gathered: 1536 floats a row over the 2 layers" in text  # each: 4 x 64 + 2 x 128 + 256
    code, out, err = tfq(["plan", "--model", str(tiny_dirs["qwen2"]), "--set", "tp=0"], monkeypatch, capsys)
    assert code == 2 and "tp must be a positive integer" in err and len(err.strip().splitlines()) == 1


def test_together_cli_at_tp_2_and_its_control(tiny_dirs, tiny_models, tmp_path, monkeypatch, capsys):
    suite = tmp_path / "suite.yaml"
    suite.write_text(yaml.safe_dump(random_suite(random.Random(4), tiny_models["qwen2"].tokenizer)))
    args = ["together", "--suite", str(suite), "--model", str(tiny_dirs["qwen2"]), "--set", "window=512",
            "--set", "lanes=4", "--set", "budget=1GiB", "--tokens", "4"]
    code, out, err = tfq(args + ["--set", "tp=2", "--arms", "whole,paged,all-reduce", "--evidence",
                                 str(tmp_path / "ev"), "--json", str(tmp_path / "s.json")], monkeypatch, capsys)
    assert code == 0, out + err
    summary = json.loads((tmp_path / "s.json").read_text())
    assert {a["arm"]: a["verdict"] for a in summary["arms"]} == {"whole": "EXACT", "paged": "EXACT",
                                                                  "all-reduce": "RED"}
    code, out, err = tfq(args + ["--arms", "all-reduce", "--evidence", str(tmp_path / "ev2")], monkeypatch, capsys)
    assert code == 2 and "run it with --set tp=2" in err


def test_chat_at_tp_2_answers_as_one_process(tiny_dirs):
    def chat(*extra):
        r = subprocess.run([sys.executable, "-m", "tfq", "chat", "-p", "hello there", "-p", "def f(x):", "--model",
                            str(tiny_dirs["qwen3"]), "--set", "window=256", "--set", "lanes=2", "--max-tokens", "12",
                            "--quiet", *extra], capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert r.returncode == 0, r.stderr
        return r.stdout

    assert chat("--set", "tp=2") == chat()


def test_serve_at_tp_2_under_load_equals_one_process(tiny_dirs, tiny_models):
    """`tfq serve`'s engine on a model split over 2 ranks, under test_serve's load (32 calls, streamed and not,
    n = 2, sampled, preempted): every reply and its digests equal one process's."""
    import asyncio

    from serve_load import calls, differences, fire
    from tfq.plan.resolve import resolve_plan
    from tfq.serve.background import build_served, serving

    plan, _, layout = resolve_plan(str(ROOT / "plans" / "tiny.yaml"), str(tiny_dirs["qwen2"]), ["kv.pool=8"], True,
                                   None)
    load = calls(seed=0)
    replies = {}
    for name, loaded in (("one", tiny_models["qwen2"]),
                         ("tp2", load_model(str(tiny_dirs["qwen2"]), progress=False, tp=2))):
        with serving(build_served(plan, layout, loaded, "tiny")) as base:
            replies[name] = asyncio.run(fire(base, "tiny", load))
    assert differences(replies["tp2"], replies["one"], load) == []
    assert all(r[0]["digests"] for r in replies["tp2"])


def test_every_rank_proves_its_own_shard(tiny_dirs):
    """The start-up guard runs on every rank (each its own shard, at its own thread count) whenever rank 0's runs,
    and a rank's refusal reaches rank 0 as its one line: here a rank asked to prove an arithmetic that does not
    exist refuses by construction."""
    loaded = load_model(str(tiny_dirs["qwen2"]), progress=False, tp=3)
    with loaded.model.on_its_own(("fp32", False, 40, 20, 1)) as refused:
        pass
    assert refused == []
    with loaded.model.on_its_own(("no-such-dtype", False, 40, 20, 1)) as refused:
        pass
    assert [line.split(":")[0] for line in refused] == ["rank 1", "rank 2"]
    assert all("start-up guard could not run" in line and "\n" not in line for line in refused)


def test_a_rank_that_dies_is_one_line_not_a_hang(tiny_dirs):
    """A rank killed mid-run: rank 0 stops the others at once (they idle in a receive and would not notice; a
    collective could then wait through them for gloo's 30 minutes), and its next forward says so in one line (a
    TfqError), instead of waiting on a collective or printing a traceback."""
    from tfq.engine.stream import Request
    from tfq.parallel.ranks import ranks

    loaded = load_model(str(tiny_dirs["qwen2"]), progress=False, tp=4)  # a group of its own: no other test's
    engine = engines.engine(loaded.model, window=128, lanes=2)
    assert engine.generate([Request(prompt=(1, 2, 3), max_tokens=2)])[0].finish == "length"
    group = ranks(4, torch.device("cpu"))
    group.processes[1].kill()
    group.processes[1].wait()
    for p in group.processes[2:]:  # stopped by rank 0's watch; left alone they would wait for its next message
        p.wait(timeout=120)
    with pytest.raises(TfqError, match="a tensor-parallel rank stopped") as e:
        engine.generate([Request(prompt=(1, 2, 3), max_tokens=2)])
    assert "\n" not in str(e.value)
    group.stop()


# -- Ctrl-C and the group's trust: ranks in their own session ignoring SIGINT, Ctrl-C held to a forward's end on
# rank 0, the store bound before its port is handed out, ranks admitted by the run's secret, messages signed

class Mkdir:
    """A pickle whose unpickling makes a folder: the sign that a message was read."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return os.mkdir, (self.path,)


def test_a_message_is_unpickled_only_under_the_runs_mac(tmp_path):
    from tfq.parallel.sealing import opened, sealed

    secret = secrets.token_bytes(32)
    payload = pickle.dumps(("stop", Mkdir(tmp_path / "read")))
    changed = bytearray(sealed(secret, 1, payload))
    changed[40] ^= 1
    forged = [sealed(secrets.token_bytes(32), 1, payload), bytes(changed), payload, sealed(secret, 1, payload)[:31],
              sealed(secret, 2, payload)]  # the last: signed, but as another message's payload
    for data in forged:
        with pytest.raises(TfqError, match="failed its HMAC check") as e:
            opened(secret, 1, data)
        assert "\n" not in str(e.value) and not (tmp_path / "read").exists()
    assert opened(secret, 1, sealed(secret, 1, payload)) == ("stop", None)  # the control: signed, it is read
    assert (tmp_path / "read").is_dir()


@pytest.mark.parametrize("signed", [True, False])
def test_a_rank_refuses_a_message_not_signed_with_the_runs_secret(signed, tmp_path, monkeypatch):
    """A real rank: a message under another key is refused in one line, unread (no folder), and the rank exits
    1; the same message signed with the run's secret is read (the folder) and obeyed (its stop). The rank is
    started when the store already listens on the port it is given."""
    import tfq.parallel.ranks as ranks_module

    real = ranks_module.start_rank

    def start_rank(rank, world, port, *args, **kw):
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))
        return real(rank, world, port, *args, **kw)

    monkeypatch.setattr(ranks_module, "start_rank", start_rank)
    group, (rank,) = ranks_module.start_group(2, torch.device("cpu"), stderr=subprocess.PIPE)
    key = group.secret if signed else secrets.token_bytes(32)
    payload = pickle.dumps(("stop", Mkdir(tmp_path / "read")))
    try:
        group.broadcast([ranks_module.header(key, 1, len(payload)), ranks_module.sealed(key, 1, payload)])
    except TfqError:  # the rank refused the header and left before the payload went
        assert not signed
    assert rank.wait(timeout=120) == (0 if signed else 1)
    err = rank.stderr.read().decode().strip().splitlines()
    assert (tmp_path / "read").is_dir() == signed
    if not signed:
        assert len(err) == 1 and err[0].startswith("tfq rank 1: a message failed its HMAC check"), err


def test_the_store_listens_before_its_port_is_handed_out_and_admits_only_the_secret():
    from tfq.parallel.ranks import TIMEOUT, admit, joined_key, listening_store, proof, start_rank

    store = listening_store(2)
    with socket.socket() as other, pytest.raises(OSError):
        other.bind(("127.0.0.1", store.port))  # taken from the start: no other process can take it
    with socket.socket() as s:  # the control: a free port found and released, the old way, can be taken
        s.bind(("127.0.0.1", 0))
        released = s.getsockname()[1]
    with socket.socket() as other:
        other.bind(("127.0.0.1", released))

    secret = secrets.token_bytes(32)
    stranger = torch.distributed.TCPStore("127.0.0.1", store.port, 2, False, timeout=TIMEOUT)
    stranger.set(joined_key(1), proof(secrets.token_bytes(32), 1))
    waiting = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    with pytest.raises(TfqError, match="does not know this run's secret joined as tensor-parallel rank 1") as e:
        admit(store, secret, [waiting])
    assert "\n" not in str(e.value)
    stranger.set(joined_key(1), proof(secret, 1))
    admit(store, secret, [waiting])  # the control: the run's proof is taken
    waiting.communicate(b"")

    store = listening_store(2)  # a rank that cannot read the secret exits; rank 0 says so instead of waiting
    rank = start_rank(1, 2, store.port, torch.device("cpu"), b"short", stderr=subprocess.PIPE)
    with pytest.raises(TfqError, match=r"rank 1 exited \(code 1\) before joining"):
        admit(store, secret, [rank])
    assert rank.stderr.read().decode().strip().splitlines() == [
        "tfq rank 1: got 5 bytes of the run's secret on stdin, not 32; ranks are started by rank 0 (tp: N), not by "
        "hand"]


@pytest.fixture
def interruptible():
    """Ctrl-C as a terminal's foreground process has it: a background job (CI, `cmd &`) starts with SIGINT ignored."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_waits_for_the_end_of_the_block(interruptible):
    from tfq.parallel.ranks import sigint_deferred

    reached = []
    with pytest.raises(KeyboardInterrupt):
        with sigint_deferred():
            signal.raise_signal(signal.SIGINT)
            reached.append("after the signal")
        reached.append("after the block")
    assert reached == ["after the signal"] and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with sigint_deferred():  # no Ctrl-C: nothing raised
        pass
    with pytest.raises(KeyboardInterrupt):  # the control: without it, the interrupt lands at once
        signal.raise_signal(signal.SIGINT)
        reached.append("never")
    assert reached == ["after the signal"]

    seen = []

    def off_main():  # signals never land here, and signal.signal would refuse: nothing is installed
        with sigint_deferred():
            seen.append(signal.getsignal(signal.SIGINT))

    thread = threading.Thread(target=off_main)
    thread.start()
    thread.join()
    assert seen == [signal.default_int_handler]


@pytest.fixture(scope="module")
def pair(tiny_dirs):
    """A tp 2 group of its own (not the one the other tests share) holding the tiny qwen3's shards."""
    from tfq.model.load import load_shard
    from tfq.parallel.ranks import ModelSpec, Ranks

    group = Ranks(2, torch.device("cpu"))
    yield group, group.load(ModelSpec(str(tiny_dirs["qwen3"]), "cpu", "auto"), load_shard, False).model
    group.stop()


def two_streams(model):
    """Two short streams together on `model`, logits kept: what a rank group's forwards are compared by."""
    from tfq.engine.stream import Request

    requests = [Request(prompt=tuple(range(7, 30)), max_tokens=4), Request(prompt=(5, 3, 9), max_tokens=4)]
    return engines.run(model, requests, window=128, lanes=2, keep_logits=True)


def test_ranks_ignore_sigint_in_their_own_session(pair, tiny_models):
    """Ctrl-C goes to the terminal's foreground process group: rank 1 is not in it (a session of its own), and
    SIGINT sent to its group or to it directly leaves it running: the next forwards give one process's bits."""
    group, model = pair
    rank = group.processes[0]
    assert os.getsid(rank.pid) == rank.pid != os.getsid(0) and os.getpgid(rank.pid) != os.getpgrp()
    assert int(rank.args[-2]) == group.group.store.port  # the port of the store rank 0 already listens on
    os.killpg(rank.pid, signal.SIGINT)
    os.kill(rank.pid, signal.SIGINT)
    assert all_same(two_streams(model), two_streams(tiny_models["qwen3"].model))
    assert rank.poll() is None
    # the control: a Python process started the same way that does not ignore SIGINT dies of the same signal. It is
    # sent once the child says it runs: in the interpreter's start-up a SIGINT fails the start (exit 1) instead
    other = subprocess.Popen([sys.executable, "-c", "import sys; print('ready', flush=True); sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             start_new_session=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as from a terminal
    assert other.stdout.readline() == b"ready\n"
    os.killpg(other.pid, signal.SIGINT)
    assert other.wait(timeout=60) == -signal.SIGINT


def test_ctrl_c_in_a_forward_lands_after_it_and_the_group_stays_in_step(pair, tiny_models, monkeypatch,
                                                                        interruptible):
    """SIGINT raised on rank 0 between two of a forward's gathers: the forward runs to its last gather (the
    logits) before KeyboardInterrupt reaches the caller, so the next forward finds the ranks in step and gives
    one process's bits. Without the hold the interrupt lands inside the gather, in the middle of the forward."""
    group, model = pair
    real, calls = group.group.gather, []

    def gather(t: torch.Tensor, widths: list[int]) -> torch.Tensor:
        calls.append(widths)
        if len(calls) == 3:
            signal.raise_signal(signal.SIGINT)
            calls.append("Ctrl-C")
        return real(t, widths)

    monkeypatch.setattr(group.group, "gather", gather)
    with pytest.raises(KeyboardInterrupt):
        two_streams(model)
    after = calls[calls.index("Ctrl-C") + 1:]
    assert after[-1] == model.widths["head"] and "Ctrl-C" not in after
    assert all_same(two_streams(model), two_streams(tiny_models["qwen3"].model))
    assert group.processes[0].poll() is None


# -- issue 46, point 5: every message numbered and its length signed, gloo on loopback, a fault on rank 0 tears
# the group down instead of leaving it out of step

class Wire:
    """The process group's broadcasts without processes: rank 0's recorded as bytes (`sent`, one entry a
    broadcast), or a rank's filled from `stream`, whatever a test puts there (`asked`: the bytes each read
    wanted, so a test sees what a rank allocated)."""

    def __init__(self, stream: bytes | None = None):
        self.stream = None if stream is None else bytearray(stream)
        self.sent: list[bytes] = []
        self.asked: list[int] = []

    def broadcast(self, t: torch.Tensor, root: int):
        raw = t.view(-1).view(torch.uint8)
        if self.stream is None:
            self.sent.append(raw.numpy().tobytes())
        else:
            self.asked.append(raw.numel())
            chunk, self.stream = self.stream[:raw.numel()], self.stream[raw.numel():]
            assert len(chunk) == raw.numel(), "the rank read past what rank 0 sent"
            raw.copy_(torch.frombuffer(bytearray(chunk), dtype=torch.uint8))
        return Wire  # Wire.wait() below: the broadcast is done

    @staticmethod
    def wait(timeout=None):
        pass


def _wired(secret: bytes, stream: bytes | None = None):
    """A group's end (rank 0's sending, or a rank's reading `stream`) whose broadcasts go over a Wire."""
    from tfq.parallel.ranks import Group, listening_store

    group = Group(0, 1, listening_store(1), torch.device("cpu"), secret)
    group.pg = Wire(stream)
    return group


def _frames(group, message) -> bytes:
    """The bytes rank 0's `group` puts on the wire to send `message`."""
    group.pg.sent.clear()
    group.send(message)
    return b"".join(group.pg.sent)


@pytest.mark.parametrize("order", ["replayed", "reordered"])
def test_a_replayed_or_reordered_message_is_refused_unread(order, tmp_path):
    """Rank 0's messages, each signed: a rank takes them once and in the order sent. A message replayed after
    it was read, or one taken before the message sent ahead of it, is refused in one line and never unpickled
    (no folder); the control, the messages in order, is read."""
    secret = secrets.token_bytes(32)
    rank0 = _wired(secret)
    first, second = (_frames(rank0, ("stop", Mkdir(tmp_path / name))) for name in ("first", "second"))
    stream = first + second + first if order == "replayed" else second + first
    rank = _wired(secret, stream)
    if order == "replayed":
        assert rank.receive() == rank.receive() == ("stop", None)  # the control: in order, both are read
        os.rmdir(tmp_path / "first")
        os.rmdir(tmp_path / "second")
    with pytest.raises(TfqError, match=r"replayed or out of order") as e:
        rank.receive()
    assert "\n" not in str(e.value) and not list(tmp_path.iterdir())


class Recorder:
    """Rank 0's process group, every broadcast kept (a copy) before it goes out: what a listener on the wire
    could replay."""

    def __init__(self, pg):
        self.pg, self.sent = pg, []

    def broadcast(self, t: torch.Tensor, root: int):
        self.sent.append(t.clone())
        return self.pg.broadcast(t, root)

    def __getattr__(self, name):
        return getattr(self.pg, name)


def test_a_real_rank_refuses_a_replayed_message(tmp_path):
    """A real rank reads a signed message (a load it cannot do, so it answers rank 0 with its reason); the same
    bytes broadcast again are refused in one line and the rank exits 1, instead of obeying it a second time
    (a replayed forward would write stale keys and values)."""
    from tfq.parallel.ranks import ModelSpec, start_group

    group, (rank,) = start_group(2, torch.device("cpu"), stderr=subprocess.PIPE)
    try:
        group.pg = Recorder(group.pg)
        group.send(("load", ModelSpec(str(tmp_path / "no-model"), "cpu", "auto")))
        assert group.agree("")[1].startswith("rank 1")  # read and obeyed once: it could not load, and said so
        recorded, group.pg = group.pg.sent, group.pg.pg
        for t in recorded:
            try:
                group.pg.broadcast(t, 0).wait()
            except RuntimeError:  # the rank refused the first part and left
                break
        assert rank.wait(timeout=60) == 1
        err = rank.stderr.read().decode().strip().splitlines()
        assert len(err) == 1 and err[0].startswith("tfq rank 1: ") and "replayed or out of order" in err[0], err
    finally:
        rank.kill()


def test_a_forged_or_oversized_length_is_refused_before_anything_is_allocated():
    """A message's length is read only once its MAC is checked: 2^40 bytes announced under a forged MAC, or
    under the run's own secret but over the bound, is refused in one line and the rank never asks for more
    than the fixed-size header (a rank that allocated first would take a terabyte)."""
    import struct

    secret = secrets.token_bytes(32)
    forged = _wired(secret, struct.pack("<qq", 2 ** 40, 1) + secrets.token_bytes(32))
    with pytest.raises(TfqError, match="failed its HMAC check") as e:
        forged.receive()
    assert "\n" not in str(e.value) and forged.pg.asked == [48]

    from tfq.parallel.sealing import MAX_MESSAGE, header

    big = _wired(secret, header(secret, 1, MAX_MESSAGE + 1))
    with pytest.raises(TfqError, match=f"{MAX_MESSAGE + 1} bytes") as e:
        big.receive()
    assert "\n" not in str(e.value) and big.pg.asked == [48]
    rank0 = _wired(secret)  # the control: rank 0's own message, of any length up to the bound, is read
    assert _wired(secret, _frames(rank0, ("load", "x" * 100_000))).receive() == ("load", "x" * 100_000)


def _listening() -> set[tuple[str, int]]:
    """(address, port) of every TCP socket this process listens on (IPv4), from /proc."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for line in Path("/proc/self/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
            address, port = fields[1].split(":")
            found.add((socket.inet_ntoa(bytes.fromhex(address)[::-1]), int(port, 16)))
    return found


def _an_interface() -> tuple[str, str] | None:
    """A network interface of this machine other than loopback, and its IPv4 address (None: none has one)."""
    import fcntl
    import struct

    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
        address = socket.inet_ntoa(packed[20:24])
        if not address.startswith("127."):
            return name, address
    return None


def _group_listens(secret: bytes) -> set[tuple[str, int]]:
    from tfq.parallel.ranks import Group, listening_store

    before = _listening()
    group = Group(0, 1, listening_store(1), torch.device("cpu"), secret)
    opened = _listening() - before
    del group
    return opened


@pytest.mark.skipif(not Path("/proc/self/net/tcp").exists(), reason="reads the listening sockets from /proc")
def test_gloo_listens_on_loopback_unless_tfq_is_told_an_interface(monkeypatch):
    """Every rank runs on this machine, so gloo's connections stay on 127.0.0.1: not where the hostname
    resolves, nor on an interface GLOO_SOCKET_IFNAME names for other jobs. TFQ_TP_INTERFACE names another (the
    control: the group then listens there); one that does not exist is one line."""
    monkeypatch.delenv("TFQ_TP_INTERFACE", raising=False)
    other = _an_interface()
    if other is not None:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", other[0])
    opened = _group_listens(secrets.token_bytes(32))
    assert opened and {address for address, _ in opened} == {"127.0.0.1"}, opened
    if other is not None:
        monkeypatch.setenv("TFQ_TP_INTERFACE", other[0])
        assert other[1] in {address for address, _ in _group_listens(secrets.token_bytes(32))}
    monkeypatch.setenv("TFQ_TP_INTERFACE", "no-such-if0")
    with pytest.raises(TfqError, match="TFQ_TP_INTERFACE=no-such-if0") as e:
        _group_listens(secrets.token_bytes(32))
    assert "\n" not in str(e.value)


def _within(seconds: float, run):
    """run()'s result or the exception it raised, or the test fails when it has not ended in `seconds` (a
    forward waiting on a collective for ever)."""
    done: list = []

    def target():
        try:
            done.append(run())
        except BaseException as e:  # noqa: BLE001 - handed to the test to look at
            done.append(e)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"still running after {seconds:g} s: the group was left out of step and the forward hangs")
    return done[0]


def test_a_fault_on_rank_0_between_collectives_tears_the_group_down(tiny_dirs, tiny_models, monkeypatch):
    """Rank 0 raises between two of a forward's gathers, the other rank already waiting in the next: the fault
    reaches the caller, the ranks are stopped, and the next forward on that group is refused in one line at
    once (never a wait on a gather rank 0 left). Loading the model again builds a new group, whose forwards
    give one process's bits."""
    import tfq.parallel.ranks as ranks_module

    key = (2, "cpu", None)  # the group tfq starts on this machine (not placed by Ray)
    monkeypatch.delitem(ranks_module._RANKS, key, raising=False)  # a group of this test's own
    folder = str(tiny_dirs["qwen3"])
    model = load_model(folder, progress=False, tp=2).model
    group = ranks_module._RANKS[key]
    try:
        real, calls = model.group.gather, []

        def gather(t: torch.Tensor, widths: list[int]) -> torch.Tensor:
            calls.append(widths)
            if len(calls) == 3:
                raise RuntimeError("a fault on rank 0 between two gathers")
            return real(t, widths)

        monkeypatch.setattr(model.group, "gather", gather)
        with pytest.raises(Unservable, match="tore the tensor-parallel group down .RuntimeError: a fault on rank 0 "
                                             "between two gathers"):
            two_streams(model)
        monkeypatch.setattr(model.group, "gather", real)
        after = _within(30, lambda: two_streams(model))
        assert isinstance(after, Unservable) and "torn down" in str(after) and "\n" not in str(after), after
        assert all(p.poll() is not None for p in group.processes)  # no rank left waiting in a gather
        again = load_model(folder, progress=False, tp=2).model
        assert again.group is not model.group
        assert all_same(two_streams(again), two_streams(tiny_models["qwen3"].model))
    finally:
        for p in group.processes:  # a forward left hanging (without the fix) ends when its peers do
            p.kill()
        if key in ranks_module._RANKS:
            ranks_module._RANKS[key].stop()
