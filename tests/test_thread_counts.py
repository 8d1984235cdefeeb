"""The exactness rule at every thread count: a stream's ids and logits bits are the same alone or together,
paged, chunked, preempted or drafted, at 1, 2, 3, 4, 5, 8 and 16 threads, against its run alone on 1 thread.

The models here are tiny but their MLP is as wide as the default model's (4864), so torch really splits
their elementwise ops into one chunk per thread: that is where `F.silu` gives a row other bits at 3 threads.
The controls show that an activation with that flaw makes the same comparisons RED, and that the start-up
guard refuses it with one line naming the op and the thread count.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engines import all_same, alone, engine, one_by_one, run, same
from tfq.engine.core import EngineSettings
from tfq.engine.draft import NgramDrafter
from tfq.engine.layer_guard import LayerProof
from tfq.engine.stream import Request
from tfq.errors import TfqError
from tfq.kernels.contract import KEY_TILE
from tiny import write_tiny_checkpoint

COUNTS = (1, 2, 3, 4, 5, 8, 16)
WIDE = 4864  # the default model's MLP width: 4864 / 3 is not a whole number of 16-float vectors


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def wide(request, tmp_path_factory):
    from tfq.model.load import load_model

    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("wide") / request.param, family=request.param,
                                   seed=9, layers=2, hidden=64, heads=2, kv_heads=1, head_dim=32,
                                   intermediate=WIDE)
    return load_model(str(folder), progress=False).model


@pytest.fixture
def threads():
    """Set the thread count inside a test; the count before it comes back after."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def requests() -> list[Request]:
    g = torch.Generator().manual_seed(31)
    motif = torch.randint(3, 500, (6,), generator=g).tolist()  # repeats give the n-gram drafter guesses
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (3, 45, 150)]
    prompts.append(motif * 12)
    return [Request(tuple(p), max_tokens=10) for p in prompts]


ARMS = {  # engine()'s arguments (NgramDrafter keeps nothing between runs: one serves every run)
    "whole": dict(settings=EngineSettings(window=256, lanes=4, prefill_chunk=512)),
    "paged, chunked": dict(settings=EngineSettings(window=256, lanes=4, prefill_chunk=13, page_rows=KEY_TILE,
                                                   paged_all=True, pool_pages=16), page_order_seed=3),
    "preempted": dict(settings=EngineSettings(window=256, lanes=4, prefill_chunk=32, page_rows=KEY_TILE,
                                              paged_all=True, pool_pages=4)),
    "drafted": dict(settings=EngineSettings(window=256, lanes=4, prefill_chunk=64, page_rows=KEY_TILE,
                                            pool_pages=16), drafter=NgramDrafter(4)),
}


@pytest.fixture(scope="module")
def reference(wide):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return alone(wide, requests(), window=256, keep_logits=True)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("count", COUNTS)
def test_every_arm_equals_the_run_alone_on_one_thread(wide, reference, threads, count):
    threads(count)
    reqs = requests()
    for name, arm in ARMS.items():
        results = run(wide, reqs, keep_logits=True, **arm)
        for r, ref, got in zip(reqs, reference, results):
            assert got.error is None
            assert same(ref, got), f"{name} at {count} threads: a {len(r.prompt)}-token prompt's reply changed"
        if name == "preempted":
            assert sum(r.preempted for r in results) > 0
        if name == "drafted":
            assert sum(r.accepted for r in results) > 0
    assert all_same(reference, alone(wide, reqs, window=256, keep_logits=True))


def chunk_flaw(act):
    """The model's own activation with F.silu's flaw built in, so the control fails by construction on any
    build: the elements are split into one chunk per thread as torch splits them, and each chunk's last
    elements that do not fill a 16-float vector take another formula (here visibly another value)."""
    def flawed(x: torch.Tensor) -> torch.Tensor:
        flat = act(x).reshape(-1)
        n, t = flat.numel(), torch.get_num_threads()
        size = -(-n // t)
        for start in range(0, n, size):
            end = min(n, start + size)
            tail = (end - start) % 16
            if tail:
                flat[end - tail:end] *= 1 + 2 ** -8
        return flat.view_as(x)

    return flawed


def test_control_an_activation_with_the_chunk_flaw_changes_replies_at_3_threads(wide, reference, threads):
    """The guard runs when an engine is built; build it where the flawed op is harmless (1 thread: one chunk
    of whole rows), then run at 3 threads, as a build without the guard would."""
    threads(1)
    act = wide.act
    wide.act = chunk_flaw(act)
    try:
        e = engine(wide, ARMS["whole"]["settings"], keep_logits=True)
        threads(3)
        together = e.generate(requests())
        each = one_by_one(e, requests())
    finally:
        wide.act = act
    assert not all(same(a, b) for a, b in zip(each, together))  # RED: together differs from alone
    assert not all(same(a, b) for a, b in zip(reference, each))  # RED: 3 threads differ from 1


def test_the_guard_refuses_the_flawed_activation_naming_op_and_count(wide, threads):
    threads(3)
    act = wide.act
    wide.act = chunk_flaw(act)
    try:
        with pytest.raises(TfqError) as e:
            engine(wide, window=256, lanes=4, prefill_chunk=64, kv_dtype="bf16")
    finally:
        wide.act = act
    message = str(e.value)
    assert "silu" in message and "at 3 threads" in message and "\n" not in message


def test_the_guard_sees_what_f_silu_does_on_this_build(wide, threads):
    """`F.silu` is the op the issue found flawed at 3 threads here; whether this build's `F.silu` is, the guard's
    verdict must agree with a direct measurement of it on the same shapes."""
    threads(3)
    x = torch.randn(200, WIDE, generator=torch.Generator().manual_seed(1))
    full = F.silu(x)
    flawed = not all(torch.equal(F.silu(x[:m].clone()), full[:m]) for m in (1, 2, 3, 5, 7, 14, 17, 20, 33, 64))
    act = wide.act
    wide.act = F.silu
    try:
        failure = LayerProof(wide, "fp16", False).holds(3, 4 * 64, 64)
    finally:
        wide.act = act
    if flawed:
        assert failure is not None and failure.op == "silu"
    else:
        assert failure is None or failure.op == "silu"


def test_the_guard_proves_each_count_once_and_names_no_op_when_it_holds(wide, threads):
    threads(3)
    proof = LayerProof(wide, "fp32", True)
    assert proof.holds(3, 200, 50) is None and proof.holds(5, 200, 50, draws=5) is None
    assert proof.proved == {3: (200, 1), 5: (200, 5)}
    assert proof.holds(3, 100, 50) is None and proof.proved[3] == (200, 1)  # fewer rows: already proved
    assert proof.holds(3, 100, 50, draws=17) is None and proof.proved[3] == (100, 17)  # more drawing rows: again


def test_the_guard_refuses_a_penalty_that_follows_the_thread_count(wide, threads, monkeypatch):
    """The guard's draws include a penalized row and a masked one (tfq/engine/guard_draws.py); a penalty whose
    arithmetic follows the thread count (the control: the count picks which token it lifts) is refused at the
    second count, naming the sampler."""
    from tfq.decode.penalties import Penalties
    from tfq.engine import guard_draws

    class Drifting(Penalties):
        def apply(self, row, prompt, reply):
            out = super().apply(row, prompt, reply)
            out[reply[torch.get_num_threads() % len(reply)]] += 100.0
            return out

    proof = LayerProof(wide, "fp32", False)
    threads(1)
    assert proof.holds(1, 100, 50) is None
    monkeypatch.setattr(guard_draws, "PENALIZED", Drifting(**{f: getattr(guard_draws.PENALIZED, f) for f in
                                                              ("presence", "frequency", "repetition", "bias")}))
    threads(3)
    failure = proof.holds(3, 100, 50)
    assert failure is not None and failure.op == "sampler"
