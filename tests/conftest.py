"""Shared fixtures: tiny random checkpoints written by the tests and loaded through tfq's own loader."""
from __future__ import annotations

import os

import pytest
import torch

from tiny import write_tiny_checkpoint

# The most one process of the suite holds at once, with room (8.2-8.9 GB peak in full runs): a worker that holds the
# default model (session-scoped, for every slow test) reaching test_plan.py's budget test, which holds 4 GiB and must
# (its docstring says why). Peaks with -n 0 on 2026-12-05 (Zen 4, two cores, other jobs beside): test_plan.py
# 4.5 GB, test_quant.py 4.0 GB, the two in one process 6.5 GB; the largest files besides: test_verify.py 4.9 GB (its
# `tfq verify` child loads the fp32 model still holding the gguf one), test_forward.py 3.2 GB, test_structured.py
# 2.6 GB, test_together.py's default-model tests 1.7 GB. A worker that has run more default-model files holds more
# before it reaches test_plan.py.
WORKER_GIB = 9
MOST_WORKERS = 4  # past it the suite's time is its longest file's; more workers only oversubscribe the cores


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (pyproject's addopts): a worker a core, as many as the memory available holds, at most
    MOST_WORKERS. `-n 0` runs the suite in this one process."""
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable")) / 2 ** 20
    except (OSError, StopIteration):
        available = WORKER_GIB
    return max(1, min(os.cpu_count() or 1, int(available // WORKER_GIB), MOST_WORKERS))


# The files that take longest on two cores (`--durations`), longest first: the workers start them first and the
# quick files fill in behind, so the suite does not end on one worker running a long file alone. Only the order
# changes: a file missing here runs after them, in its usual place.
LONGEST_FIRST = ("test_instruction_sets.py", "test_together.py", "test_serve_default.py", "test_tp.py",
                 "test_triton_engine.py", "test_verify.py", "test_moe.py", "test_gguf_moe.py", "test_structured.py",
                 "test_gguf_hybrid.py", "test_chat.py", "test_kernel_check.py", "test_loading.py")


def pytest_collection_modifyitems(config, items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """family -> an HF folder with a tiny random model (qwen2: q/k/v bias, untied; qwen3: q/k norms, tied)."""
    root = tmp_path_factory.mktemp("tiny")
    return {
        "qwen2": write_tiny_checkpoint(root / "qwen2", family="qwen2", tie=False, seed=1),
        "qwen3": write_tiny_checkpoint(root / "qwen3", family="qwen3", tie=True, seed=2, heads=8, kv_heads=2),
    }


@pytest.fixture(scope="session")
def tiny_models(tiny_dirs):
    from tfq.model.load import load_model

    return {family: load_model(str(folder), progress=False) for family, folder in tiny_dirs.items()}


@pytest.fixture(scope="session")
def default_model():
    """The real default model as a plan loads it (weights: auto, so its GGUF blocks on tfq's CPU kernels, with
    activations in 8 bits: gguf-q8), loaded once for every slow test (its start-up proofs are kept on it too)."""
    from tfq.model.load import load_model

    return load_model("default", progress=False, weights="auto")


@pytest.fixture
def shared_default(monkeypatch, default_model):
    """`tfq` commands run in this process load the shared default model instead of loading it again."""
    import tfq.model.load as load

    real = load.load_model

    def load_model(spec: str, progress: bool = True, device="cpu", weights: str = "auto", tp: int = 1, **kw):
        if spec == "default" and str(device) == "cpu" and load.weights_kind(weights, spec)[0] == default_model.weights \
                and tp == 1 and not kw:
            return default_model
        return real(spec, progress=progress, device=device, weights=weights, tp=tp, **kw)

    monkeypatch.setattr(load, "load_model", load_model)
    return default_model


@pytest.fixture
def restored_threads(monkeypatch):
    """torch's thread count, and TFQ_THREADS (which --threads sets for the process), back after the test."""
    before = torch.get_num_threads()
    monkeypatch.delenv("TFQ_THREADS", raising=False)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def thinker(request, tiny_dirs, tmp_path_factory):
    """(family, folder, loaded): a tiny checkpoint of the family with a thinking chat template (tiny.TEMPLATES)."""
    from tfq.model.load import load_model
    from tiny import tiny_model_dir, write_thinking_model

    family = request.param
    source = tiny_dirs["qwen3"] if family == "qwen3" else tiny_model_dir(
        tmp_path_factory, "qwen3_5", layers=4, layer_types=("linear_attention", "full_attention") * 2)
    folder = write_thinking_model(source, tmp_path_factory.mktemp(f"thinking-{family}") / "model", family)
    return family, folder, load_model(str(folder), progress=False)
