"""Models by their hub names, against a local server that speaks the hub's file API (tests/hub_server.py): `tfq chat
--model ORG/REPO` and `ORG/REPO-GGUF:QUANT` fetch into huggingface_hub's cache and reply as the same files given by
path; then, the server gone and HF_HUB_OFFLINE set, from the cache alone. A missing repository, a gated one without
its token, and a model not cached while offline: one line each, exit 2. Nothing reaches the network: every run has
HF_ENDPOINT set to the local server (or HF_HUB_OFFLINE)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hub_server import Repo, hub
from served import TINY_PLAN
from tiny import tiny_gguf

TOKEN = "hf_tiny_test_token"


def chat(model: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "tfq", "chat", "alpha beta gamma", "--model", model, "--plan", TINY_PLAN,
            "--max-tokens", "8", "--quiet"]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return subprocess.run(args, capture_output=True, text=True, timeout=600,
                          env={**clean, "TFQ_THREADS": "2", "HF_HUB_DISABLE_TELEMETRY": "1", **env})


def reply(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def files(tiny_dirs, tmp_path_factory):
    """(the tiny qwen2 folder, a quantized GGUF file of it, another GGUF file)."""
    return (tiny_dirs["qwen2"], tiny_gguf(tmp_path_factory, "qwen2", quantized=True),
            tiny_gguf(tmp_path_factory, "qwen2", quantized=False))


def test_hub_names_fetch_then_run_from_the_cache_offline(files, tmp_path):
    folder, q8, f32 = files
    ggufs = {"tiny-qwen2-Q8_0.gguf": q8.read_bytes(), "tiny-qwen2-F32.gguf": f32.read_bytes()}
    repos = {"tiny/qwen2": Repo.of_folder(folder), "tiny/qwen2-GGUF": Repo(ggufs),
             "tiny/gated": Repo.of_folder(folder, token=TOKEN)}
    home = {"HF_HOME": str(tmp_path / "hf")}
    want_folder, want_gguf = reply(chat(str(folder), home)), reply(chat(str(q8), home))
    with hub(repos) as (url, hits):
        online = {**home, "HF_ENDPOINT": url}
        assert reply(chat("tiny/qwen2", online)) == want_folder
        assert reply(chat("tiny/qwen2-GGUF:Q8_0", online)) == want_gguf
        assert any(h.endswith("tiny-qwen2-Q8_0.gguf") for h in hits)
        assert not any(h.endswith("F32.gguf") for h in hits)  # only the quantization named is fetched
        missing = chat("nobody/none", online)
        gated = chat("tiny/gated", online)
        assert reply(chat("tiny/gated", {**online, "HF_TOKEN": TOKEN})) == want_folder
        absent = chat("tiny/qwen2-GGUF:Q5_K_M", online)
        seen = len(hits)
    offline = {**home, "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": url}  # the server is gone too
    assert reply(chat("tiny/qwen2", offline)) == want_folder
    assert reply(chat("tiny/qwen2-GGUF:Q8_0", offline)) == want_gguf
    uncached = chat("tiny/other", offline)
    assert len(hits) == seen
    for done, words in ((missing, "nobody/none: no such model at"), (gated, "tiny/gated is gated"),
                        (absent, "has no .gguf file of quantization Q5_K_M"),
                        (uncached, "tiny/other is not in the cache")):
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and words in lines[0], done.stderr


def test_a_cached_hub_model_keeps_its_hub_name():
    """What the server calls a hub model, and what a receipt names it by: its hub name, not the cache's path."""
    from tfq.model.hub import hub_name
    from tfq.serve.background import served_name

    folder = "/home/u/.cache/huggingface/hub/models--Qwen--Qwen3-8B/snapshots/0123abcd"
    assert hub_name(folder) == "Qwen/Qwen3-8B" and served_name(folder) == "Qwen/Qwen3-8B"
    gguf = "/h/hub/models--Qwen--Qwen3-8B-GGUF/snapshots/ab/Qwen3-8B-Q4_K_M.gguf"
    assert hub_name(gguf) == "Qwen/Qwen3-8B-GGUF:Qwen3-8B-Q4_K_M" and served_name(gguf) == "Qwen/Qwen3-8B-GGUF"
    assert hub_name("/data/models/qwen") is None and served_name("/data/models/qwen") == "qwen"
