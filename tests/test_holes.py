"""Holes found in review: suites and prompts that are not UTF-8, a chat's own zero settings, scaled or
sliding-window rotary configs (HF folders and GGUF files) and bad head ratios."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from cli import tfq
from tfq.errors import TfqError
from tfq.model import gguf_file
from tfq.model.config import ModelConfig, RopeScaling
from tfq.model.rope import inv_freq_and_scale, rope_tables
from tfq.suite import Chat, load_prompts, load_suite, parse_suite, requests_for

LATIN1 = "- messages: [{role: user, content: caf\xe9}]\n".encode("latin-1")  # 0xe9 at offset 38


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ------------------------------------------------------------------------------------- 1. UTF-8 files

@pytest.mark.parametrize("name,load", [("suite.yaml", load_suite), ("prompts.txt", load_prompts),
                                       ("prompts.yaml", load_prompts)])
def test_a_file_not_utf8_is_one_line(tmp_path, name, load):
    path = tmp_path / name
    path.write_bytes(LATIN1)
    with pytest.raises(TfqError) as e:
        load(path)
    assert str(e.value) == f"{path}: not UTF-8 text (byte 0xe9 at offset 38); save the file as UTF-8"


def test_utf8_with_a_byte_order_mark_reads_and_counts_it(tmp_path):
    good = tmp_path / "bom.txt"
    good.write_bytes(b"\xef\xbb\xbfhello\n\xe4\xbd\xa0\xe5\xa5\xbd\n")
    assert [c.messages[-1]["content"] for c in load_prompts(good)] == ["hello", "\u4f60\u597d"]
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xef\xbb\xbfab\xff\n")
    with pytest.raises(TfqError, match=r"byte 0xff at offset 5\);"):
        load_prompts(bad)


@pytest.mark.parametrize("command,flag", [("chat", "--prompts"), ("together", "--suite")])
def test_cli_refuses_a_file_not_utf8_before_any_model(tmp_path, monkeypatch, capsys, command, flag):
    from tfq.model import load

    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the file was read")

    monkeypatch.setattr(load, "load_model", no_model)
    path = tmp_path / "chats.yaml"
    path.write_bytes(LATIN1)
    code, out, err = tfq([command, flag, str(path), "--model", str(tmp_path / "no-such-model")], monkeypatch, capsys)
    assert code == 2 and out == ""
    assert one_line(err) == f"tfq: {path}: not UTF-8 text (byte 0xe9 at offset 38); save the file as UTF-8"


# ------------------------------------------------------------------------ 2. a chat's own settings win


class Tokens:
    """Only what requests_for asks of a tokenizer."""

    def chat_ids(self, messages, tools=None, options=None):
        return [len(m["content"]) for m in messages]


def test_a_chats_own_zero_settings_win_over_the_command_line():
    doc = [{"name": "own", "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "seed": 0,
            "top_p": 1.0, "max_tokens": 3},
           {"name": "open", "messages": [{"role": "user", "content": "hi"}]},
           {"name": "blank", "messages": [{"role": "user", "content": "hi"}], "temperature": None}]
    own, open_, blank = parse_suite(doc, "suite")
    assert (own.temperature, own.seed, own.top_p, own.max_tokens) == (0.0, 0, 1.0, 3)
    assert (open_.temperature, open_.seed, open_.top_p, open_.max_tokens) == (None, None, None, None)
    assert blank.temperature is None
    a, b, c = requests_for([own, open_, blank], Tokens(), max_tokens=9, temperature=0.8, top_p=0.5, seed=5)
    assert (a.temperature, a.seed, a.top_p, a.max_tokens) == (0.0, 0, 1.0, 3)
    assert (b.temperature, b.seed, b.top_p, b.max_tokens) == (0.8, 5, 0.5, 9)
    assert (c.temperature, c.seed) == (0.8, 5)
    assert Chat("x", ({"role": "user", "content": "hi"},)).temperature is None


@pytest.mark.parametrize("key,value", [("temperature", -1), ("temperature", float("nan")), ("top_p", 0),
                                       ("top_p", 1.5), ("max_tokens", 0)])
def test_a_chats_bad_settings_are_one_line(key, value):
    with pytest.raises(TfqError, match=r"suite: chat 1: max_tokens must be >= 1, temperature >= 0, top_p in"):
        parse_suite([{"messages": [{"role": "user", "content": "hi"}], key: value}], "suite")


@pytest.mark.parametrize("key,value,words", [("json_schema", [1], "a JSON schema is an object"),
                                             ("presence_penalty", 5, "presence_penalty must be"),
                                             ("repetition_penalty", 0, "repetition_penalty must be"),
                                             ("frequency_penalty", "lots", "could not convert")])
def test_a_chats_bad_shaping_is_one_line(key, value, words):
    with pytest.raises(TfqError, match=f"suite: chat 1: .*{words}") as e:
        parse_suite([{"messages": [{"role": "user", "content": "hi"}], key: value}], "suite")
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------- 3. rotary scaling, sliding windows, heads


def hf_config(**kw):
    from transformers import Qwen2Config

    shape = dict(vocab_size=64, hidden_size=128, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=64, max_position_embeddings=128)
    return Qwen2Config(**{**shape, **kw})


YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The most float32 steps between two tensors' elements (same signs)."""
    return int((a.view(torch.int32).long() - b.view(torch.int32).long()).abs().max())


def test_rope_tables_are_the_nearest_float32():
    """The tables are cos and sin of each angle rounded to the nearest float32: against mpmath, on positions
    where torch's own fp32 cos and sin (the control) are not all nearest."""
    import mpmath

    from tfq.nearest import _round32

    config = ModelConfig.from_dict(hf_config(rope_theta=1e6).to_dict())
    cos, sin = rope_tables(config, 4096)
    inv_freq, _ = inv_freq_and_scale(config)
    angles = torch.outer(torch.arange(4096, dtype=torch.float32), inv_freq)
    picked = [(p, i) for p in (0, 1, 7, 100, 1000, 2047, 4095) for i in range(0, inv_freq.numel(), 3)]
    for name, ours, theirs in (("cos", cos, angles.cos()), ("sin", sin, angles.sin())):
        with mpmath.workprec(100):
            want = torch.tensor([float(_round32(getattr(mpmath, name)(mpmath.mpf(float(angles[p, i])))))
                                 for p, i in picked])
        assert torch.equal(torch.stack([ours[p, i] for p, i in picked]), want)
        assert not torch.equal(torch.stack([theirs[p, i] for p, i in picked]), want)  # RED: torch's own


@pytest.mark.parametrize("scaling,theta", [
    (YARN, 10000.0),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 1e6),
    ({"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 32, "beta_fast": 16,
      "truncate": False, "mscale": 0.7, "mscale_all_dim": 1.3}, 1e6),
    ({"type": "linear", "factor": 2.5}, 10000.0),
], ids=["yarn", "yarn-qwen2.5", "yarn-options", "linear"])
def test_scaled_rope_equals_transformers(scaling, theta):
    """inv_freq, the attention factor and the cos/sin tables are HF's, whether config.json is read as
    transformers 4 wrote it (rope_scaling) or as transformers 5 does (rope_parameters): the factor equal, the
    frequencies within an ulp, the tables within four (tfq rounds the power, cos and sin to the nearest float32;
    torch's vector code may not)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    hf = hf_config(rope_scaling=dict(scaling), rope_theta=theta, max_position_embeddings=32768 * 4)
    theirs, their_scale = ROPE_INIT_FUNCTIONS[hf.rope_parameters["rope_type"]](hf)
    old_style = {"model_type": "qwen2", **hf_config().to_diff_dict(), "rope_scaling": dict(scaling),
                 "rope_theta": theta, "max_position_embeddings": 32768 * 4}
    old_style.pop("rope_parameters")
    for raw in (hf.to_dict(), old_style):
        config = ModelConfig.from_dict(raw)
        assert config.rope_scaling is not None and config.rope_scaling.kind == hf.rope_parameters["rope_type"]
        ours, scale = inv_freq_and_scale(config)
        assert ours.dtype == torch.float32 and ours.shape == (32,)
        assert ulps(ours, theirs) <= 1 and scale == their_scale
    if scaling["factor"] == 4.0:
        assert scale > 1.0  # YaRN's attention factor is really applied
    positions = torch.tensor([[0, 1, 31, 32, 100, 4095]])
    cos, sin = Qwen2RotaryEmbedding(hf)(torch.zeros(1, 6, 64), positions)
    our_cos, our_sin = rope_tables(config, 4096)
    assert ulps(our_cos[positions[0]], cos[0]) <= 4 and ulps(our_sin[positions[0]], sin[0]) <= 4  # an ulp of the
    # frequency moves an angle at position 4095 by a few


def test_plain_rope_is_unchanged():
    """Without scaling: today's frequencies (tfq.model.qwen's formula), factor 1.0, and HF's tables."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    for raw in (hf_config(rope_theta=1e6).to_dict(),  # transformers 5: rope_parameters, rope_type default
                {**hf_config().to_diff_dict(), "model_type": "qwen2", "rope_theta": 1e6, "rope_scaling": None}):
        config = ModelConfig.from_dict(raw)
        assert config.rope_scaling is None and config.rope_theta == 1e6
        inv_freq, scale = inv_freq_and_scale(config)
        d = config.head_dim
        assert ulps(inv_freq, 1.0 / (1e6 ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))) <= 1
        assert scale == 1.0
    positions = torch.tensor([[0, 7, 4000]])
    cos, sin = Qwen2RotaryEmbedding(hf_config(rope_theta=1e6))(torch.zeros(1, 3, 64), positions)
    our_cos, our_sin = rope_tables(config, 4096)
    assert ulps(our_cos[positions[0]], cos[0]) <= 4 and ulps(our_sin[positions[0]], sin[0]) <= 4  # an ulp of the
    # frequency moves an angle at position 4095 by a few


def test_yarn_defaults_as_transformers_fills_them():
    """factor left out: max / original positions; original left out: max positions; top-level original wins."""
    base = {**hf_config().to_diff_dict(), "model_type": "qwen2", "max_position_embeddings": 256}
    base.pop("rope_parameters")
    s = ModelConfig.from_dict({**base, "rope_scaling": {"type": "yarn", "original_max_position_embeddings": 64}})
    assert s.rope_scaling.factor == 4.0 and s.rope_scaling.original_max_positions == 64
    s = ModelConfig.from_dict({**base, "rope_scaling": {"type": "yarn", "factor": 2}})
    assert s.rope_scaling.original_max_positions == 256
    s = ModelConfig.from_dict({**base, "original_max_position_embeddings": 16, "rope_scaling": dict(YARN)})
    assert s.rope_scaling.original_max_positions == 16


def raw_config(**changes) -> dict:
    raw = {**hf_config().to_diff_dict(), "model_type": "qwen2"}
    raw.update(changes)
    return raw


@pytest.mark.parametrize("changes,words", [
    (dict(rope_scaling={"type": "dynamic", "factor": 2.0}),
     "rope scaling type 'dynamic' is not supported: its frequencies change with the sequence length, so a "
     "row's bits would depend on the batch"),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}), "'dynamic' is not supported"),
    (dict(rope_scaling={"rope_type": "longrope", "factor": 2.0}),
     "rope scaling type 'longrope' is not supported; tfq runs default, linear, yarn"),
    (dict(rope_scaling={"type": "linear"}), "rope scaling factor must be a positive number, got None"),
    (dict(rope_scaling={"type": "yarn", "factor": -2.0}), "rope scaling factor must be a positive number"),
    (dict(rope_scaling="yarn"), "rope_scaling must be a mapping"),
    (dict(use_sliding_window=True, sliding_window=64),
     "sliding-window attention (use_sliding_window: true) is not supported; tfq runs full attention only: "
     "use a checkpoint without it"),
    (dict(layer_types=["full_attention", "sliding_attention"]),
     "sliding-window attention (layer_types has sliding_attention) is not supported"),
    (dict(num_attention_heads=3, num_key_value_heads=2),
     "num_attention_heads (3) must be a positive multiple of num_key_value_heads (2)"),
    (dict(num_attention_heads=2, num_key_value_heads=0),
     "num_attention_heads (2) must be a positive multiple of num_key_value_heads (0)"),
    (dict(num_attention_heads=0, head_dim=None), "num_attention_heads (0) must be a positive multiple"),
], ids=["dynamic", "dynamic-v5", "longrope", "linear-no-factor", "negative-factor", "not-a-mapping", "sliding",
        "sliding-layer", "heads-3-of-2", "no-kv-heads", "no-heads"])
def test_configs_tfq_would_run_wrong_are_refused(changes, words):
    with pytest.raises(TfqError) as e:
        ModelConfig.from_dict(raw_config(**changes), "m/config.json")
    message = str(e.value)
    assert message.startswith("m/config.json: ") and words in message and "\n" not in message


def test_a_folder_with_a_sliding_window_is_refused_by_the_cli(tmp_path, tiny_dirs, monkeypatch, capsys):
    import shutil

    folder = tmp_path / "sliding"
    shutil.copytree(tiny_dirs["qwen2"], folder)
    raw = json.loads((folder / "config.json").read_text())
    raw.update(use_sliding_window=True, sliding_window=64)
    (folder / "config.json").write_text(json.dumps(raw))
    code, _, err = tfq(["chat", "hi", "--model", str(folder), "--quiet"], monkeypatch, capsys)
    assert code == 2 and "sliding-window attention (use_sliding_window: true) is not supported" in one_line(err)


def test_the_shipped_and_tiny_configs_still_load(tiny_dirs):
    from tfq.model.source import SHIPPED_DEFAULT_CONFIG

    shipped = ModelConfig.from_dict(json.loads(SHIPPED_DEFAULT_CONFIG.read_text()))
    assert shipped.rope_scaling is None and shipped.group == 7
    for folder in tiny_dirs.values():
        assert ModelConfig.from_folder(folder).rope_scaling is None


# -------------------------------------------------------------------------------- 3b. GGUF rope scaling


def gguf_header(path, **scaling):
    """A header-only qwen2 GGUF (as test_loading writes one) with `qwen2.rope.scaling.*` keys."""
    import gguf

    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_block_count(1)
    w.add_context_length(131072)
    w.add_embedding_length(128)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_rope_freq_base(1e6)
    for key, value in scaling.items():
        if key == "type":
            w.add_rope_scaling_type(gguf.RopeScalingType(value))
        elif key == "original_context_length":
            w.add_rope_scaling_orig_ctx_len(value)
        elif key == "factor":
            w.add_rope_scaling_factor(value)
        else:
            w.add_float32(f"qwen2.rope.scaling.{key}", value)
    w.add_tensor("token_embd.weight", np.zeros((32, 128), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return gguf_file.read_header(path)


def test_gguf_yarn_scaling_is_carried_into_the_config(tmp_path):
    header = gguf_header(tmp_path / "yarn.gguf", type="yarn", factor=4.0, original_context_length=32768,
                         yarn_beta_fast=32.0)
    raw = gguf_file.hf_config(header)
    assert raw["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
                                   "beta_fast": 32.0}
    scaling = ModelConfig.from_dict(raw).rope_scaling
    assert scaling == RopeScaling("yarn", 4.0, 32768, scaling.attention_factor, 32.0, 1.0, True)
    assert scaling.attention_factor > 1.0


def test_gguf_linear_and_none(tmp_path):
    linear = gguf_file.hf_config(gguf_header(tmp_path / "linear.gguf", type="linear", factor=2.0))
    assert linear["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    none = gguf_file.hf_config(gguf_header(tmp_path / "none.gguf", type="none", factor=4.0))
    assert "rope_scaling" not in none and ModelConfig.from_dict(none).rope_scaling is None


@pytest.mark.parametrize("scaling,words", [
    (dict(type="longrope", factor=4.0), "GGUF qwen2.rope.scaling.type 'longrope' is not supported"),
    (dict(type="yarn", original_context_length=32768), "qwen2.rope.scaling.factor is missing"),
    (dict(type="yarn", factor=4.0, yarn_log_multiplier=0.5),
     "GGUF metadata qwen2.rope.scaling.yarn_log_multiplier = 0.5 is not supported"),
])
def test_gguf_scaling_tfq_cannot_run_is_refused(tmp_path, scaling, words):
    header = gguf_header(tmp_path / "x.gguf", **scaling)
    with pytest.raises(TfqError) as e:
        gguf_file.hf_config(header)
    assert str(e.value).startswith(str(header.path)) and words in str(e.value) and "\n" not in str(e.value)
