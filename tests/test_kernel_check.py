"""The kernel check: passes on the torch and Triton backends, its controls come out RED, and it fails
(exit 1) on kernels with real bugs: a dropped key, noise between repeats, a stray store, a paged drift."""
from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before kernels.triton_attention is imported anywhere

import tfq.kernels.backend as backends  # noqa: E402
from cli import tfq
from tfq.kernels.attention import AttentionBatch, DecodeGroup  # noqa: E402
from tfq.kernels.attention import attend as torch_attend  # noqa: E402
from tfq.kernels.attention import write as torch_write
from tfq.kernels.backend import torch_backend  # noqa: E402
from tfq.kernels.quant import FORMATS  # noqa: E402
from tfq.proofs.kernel_check import CheckConfig, passed, run_check  # noqa: E402
from tfq.proofs.kernel_check_rowwise import MLX_CASES  # noqa: E402

SMALL = CheckConfig(dtypes=("fp32",), repeats=2)


def checks_and_controls(cases):
    return [c for c in cases if not c.control], [c for c in cases if c.control]


def test_torch_backend_passes_with_controls_red():
    cfg = CheckConfig()
    cases = run_check(cfg, [torch_backend()])
    plain, controls = checks_and_controls(cases)
    assert passed(cases)
    # stores and keep per dtype, queries and rows per attention kernel and dtype; five controls per dtype;
    # then the row-wise layers: two linear shapes and the norm, and one control; on tfq's kernels each GGUF
    # format's quantized layer, MLX's groups in its two roundings, each format with activations in 8 bits, and
    # two controls (fp32 weights one ulp off; one integer changed against the q8 recipe)
    quantized = 2 * len(FORMATS) + len(MLX_CASES) if torch_backend().quant_linear else 0
    assert len(plain) == len(cfg.dtypes) * (2 + 2 * len(cfg.attention)) + 3 + quantized
    assert len(controls) == 5 * len(cfg.dtypes) + 1 + 2 * (quantized > 0) and all(c.result == "RED" for c in controls)
    assert {c.kernel for c in plain} >= {"linear", "linear (down)", "rms norm"} | {f"linear {k}" for k in
                                                                                  FORMATS[:quantized]}
    assert {c.kernel for c in plain} >= ({"linear MLX 4-bit, bfloat16 scales", "linear MLX 8-bit, float32 scales"}
                                         | {f"linear {k}, activations q8" for k in FORMATS} if quantized else set())
    for c in plain:
        if c.bound is not None:
            assert c.worst <= c.bound
    off = [c for c in controls if c.check == "control: length + 1"]
    assert all(c.worst > 100 * c.bound for c in off)  # the canary key past the end is unmistakable


def test_triton_backend_passes_with_controls_red():
    backend, why = backends.triton_backend()
    if backend is None:
        pytest.skip(why)
    cases = run_check(replace(SMALL, dtypes=("fp8",)), [backend])  # the widest rounding, uint8 loads
    assert passed(cases), [(c.check, c.kernel, c.dtype, c.result, c.note) for c in cases if not c.ok]
    assert sum(c.control for c in cases) == 6


# -- mutants: kernels with real bugs must FAIL the check (not only the built-in controls) --------------------

def _mutant(attend=None, store=None, linear=None):
    b = torch_backend()
    return replace(b, name="mutant", attend=attend or b.attend, store=store or b.store, linear=linear or b.linear)


def _failures(backend, cfg=SMALL):
    cases = run_check(cfg, [backend])
    assert not passed(cases)
    return {(c.check, c.note) for c in cases if not c.ok and not c.control}


def test_a_dropped_key_fails_the_bound():
    def attend(q, k, v, batch, scale):
        d = batch.decode
        if d is not None:  # every decode row forgets its own key
            d = DecodeGroup(d.q_rows, d.cache_rows, (d.lengths - 1).clamp(min=1))
        return torch_attend(q, k, v, AttentionBatch(d, batch.chunks, batch.partial), scale)

    bad = _failures(_mutant(attend=attend))
    assert ("queries", "over the bound") in bad


def test_noise_between_repeats_fails():
    g = torch.Generator().manual_seed(0)

    def attend(q, k, v, batch, scale):
        out = torch_attend(q, k, v, batch, scale)
        return out + torch.randn(out.shape, generator=g) * 1e-9  # far inside the bound, not the same bits

    assert any("repeats differ" in note for _, note in _failures(_mutant(attend=attend)))


def test_a_paged_drift_fails_paged_equals_contiguous():
    def attend(q, k, v, batch, scale):
        tables = [c.cache_rows[:c.first_pos + c.count] for c in batch.chunks]
        if batch.decode is not None:
            tables += [t[:n] for t, n in zip(batch.decode.cache_rows, batch.decode.lengths)]
        lanes = all(bool((t[1:] - t[:-1] == 1).all()) for t in tables)
        return torch_attend(q if lanes else q * (1 + 2 ** -20), k, v, batch, scale)

    bad = _failures(_mutant(attend=attend))
    assert any(c == "queries" and "paged != contiguous" in n for c, n in bad)
    assert all("over the bound" not in n for _, n in bad)  # caught by bits alone


def test_a_stray_store_fails_keep_and_guards():
    def store(ck, cv, rows, k, v, dtype):
        torch_write(ck, cv, rows, k, v, dtype)
        torch_write(ck, cv, rows[:1] + 1, k[:1], v[:1], dtype)  # one extra row next to the first

    bad = _failures(_mutant(store=store))
    assert any(c == "keep" for c, _ in bad) and any("canary changed" in n for _, n in bad)


def test_a_batch_dependent_linear_fails():
    """torch's plain F.linear on this CPU: MKL gives a row other bits at other batch sizes (docs/contract.md)."""
    import torch.nn.functional as F

    plain = _mutant(linear=lambda w, b: (lambda x: F.linear(x, w, b)))
    bad = _failures(plain, replace(SMALL, kernels=("rowwise",)))
    assert any("a row's bits change with the batch" in n for _, n in bad)


# -- the command ----------------------------------------------------------------------------------------



def test_command_passes_and_writes_json(tmp_path, monkeypatch, capsys):
    path = tmp_path / "check.json"
    code, out, _ = tfq(["kernels", "--backend", "torch", "--dtype", "bf16", "--json", str(path)], monkeypatch, capsys)
    assert code == 0 and "kernel check passed" in out and "control: pages swapped" in out and "RED" in out
    report = json.loads(path.read_text())
    cache_cases = [c for c in report["cases"] if c["kernel"] in ("rows", "partial", "store")]
    assert report["passed"] and {c["dtype"] for c in cache_cases} == {"bf16"}
    assert {c["kernel"] for c in report["cases"]} >= {"linear", "linear (down)", "rms norm"}
    assert all(c["result"] in ("PASS", "RED") for c in report["cases"])


def test_command_exits_1_on_a_broken_kernel(monkeypatch, capsys):
    def store(ck, cv, rows, k, v, dtype):
        torch_write(ck, cv, rows + 1, k, v, dtype)  # every store one row off

    monkeypatch.setattr(backends, "torch_backend", lambda: _mutant(store=store))
    code, out, _ = tfq(["kernels", "--backend", "torch", "--dtype", "fp32", "--repeats", "1"], monkeypatch, capsys)
    assert code == 1 and "FAIL" in out and "kernel check failed" in out


@pytest.mark.parametrize("args,message", [
    (["--page-rows", "100"], "tfq: --page-rows 100 must be a multiple of the key tile (64)\n"),
    (["--lengths", "5,100"], "tfq: --lengths needs one stream longer than 256 rows (two splits and two pages, "
                             "for the controls), e.g. 5,130,290\n"),
    (["--dtype", "fp4"], "tfq: unknown cache dtype 'fp4'; choose from fp32, bf16, fp16, fp8\n"),
    (["--backend", "cuda"], "tfq: --backend 'cuda': choose torch or triton\n"),
])
def test_command_bad_input_is_one_line(args, message, monkeypatch, capsys):
    code, out, err = tfq(["kernels", *args], monkeypatch, capsys)
    assert code == 2 and err == message
