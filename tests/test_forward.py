"""tfq's forward against an independent reference: HF transformers on the very same checkpoint folders."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engines import engine, run
from tfq.engine.core import EngineSettings
from tfq.engine.stream import Request

ROOT = Path(__file__).resolve().parent.parent


def hf_model(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_logits_match_transformers(tiny_dirs, tiny_models, family):
    loaded = tiny_models[family]
    g = torch.Generator().manual_seed(5)
    prompt = tuple(torch.randint(0, loaded.config.vocab_size, (150,), generator=g).tolist())
    # a paged, chunked run: the reference check covers the engine's whole path, not one kernel
    settings = EngineSettings(window=512, lanes=2, prefill_chunk=50, page_rows=64, paged_all=True, pool_pages=8)
    got = run(loaded.model, [Request(prompt, max_tokens=20)], settings, keep_logits=True)[0]
    with torch.no_grad():
        ref = hf_model(tiny_dirs[family])(torch.tensor([prompt + tuple(got.ids[:-1])])).logits[0, len(prompt) - 1:]
    ours = torch.stack(got.logits)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max()
    assert got.ids == ref.argmax(-1).tolist()


@pytest.mark.slow
def test_default_model_greedy_tokens_equal_transformers():
    """The default model on its GGUF blocks with fp32 sums (weights: gguf, the dequantized model's bits) draws
    transformers' greedy tokens on the same fp32 weights. (weights: auto computes in gguf-q8, whose activations
    lose bits: its own bits are checked against the record, tests/test_verify.py.)"""
    from tfq.model.load import load_model
    from tfq.model.source import resolve_model

    loaded = load_model("default", progress=False, weights="gguf")
    hf = hf_model(resolve_model("default", progress=False))  # the folder with its fp32 weights, written once for HF
    chats = engine(loaded.model, window=1024, lanes=2, tokenizer=loaded.tokenizer)
    prompts = ["Write a Python function that checks whether a number is prime.",
               "Write a bash one-liner that counts the lines of every .py file in a folder."]
    for text in prompts:
        ids = loaded.tokenizer.chat_ids([{"role": "user", "content": text}])
        ours = chats.generate([Request(tuple(ids), max_tokens=32)])[0].ids
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                              eos_token_id=list(loaded.tokenizer.eos_ids), pad_token_id=loaded.tokenizer.eos_ids[-1])
        assert len(ours) >= 8  # a real reply, not an early stop
        assert ours == out[0, len(ids):].tolist()


def test_transformers_runs_beside_tfqs_kernels_package(tiny_dirs):
    """tfq's repository has a top-level `kernels` folder (installed as tfq.kernels); HF's `kernels` hub library,
    which transformers imports where it is installed (5.25 requires it), has the same import name. From the
    repository's root, transformers must get its own and run a model with tfq's already imported."""
    import subprocess
    import sys

    code = (
        "import tfq.kernels.attention, tfq.engine.core\n"
        "import kernels\n"
        "from transformers.utils import import_utils\n"
        "assert not import_utils.is_kernels_available() or hasattr(kernels, 'CUDAProperties'), kernels.__file__\n"
        "import torch\n"
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(tiny_dirs['qwen2'])!r})\n"
        "print(m(torch.tensor([[1, 2, 3]])).logits.shape)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "torch.Size([1, 3," in r.stdout


def test_the_kernels_folder_steps_aside_for_an_installed_kernels_package(tmp_path):
    """By construction, in an isolated interpreter without site-packages: a package named kernels further down
    sys.path (a stand-in for
    HF's) is what `import kernels` gives from the repository's root; the control, without it, gets the folder."""
    import subprocess
    import sys

    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("WHO = 'the installed package'\n")
    code = "import sys; sys.path[:0] = sys.argv[1:]; import kernels; print(getattr(kernels, 'WHO', kernels.__file__))"
    for path, want in (([str(ROOT), str(tmp_path)], "the installed package"),
                       ([str(ROOT)], str(ROOT / "kernels" / "__init__.py"))):
        r = subprocess.run([sys.executable, "-I", "-S", "-c", code, *path], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and r.stdout.strip() == want, r.stderr


@pytest.mark.parametrize("scaling", [{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
                                     {"rope_type": "linear", "factor": 2.0}])
def test_scaled_rotary_matches_transformers(tmp_path, scaling):
    """A config with rope scaling runs scaled (it used to run as if it had none): logits as HF computes them."""
    import json

    from tfq.model.load import load_model
    from tiny import write_tiny_checkpoint

    folder = write_tiny_checkpoint(tmp_path / "yarn", family="qwen2", seed=3)
    config = json.loads((folder / "config.json").read_text())
    config["rope_scaling"] = scaling
    (folder / "config.json").write_text(json.dumps(config))
    loaded = load_model(str(folder), progress=False)
    prompt = tuple(torch.randint(0, 512, (200,), generator=torch.Generator().manual_seed(8)).tolist())
    got = run(loaded.model, [Request(prompt, max_tokens=4)], keep_logits=True)[0]
    with torch.no_grad():
        ref = hf_model(folder)(torch.tensor([prompt + tuple(got.ids[:-1])])).logits[0, len(prompt) - 1:]
    ours = torch.stack(got.logits)
    assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max()
    unscaled = load_model(str(write_tiny_checkpoint(tmp_path / "plain", family="qwen2", seed=3)), progress=False)
    plain = run(unscaled.model, [Request(prompt, max_tokens=1)], keep_logits=True)[0]
    assert (plain.logits[0] - ref[0]).abs().max() > 1e-3 * ref.abs().max()  # the scaling is really applied
