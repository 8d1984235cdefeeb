"""MLX 4-bit checkpoints (mlx-lm's format): dequantized as MLX dequantizes, bit for bit, then run in fp32.

The checkpoints are written by mlx-lm's own converter where mlx installs (its CPU build on Linux), otherwise by
the documented format (tests/tiny.py); the bits are compared with `mx.dequantize` when mlx is importable.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import engines
from engines import one_forward, run
from tfq.engine.stream import Request
from tfq.errors import TfqError
from tfq.model.config import ModelConfig
from tfq.model.load import load_model
from tfq.model.mlx import dequantize, folder_quantization, load_mlx_state
from tiny import tiny_model_dir, write_mlx_checkpoint

KINDS = ("linear_attention", "linear_attention", "linear_attention", "full_attention")


@pytest.fixture(scope="module", params=["qwen2", "qwen3_5", "qwen3_moe", "qwen3_5_moe"])
def pair(request, tmp_path_factory):
    """(HF folder, its MLX 4-bit checkpoint): qwen2, and a qwen3_5 hybrid in the image-and-text layout that
    mlx-lm converts (its text model under language_model, norms and convolution in MLX's layout); the mixtures
    of both (mlx-lm stacks the experts, switch_mlp, and keeps the routers in 8 bits)."""
    family = request.param
    # mlx-lm's qwen2 takes head_dim as hidden / heads
    extra = {"qwen2": dict(heads=2, kv_heads=1), "qwen3_5": dict(layers=4, layer_types=KINDS, vision=True),
             "qwen3_moe": dict(experts=(8, 2, 64)),
             "qwen3_5_moe": dict(layers=4, layer_types=KINDS, vision=True, experts=(8, 2, 64),
                                 intermediate=128)}[family]
    hf = tiny_model_dir(tmp_path_factory, family, seed=6, **extra)
    return family, hf, write_mlx_checkpoint(hf, tmp_path_factory.mktemp(f"mlx-{family}") / "mlx")


def raw_tensors(folder):
    from safetensors import safe_open

    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def test_dequantized_weights_equal_mlx_s_own(pair):
    mx = pytest.importorskip("mlx.core")
    _, _, folder = pair
    quant = folder_quantization(folder)
    assert (quant.bits, quant.group_size) == (4, 64)
    raw, ours = raw_tensors(folder), load_mlx_state(folder, quant)
    modules = [k[:-len(".scales")] for k in raw if k.endswith(".scales")]
    assert len(modules) > 10
    for m in modules:
        w, s, b = (raw[f"{m}.{part}"] for part in ("weight", "scales", "biases"))
        theirs = mx.dequantize(
            mx.array(w.view(torch.int32).numpy().view(np.uint32)),
            mx.array(s.float().numpy()).astype(mx.bfloat16 if s.dtype == torch.bfloat16 else mx.float32),
            mx.array(b.float().numpy()).astype(mx.bfloat16 if b.dtype == torch.bfloat16 else mx.float32),
            *quant.of(m))  # a router: 8 bits
        want = torch.from_numpy(np.array(theirs.astype(mx.float32)))
        got = ours.get(m + ".weight")
        if got is None:  # a mixture's stacked experts (switch_mlp): tfq's one matrix an expert
            got = torch.stack([ours[f"{m.replace('.switch_mlp.', f'.experts.{e}.')}.weight"] for e in range(len(w))])
        assert torch.equal(got, want), f"{m}: tfq's dequantized weights are not MLX's"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_every_width_and_dtype_dequantizes_as_mlx(bits, dtype):
    mx = pytest.importorskip("mlx.core")
    mdt = getattr(mx, dtype)
    for group in (32, 64, 128):
        w = (mx.random.normal((48, 256), key=mx.random.key(bits * group)) * 0.05).astype(mdt)
        q, s, b = mx.quantize(w, group, bits)
        want = torch.from_numpy(np.array(mx.dequantize(q, s, b, group, bits).astype(mx.float32)))
        t = lambda a: torch.from_numpy(np.array(a.astype(mx.float32))).to(getattr(torch, dtype))  # noqa: E731
        got = dequantize(torch.from_numpy(np.array(q).view(np.int32)).view(torch.uint32), t(s), t(b), group, bits)
        assert torch.equal(got, want), (bits, group, dtype)


def test_dequantizing_rounds_as_mlx_does():
    """Control: one rounding (an fma, or the sum in fp32) gives other weights than MLX's two, in bf16."""
    mx = pytest.importorskip("mlx.core")
    w = (mx.random.normal((64, 256), key=mx.random.key(1)) * 0.05).astype(mx.bfloat16)
    q, s, b = mx.quantize(w, 64, 4)
    want = torch.from_numpy(np.array(mx.dequantize(q, s, b, 64, 4).astype(mx.float32)))
    from tfq.model.mlx import codes

    c = codes(torch.from_numpy(np.array(q).view(np.int32)).view(torch.uint32), 4, 256).float()
    sf, bf = (torch.from_numpy(np.array(a.astype(mx.float32))).repeat_interleave(64, -1) for a in (s, b))
    once = (c * sf + bf).to(torch.bfloat16).float()
    assert not torch.equal(once, want)


def hf_on_dequantized(family, hf_folder, state):
    """transformers' model of the HF folder with the MLX checkpoint's dequantized weights in it."""
    import transformers

    cls = {"qwen2": transformers.Qwen2ForCausalLM, "qwen3_5": transformers.Qwen3_5ForCausalLM,
           "qwen3_moe": transformers.Qwen3MoeForCausalLM, "qwen3_5_moe": transformers.Qwen3_5MoeForCausalLM}[family]
    hybrid = family.startswith("qwen3_5")
    if hybrid:
        text = json.loads((hf_folder / "config.json").read_text())["text_config"]
        config = (transformers.Qwen3_5MoeTextConfig if family == "qwen3_5_moe" else transformers.Qwen3_5TextConfig)
        model = cls(config(**{k: v for k, v in text.items() if k != "model_type"}))
    else:
        model = cls.from_pretrained(hf_folder, dtype=torch.float32)
    names = {}
    for k, v in state.items():
        k = k.replace("language_model.model.", "model.").replace("language_model.lm_head.", "lm_head.")
        if hybrid and k.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")) \
                or k == "model.norm.weight" and hybrid:
            v = v - 1.0  # MLX keeps the weight a norm multiplies by; transformers keeps weight - 1
        if k.endswith("conv1d.weight") and v.shape[-1] == 1:
            v = v.transpose(1, 2)
        names[k] = v
    names = _stacked(names) if family.endswith("_moe") else names
    missing, unexpected = model.load_state_dict(names, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing) or not missing, (missing, unexpected)
    return model.float().eval()


def _stacked(names: dict) -> dict:
    """tfq's one matrix an expert (mlp.experts.E.gate_proj.weight ...) stacked back as transformers holds them
    (mlp.experts.gate_up_proj [experts, 2 * inter, hidden], mlp.experts.down_proj)."""
    out, experts = {}, {}
    for k, v in names.items():
        head, sep, tail = k.partition(".mlp.experts.")
        if not sep:
            out[k] = v
            continue
        e, kind = tail.split(".")[:2]
        experts.setdefault(head, {}).setdefault(kind, {})[int(e)] = v
    for head, kinds in experts.items():
        order = lambda kind: [kinds[kind][e] for e in sorted(kinds[kind])]  # noqa: E731
        out[f"{head}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([g, u]) for g, u in zip(order("gate_proj"), order("up_proj"))])
        out[f"{head}.mlp.experts.down_proj"] = torch.stack(order("down_proj"))
    return out


def test_mlx_checkpoint_runs_like_transformers_on_its_weights(pair):
    family, hf_folder, folder = pair
    loaded = load_model(str(folder), progress=False, weights="fp32")
    assert loaded.config.quantized == "MLX 4-bit affine, groups of 64"
    model = hf_on_dequantized(family, hf_folder, load_mlx_state(folder, folder_quantization(folder)))
    for n in (1, 65, 200):
        ids = torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        with torch.no_grad():
            want = model(torch.tensor([ids])).logits[0]
        got = one_forward(loaded, ids)
        assert (got - want).abs().max().item() <= 2e-5 * want.abs().max().item()


@pytest.mark.parametrize("weights", ["mlx", "fp32"])
def test_mlx_checkpoint_streams_equal_their_runs_alone(pair, weights):
    _, _, folder = pair
    loaded = load_model(str(folder), progress=False, weights=weights)
    requests = [Request(tuple(range(5 + 40 * i, 5 + 40 * i + 17 * (i + 1))), max_tokens=12) for i in range(4)]
    together = run(loaded.model, requests, lanes=4, prefill_chunk=23)
    assert engines.bits(together) == engines.bits(engines.alone(loaded.model, requests))


def test_bad_quantization_is_one_line(pair, tmp_path):
    _, _, folder = pair
    raw = json.loads((folder / "config.json").read_text())
    raw["quantization"] = {"group_size": 64, "bits": 7}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(TfqError, match="7 bits in groups of 64 is not one tfq reads"):
        ModelConfig.from_folder(tmp_path)


def test_writer_by_the_documented_format_reads_back(tmp_path_factory):
    """Where mlx does not install, tests write MLX checkpoints by the format: its bit streams read back to the
    codes written (and, where mlx is here, MLX dequantizes them as tfq does)."""
    from tiny import _write_mlx_by_format

    hf = tiny_model_dir(tmp_path_factory, "qwen3", seed=7)
    for bits in (3, 4, 8):
        folder = _write_mlx_by_format(hf, tmp_path_factory.mktemp(f"fmt{bits}"), bits, 64, "bfloat16")
        raw, ours = raw_tensors(folder), load_mlx_state(folder, folder_quantization(folder))
        m = "model.layers.0.mlp.down_proj"
        original = raw_tensors(hf)[m + ".weight"]
        step = raw[m + ".scales"].float().repeat_interleave(64, -1)  # within a step of what was written
        assert ((ours[m + ".weight"] - original).abs() <= step + 0.005).all()  # and bf16 roundings
        try:
            import mlx.core as mx
        except ImportError:
            continue
        w = raw[m + ".weight"].view(torch.int32).numpy().view(np.uint32)
        theirs = mx.dequantize(mx.array(w), mx.array(raw[m + ".scales"].float().numpy()).astype(mx.bfloat16),
                               mx.array(raw[m + ".biases"].float().numpy()).astype(mx.bfloat16), 64, bits)
        assert torch.equal(ours[m + ".weight"], torch.from_numpy(np.array(theirs.astype(mx.float32))))
    loaded = load_model(str(folder), progress=False)
    assert loaded.config.quantized == "MLX 8-bit affine, groups of 64"


# ------------------------------------------------------------------------------- weights: mlx (groups kept)

def random_groups(bits: int, group: int, scales_dtype: torch.dtype, n: int = 96, k: int = 256, seed: int = 0):
    """uint32 words, scales and biases of a random MLX layer [n, k] (the kernel check's own)."""
    from tfq.proofs.kernel_check_rowwise import random_mlx

    return random_mlx(bits, group, scales_dtype, n, k, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("scales", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bits", [4, 5, 6, 8])
def test_kept_groups_give_the_fp32_layer_s_bits(bits, scales):
    """tfq's quantized kernel on MLX's groups (its roundings) gives, bit for bit, the fp32 layer on the weights
    MLX's dequantization gives, at 1 to 70 rows and 1, 3 and 8 threads."""
    from tfq.kernels.quant import QuantLinear
    from tfq.kernels.rowwise import FixedOrderLinear
    from tfq.model.mlx import kept

    before = torch.get_num_threads()
    try:
        for group in (32, 64, 128):
            packed, s, b = random_groups(bits, group, scales, seed=bits * group)
            groups = kept(packed, s, b, group, bits)
            weights = dequantize(packed, s, b, group, bits)
            assert torch.equal(groups.dequantized(), weights)
            layer, reference = QuantLinear(groups), FixedOrderLinear(weights)
            x = torch.randn(70, 256, generator=torch.Generator().manual_seed(group))
            for threads in (1, 3, 8):
                torch.set_num_threads(threads)
                for m in (1, 2, 4, 5, 8, 9, 70):
                    assert torch.equal(layer(x[:m]), reference(x[:m])), (bits, group, m, threads)
    finally:
        torch.set_num_threads(before)


def test_kept_groups_need_mlx_s_rounding():
    """Control: the same groups unpacked with one rounding (GGUF's fma) give other weights than MLX's."""
    import dataclasses

    from tfq.kernels.quant import QuantLinear
    from tfq.kernels.rowwise import FixedOrderLinear
    from tfq.model.mlx import kept

    packed, s, b = random_groups(4, 64, torch.bfloat16)
    groups = kept(packed, s, b, 64, 4)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    want = FixedOrderLinear(dequantize(packed, s, b, 64, 4))(x)
    assert torch.equal(QuantLinear(groups)(x), want)
    assert not torch.equal(QuantLinear(dataclasses.replace(groups, rounding="fma"))(x), want)


def test_weights_mlx_has_the_bits_of_weights_fp32(pair):
    _, _, folder = pair
    loaded = load_model(str(folder), progress=False)  # auto: the groups kept
    fp32 = load_model(str(folder), progress=False, weights="fp32")
    assert (loaded.weights, fp32.weights) == ("mlx", "fp32")
    for n in (1, 6, 9, 130):
        ids = torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        assert torch.equal(one_forward(loaded, ids), one_forward(fp32, ids))


def test_weights_mlx_refused_where_there_are_no_groups(tmp_path_factory):
    hf = tiny_model_dir(tmp_path_factory, "qwen2", seed=6, heads=2, kv_heads=1)
    with pytest.raises(TfqError, match="weights: mlx keeps an MLX checkpoint's quantized groups"):
        load_model(str(hf), progress=False, weights="mlx")
