"""The engine on the Triton backend (on CUDA, or under TRITON_INTERPRET=1 on the CPU): its row-wise kernels
are batch-invariant in bits, and a stream's ids and logits bits are the same alone, together, paged,
chunked and drafted; the controls must come out RED. Shapes stay tiny: the interpreter is slow."""
from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernels' import (read when they are decorated)

from engines import alone, run, same  # noqa: E402
from tfq.engine.core import EngineSettings  # noqa: E402
from tfq.engine.runner import paged_partial  # noqa: E402
from tfq.engine.stream import Request  # noqa: E402
from tfq.errors import TfqError  # noqa: E402
from tfq.kernels.backend import torch_backend, triton_backend  # noqa: E402
from tfq.kernels.rowwise import rms_norm as torch_rms_norm  # noqa: E402
from tfq.model.config import ModelConfig  # noqa: E402
from tfq.model.kernel_guard import check_rows  # noqa: E402
from tfq.model.qwen import Qwen  # noqa: E402
from tfq.model.weights import load_state_dict  # noqa: E402
from tfq.proofs.case import same_bits  # noqa: E402
from tiny import write_tiny_checkpoint  # noqa: E402

BACKEND, WHY = triton_backend()
pytestmark = pytest.mark.skipif(BACKEND is None, reason=WHY)
DEV = BACKEND.device if BACKEND is not None else torch.device("cpu")


# -- the row-wise kernels ----------------------------------------------------------------------------------

@pytest.mark.parametrize("n_in,n_out,bias", [(96, 70, True), (200, 33, False)])
def test_linear_rows_do_not_depend_on_the_batch(n_in, n_out, bias):
    g = torch.Generator().manual_seed(n_in)
    w = torch.randn(n_out, n_in, generator=g)
    b = torch.randn(n_out, generator=g) if bias else None
    f = BACKEND.linear(w.to(DEV), None if b is None else b.to(DEV))
    x = torch.randn(20, n_in, generator=g)
    full = f(x.to(DEV)).cpu()
    for m in (1, 2, 3, 7, 16, 17):
        assert same_bits(f(x[:m].to(DEV)).cpu(), full[:m])
    order = torch.randperm(20, generator=g)  # every row at another place in the batch
    assert same_bits(f(x[order].to(DEV)).cpu(), full[order])
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    bound = 2 * n_in * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T).max()
    assert (full.double() - exact).abs().max() <= bound


def test_the_guard_catches_a_linear_whose_rows_depend_on_the_batch():
    """Control: a Triton linear that, like cuBLAS, takes another kernel for bigger batches must be refused by the
    start-up guard, and the one tfq runs accepted. The other kernel is built to round differently (every
    output one step of 2**-20 apart), so the control fails by construction, whatever numpy's matmul does."""
    from tfq.kernels.triton_rowwise import TritonLinear

    g = torch.Generator().manual_seed(5)
    w, b = torch.randn(64, 96, generator=g).to(DEV), torch.randn(64, generator=g).to(DEV)
    tfq_linear = TritonLinear(w, b)
    check_rows(tfq_linear, 96, "tfq's", rows=24, g=torch.Generator().manual_seed(1), device=DEV)

    def by_batch(x: torch.Tensor) -> torch.Tensor:
        y = tfq_linear(x)
        return y if len(x) <= 8 else y * (1 + 2.0 ** -20)

    with pytest.raises(TfqError, match="not batch-invariant"):
        check_rows(by_batch, 96, "a kernel picked by batch size", rows=24, g=torch.Generator().manual_seed(1),
                   device=DEV)


def test_rms_norm_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(12, 5, 72, generator=g), torch.randn(72, generator=g)
    full = BACKEND.rms_norm(x.to(DEV), w.to(DEV), 1e-6).cpu()
    assert same_bits(BACKEND.rms_norm(x[:1].to(DEV), w.to(DEV), 1e-6).cpu(), full[:1])
    assert same_bits(BACKEND.rms_norm(x.flip(0).to(DEV), w.to(DEV), 1e-6).cpu(), full.flip(0))
    assert (full - torch_rms_norm(x, w, 1e-6)).abs().max() <= 1e-5 * (1 + full.abs().max())


# -- the engine --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """family -> (Triton model, torch model) on one tiny random checkpoint."""
    out = {}
    for family, seed in (("qwen2", 11), ("qwen3", 12)):
        folder = write_tiny_checkpoint(tmp_path_factory.mktemp(family), family=family, tie=family == "qwen3",
                                       seed=seed, hidden=64, heads=8, kv_heads=2, head_dim=32, intermediate=128,
                                       vocab=300)
        config, weights = ModelConfig.from_folder(folder), load_state_dict(folder)
        out[family] = (Qwen(config, weights, BACKEND), Qwen(config, weights, torch_backend()))
    return out


def _requests(lengths, seed=0, tokens=5):
    g = torch.Generator().manual_seed(seed)
    return [Request(tuple(torch.randint(3, 290, (n,), generator=g).tolist()), max_tokens=tokens,
                    label=f"r{i}") for i, n in enumerate(lengths)]


SMALL = dict(settings=EngineSettings(window=384, lanes=1), keep_logits=True)  # engine()'s: rows cost here


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_a_stream_is_the_same_alone_together_paged_chunked_and_drafted(models, family):
    from tfq.engine.draft import NgramDrafter

    triton_model, torch_model = models[family]
    requests = _requests((5, 70, 20), seed=len(family))
    alone_runs = alone(triton_model, requests, **SMALL)
    arms = {  # few arms, each covering several ways: the interpreter pays per program
        "together, stream 0 in a lane and the others paged, chunked by 16, drafted":
            run(triton_model, requests, **SMALL, lanes=3, page_rows=64, pool_pages=12, prefill_chunk=16,
                drafter=NgramDrafter(3)),
        "all paged, shuffled pages, chunked by 7": run(triton_model, requests, **SMALL, lanes=3, page_rows=64,
                                                       pool_pages=12, paged_all=True, prefill_chunk=7,
                                                       page_order_seed=3),
    }
    for name, results in arms.items():
        for a, b in zip(alone_runs, results):
            assert same(a, b), f"{name}: {a.label} differs from its run alone"
    # not exactness but sanity: the Triton arithmetic computes the same model as the torch one
    for a, ref in zip(alone_runs, run(torch_model, requests, **SMALL, lanes=3)):
        worst = max((x - y).abs().max().item() for x, y in zip(a.logits, ref.logits))
        assert worst < 1e-4, worst


def test_controls_are_red(tmp_path):
    """partial differs from rows for a stream past one split, and so does the paged/partial split for a
    stream beside a paged one (one layer: a 262-row prompt is slow in the interpreter)."""
    folder = write_tiny_checkpoint(tmp_path / "one", family="qwen2", seed=13, layers=1, hidden=64, heads=8,
                                   kv_heads=2, head_dim=32, intermediate=128, vocab=300)
    # the controls are about attention: under the interpreter (which runs a 262-row linear as 262 programs) only
    # its Triton kernels run, the linear layers and norms being the CPU's; on a GPU the whole Triton backend runs
    cpu = torch_backend()
    backend = BACKEND if DEV.type == "cuda" else replace(BACKEND, name="triton-attention", linear=cpu.linear,
                                                         rms_norm=cpu.rms_norm)
    model = Qwen(ModelConfig.from_folder(folder), load_state_dict(folder), backend)
    long, short = _requests((262, 9), seed=7, tokens=2)
    rows = run(model, [long], **SMALL)[0]
    assert not same(rows, run(model, [long], **SMALL, partial=True)[0])
    split = run(model, [long, short], **SMALL, lanes=2, page_rows=64, pool_pages=8, arithmetic=paged_partial)[0]
    assert not same(rows, split)
