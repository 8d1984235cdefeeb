"""Tiny random Qwen checkpoints (HF folders and GGUF files) for the test suite.

The weights come from HF transformers' own model classes (so HF can load them back as a reference),
drawn from a seeded generator at scales that keep logits spread out; the tokenizer is a small
byte-level BPE trained here, with Qwen's pre-tokenizer, special tokens and a Qwen-style chat template.
"""
from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are a tiny test model.<|im_end|>\\n' }}"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if not (message['role'] == 'system' and loop.first) %}\n"
    "        {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)
CORPUS = """\
def fibonacci(n: int) -> int:
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

for i in range(10):
    print(f"value {i}: {i * i}")

The quick brown fox jumps over the lazy dog. The model reads the prompt and writes a reply.
Hello, world! How are you today? I am fine, thank you. What is the answer? It is 42.
你好，世界！今天天气很好。我们一起写代码吧。
こんにちは世界。日本語のテキストです。
안녕하세요 세계. 한국어 텍스트입니다.
Emoji: 😀 👍 🚀 ✨ 🐍 🎉
import numpy as np
x = np.arange(12).reshape(3, 4)
while True:
    break
"""


def _train_tokenizer(vocab: int):
    """A byte-level BPE with exactly `vocab` ids: bytes, trained merges, unreachable fillers, then the specials."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    from tfq.model.gguf_tokenizer import QWEN2_SPLIT

    if vocab < 256 + len(SPECIALS):
        raise ValueError(f"vocab must hold the 256 bytes and {len(SPECIALS)} specials")
    tok = Tokenizer(models.BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(
        vocab_size=vocab - len(SPECIALS), min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[],
    )
    tok.train_from_iterator([CORPUS] * 4, trainer=trainer)
    spec = json.loads(tok.to_str())
    model_vocab = spec["model"]["vocab"]
    for i in range(len(model_vocab), vocab - len(SPECIALS)):
        model_vocab[f"[PAD{i}]"] = i  # as llama.cpp pads a vocabulary: ids no text ever reaches
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    assert tok.get_vocab_size(with_added_tokens=True) == vocab
    return tok


@lru_cache(maxsize=None)
def _tokenizer_json(vocab: int) -> str:
    return _train_tokenizer(vocab).to_str()


def tiny_tokenizer(vocab: int = 512):
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_tokenizer_json(vocab))


def _init_weights(model: torch.nn.Module, seed: int) -> None:
    """Seeded weights at scales that keep activations near 1 and logits a few units wide."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name:
                val = 1.0 + 0.2 * torch.randn(p.shape, generator=g)
            elif p.ndim == 1:  # biases (and a DeltaNet's A_log and dt_bias)
                val = 0.5 * torch.randn(p.shape, generator=g)
            elif "conv1d" in name:  # a DeltaNet's causal convolution [channels, 1, taps]
                val = 0.5 * torch.randn(p.shape, generator=g)
            elif "embed_tokens" in name or "lm_head" in name:
                val = 0.3 * torch.randn(p.shape, generator=g)
            else:  # a matrix, or a mixture's experts stacked [experts, out, in]: by fan-in
                val = torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5
            p.copy_(val)


def _one_tensor_an_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers keeps a mixture's experts stacked (experts.gate_up_proj [experts, 2 * inter, hidden],
    experts.down_proj [experts, hidden, inter]) and writes them one tensor an expert: as it writes them."""
    out = {}
    for k, v in state.items():
        if k.endswith("experts.gate_up_proj"):
            base, half = k[:-len("gate_up_proj")], v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = v[e, :half].contiguous()
                out[f"{base}{e}.up_proj.weight"] = v[e, half:].contiguous()
        elif k.endswith("experts.down_proj"):
            base = k[:-len("down_proj")]
            for e in range(v.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = v[e].contiguous()
        else:
            out[k] = v
    return out


def _exp_rounds_nearest(a_log: torch.Tensor) -> torch.Tensor:
    """a_log with each value moved toward 0 by ulps until this CPU's torch.exp of it is the nearest float32.
    llama.cpp's converter stores A = -torch.exp(A_log) and tfq computes a folder's A as the nearest float32
    (tfq/nearest.py); torch's vector exp is off by an ulp for some values, which ones by CPU, so without this a
    converted file's A could differ from its folder's by luck of the draw (seen on a Xeon: one value of 36)."""
    from tfq.nearest import exp32

    x = a_log.numpy().copy()
    for _ in range(64):
        off = torch.exp(torch.from_numpy(x)).numpy() != exp32(x)
        if not off.any():
            return torch.from_numpy(x)
        x[off] = np.nextafter(x[off], np.float32(0))
    raise AssertionError("torch.exp rounds none of 64 neighbouring values to the nearest float32")


def write_tiny_checkpoint(
    folder: Path,
    family: str = "qwen2",
    tie: bool = False,
    seed: int = 0,
    layers: int = 2,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 64,
    intermediate: int = 256,
    vocab: int = 512,
    shards: int = 1,
    max_positions: int = 4096,
    rope_theta: float = 10000.0,
    layer_types: tuple[str, ...] | None = None,
    linear_heads: tuple[int, int] = (2, 4),
    linear_dims: tuple[int, int] = (32, 32),
    vision: bool = False,
    branch_scale: float = 1.0,
    experts: tuple[int, int, int] = (8, 2, 64),
    dense_layers: tuple[int, ...] = (),
    normalized: bool = True,
) -> Path:
    """Write a random `family` checkpoint (HF folder, fp32 safetensors, optionally in `shards` files).

    qwen3_5 is the hybrid (transformers' Qwen3_5ForCausalLM): `layer_types` (default: every fourth layer full
    attention, as transformers does), DeltaNet key and value heads `linear_heads` of dims `linear_dims`. With
    `vision`, the config is an image-and-text qwen3_5 one, its text model's tensors under model.language_model
    (the vision tower's own tensors are left out: tfq skips them). `branch_scale` multiplies the projections that
    write into the residual stream (o_proj, out_proj, down_proj): below 1, with tied embeddings, a random model
    tends to repeat what it read, so prompt-lookup drafting finds guesses it accepts.

    qwen3_moe is Qwen3 with a mixture of experts (transformers' Qwen3MoeForCausalLM): `experts` (experts, chosen a
    row, each one's intermediate size), `dense_layers` (mlp_only_layers: a dense MLP there), `normalized`
    (norm_topk_prob). Its experts are written one tensor each, as save_pretrained writes them. qwen3_5_moe is the
    hybrid with a mixture in every layer (transformers' Qwen3_5MoeForCausalLM), `experts` as for qwen3_moe and a
    shared expert of `intermediate` rows; its experts are written stacked (experts.gate_up_proj, down_proj), as
    Qwen3.5's published checkpoints store them."""
    from safetensors.torch import save_file
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    if head_dim < 32:
        raise ValueError("head_dim must be >= 32 (the attention kernels need it)")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = tiny_tokenizer(vocab)
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    common = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=max_positions, rms_norm_eps=1e-6,
        tie_word_embeddings=tie, bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"])
    if family == "qwen3_5":
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        model_cls = Qwen3_5ForCausalLM
        config = Qwen3_5TextConfig(
            **common, layer_types=list(layer_types) if layer_types else None,
            rope_parameters={"rope_type": "default", "rope_theta": rope_theta, "partial_rotary_factor": 0.25,
                             "mrope_section": [2, 1, 1], "mrope_interleaved": True},
            linear_num_key_heads=linear_heads[0], linear_num_value_heads=linear_heads[1],
            linear_key_head_dim=linear_dims[0], linear_value_head_dim=linear_dims[1], linear_conv_kernel_dim=4)
    elif family == "qwen3_5_moe":
        from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

        model_cls = Qwen3_5MoeForCausalLM
        common.pop("intermediate_size")  # no dense MLP: the shared expert takes `intermediate`
        config = Qwen3_5MoeTextConfig(
            **common, layer_types=list(layer_types) if layer_types else None,
            rope_parameters={"rope_type": "default", "rope_theta": rope_theta, "partial_rotary_factor": 0.25,
                             "mrope_section": [2, 1, 1], "mrope_interleaved": True},
            linear_num_key_heads=linear_heads[0], linear_num_value_heads=linear_heads[1],
            linear_key_head_dim=linear_dims[0], linear_value_head_dim=linear_dims[1], linear_conv_kernel_dim=4,
            num_experts=experts[0], num_experts_per_tok=experts[1], moe_intermediate_size=experts[2],
            shared_expert_intermediate_size=intermediate)
    elif family == "qwen3_moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        model_cls = Qwen3MoeForCausalLM
        config = Qwen3MoeConfig(**common, rope_theta=rope_theta, use_sliding_window=False, num_experts=experts[0],
                                num_experts_per_tok=experts[1], moe_intermediate_size=experts[2],
                                mlp_only_layers=list(dense_layers), norm_topk_prob=normalized)
    else:
        config_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM),
                                 "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[family]
        config = config_cls(**common, rope_theta=rope_theta, use_sliding_window=False)
    torch.manual_seed(seed)  # HF's own init runs first; every parameter is then overwritten from `seed`
    model = model_cls(config).to(torch.float32).eval()
    _init_weights(model, seed)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if family == "qwen3_moe":  # Qwen3.5's published checkpoints keep the experts stacked, as transformers does
        state = _one_tensor_an_expert(state)
    for k in state:
        if k.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            state[k] = state[k] * branch_scale
        if k.endswith("A_log"):
            state[k] = _exp_rounds_nearest(state[k])
    if tie:
        state.pop("lm_head.weight")
    config.architectures = [model_cls.__name__]
    config.save_pretrained(folder)
    if family == "qwen3_moe":  # the published configs' keys beside transformers' own (mlx-lm reads these)
        raw = json.loads((folder / "config.json").read_text())
        raw.update(num_experts=experts[0], rope_theta=rope_theta)
        (folder / "config.json").write_text(json.dumps(raw, indent=2))
    if vision:  # the image-and-text layout: the text config inside, the text model's tensors renamed
        text = json.loads((folder / "config.json").read_text())
        outer_type = family  # qwen3_5 or qwen3_5_moe
        outer = {"model_type": outer_type, "architectures": [
                     "Qwen3_5MoeForConditionalGeneration" if family == "qwen3_5_moe"
                     else "Qwen3_5ForConditionalGeneration"],
                 "text_config": text, "vision_config": {"model_type": f"{outer_type}_vision", "depth": 2},
                 "tie_word_embeddings": tie}
        (folder / "config.json").write_text(json.dumps(outer, indent=2))
        state = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
                 for k, v in state.items()}

    names = sorted(state)
    if shards <= 1:
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    else:
        groups = [names[i::shards] for i in range(shards)]
        weight_map = {}
        for k, group in enumerate(groups, start=1):
            fname = f"model-{k:05d}-of-{shards:05d}.safetensors"
            save_file({n: state[n] for n in group}, str(folder / fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in group})
        total = sum(t.numel() * t.element_size() for t in state.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))

    tok.save(str(folder / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_positions,
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    gen = {"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]], "pad_token_id": ids["<|endoftext|>"]}
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return folder


# HF parameter name (layer part) -> GGUF tensor name, the inverse of llama.cpp's conversion.
_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GGUF_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}


def gguf_name(hf: str) -> str:
    if hf in _GGUF_TOP:
        return _GGUF_TOP[hf]
    _, _, n, rest = hf.split(".", 3)
    return f"blk.{n}.{_GGUF_LAYER[rest]}"


def _qtype(gguf: str, quantized: bool):
    """A mix of the types real files use, so several dequantizers are exercised."""
    from gguf import GGMLQuantizationType as Q

    if not quantized or gguf.endswith(".bias") or "norm" in gguf:
        return Q.F32
    for part, q in (("token_embd", Q.Q8_0), ("output", Q.F16), ("attn_q", Q.Q5_0), ("attn_k", Q.Q4_1),
                    ("attn_v", Q.Q8_0), ("attn_output", Q.BF16), ("ffn_gate", Q.Q4_0), ("ffn_up", Q.Q5_1)):
        if gguf.split(".")[-2] == part:
            return q
    return Q.Q8_0


def _default_like_qtype(gguf: str):
    """The default model's file's types (Q5_0 matrices, v in Q8_0 in even layers, ffn_down in Q6_K and Q4_K
    by turns, the head in Q8_0), for the quantized kernel's tests."""
    from gguf import GGMLQuantizationType as Q

    part = gguf.split(".")[-2]
    if gguf.endswith(".bias") or "norm" in gguf:
        return Q.F32
    if part == "output":
        return Q.Q8_0
    if part in ("attn_v", "ffn_down"):
        even = int(gguf.split(".")[1]) % 2 == 0
        return (Q.Q8_0 if even else Q.Q5_0) if part == "attn_v" else (Q.Q6_K if even else Q.Q4_K)
    return Q.Q5_0


def write_tiny_gguf(path: Path, family: str = "qwen2", tie: bool = False, seed: int = 0, quantized: bool = True,
                    like_default: bool = False, **shape) -> Path:
    """Write a tiny random GGUF file laid out as llama.cpp writes qwen2/qwen3 models.

    Shapes default to hidden 128, 2 heads of 64 (HF's GGUF loader assumes head_dim = hidden / heads).
    like_default: the tensor types of the default model's file (ffn_down in random K-quant blocks).
    """
    import gguf
    from safetensors.torch import load_file

    path = Path(path)
    shape = {"heads": 2, "kv_heads": 1, "head_dim": 64, "hidden": 128, **shape}
    src = write_tiny_checkpoint(path.with_suffix(".hf"), family, tie, seed, **shape)
    cfg = json.loads((src / "config.json").read_text())
    state = load_file(str(src / "model.safetensors"))
    tok = json.loads((src / "tokenizer.json").read_text())
    vocab = {t: i for t, i in tok["model"]["vocab"].items()}
    for added in tok["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    types = [3 if t in SPECIALS else 5 if t.startswith("[PAD") else 1 for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]

    w = gguf.GGUFWriter(str(path), family)
    w.add_name(f"tiny {family}")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    if family == "qwen3":
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if quantized else gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_pad_token_id(vocab["<|endoftext|>"])
    w.add_bos_token_id(vocab["<|endoftext|>"])
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    for hf in sorted(state, key=gguf_name):
        name = gguf_name(hf)
        arr = state[hf].numpy().astype(np.float32)
        q = _default_like_qtype(name) if like_default else _qtype(name, quantized)
        if q.name.endswith("_K"):
            from tfq.proofs.kernel_check_rowwise import random_blocks  # the gguf package cannot quantize to them

            data = random_blocks(q.name, *arr.shape, np.random.default_rng(seed + len(name)))
        else:
            data = gguf.quants.quantize(arr, q)
        w.add_tensor(name, data,
                     raw_dtype=None if q in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16) else q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


_MADE: dict[tuple, Path] = {}


def tiny_model_dir(tmp_path_factory, family: str = "qwen2", tie: bool = False, **kwargs) -> Path:
    """A tiny checkpoint folder, written once per test session for each set of arguments."""
    key = (id(tmp_path_factory), family, tie, tuple(sorted(kwargs.items())))
    if key not in _MADE:
        folder = tmp_path_factory.mktemp(f"tiny-{family}-{'tied' if tie else 'untied'}")
        _MADE[key] = write_tiny_checkpoint(folder, family, tie, **kwargs)
    return _MADE[key]


def tiny_gguf(tmp_path_factory, family: str = "qwen2", tie: bool = False, **kwargs) -> Path:
    """A tiny GGUF file, written once per test session for each set of arguments."""
    key = ("gguf", id(tmp_path_factory), family, tie, tuple(sorted(kwargs.items())))
    if key not in _MADE:
        folder = tmp_path_factory.mktemp(f"tiny-gguf-{family}")
        _MADE[key] = write_tiny_gguf(folder / f"tiny-{family}.gguf", family, tie, **kwargs)
    return _MADE[key]


def write_mlx_checkpoint(hf_folder: Path, out: Path, bits: int = 4, group: int = 64, dtype: str = "bfloat16") -> Path:
    """An MLX checkpoint of an HF one, `bits`-bit affine groups of `group`: by mlx-lm's own converter when mlx and
    mlx-lm install here (the real writer), else by the documented format (numpy: codes as little-endian bit
    streams in uint32 words, scales and biases in `dtype`, the weight round(round(q * scale) + bias))."""
    out = Path(out)
    try:
        from mlx_lm import convert
    except ImportError:
        return _write_mlx_by_format(Path(hf_folder), out, bits, group, dtype)
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        convert(str(hf_folder), str(out), quantize=True, q_group_size=group, q_bits=bits, dtype=dtype)
    return out


def _write_mlx_by_format(hf: Path, out: Path, bits: int, group: int, dtype: str) -> Path:
    import shutil

    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    for f in hf.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, out / f.name)
    state = {}
    dt = getattr(torch, dtype)
    for name, w in load_file(str(hf / "model.safetensors")).items():
        if w.ndim == 2 and name.endswith(".weight") and w.shape[1] % group == 0:
            module = name[:-len(".weight")]
            g = w.float().reshape(w.shape[0], -1, group)
            lo, hi = g.amin(-1), g.amax(-1)
            scale = ((hi - lo) / (2 ** bits - 1)).clamp_min(1e-8).to(dt)
            bias = lo.to(dt)
            q = ((g - bias.float()[..., None]) / scale.float()[..., None]).round().clamp(0, 2 ** bits - 1)
            bitstream = ((q.to(torch.int64).reshape(w.shape[0], -1, 1) >> torch.arange(bits)) & 1).reshape(
                w.shape[0], -1)
            words = (bitstream.reshape(w.shape[0], -1, 32).to(torch.int64) << torch.arange(32)).sum(-1)
            state[name] = torch.from_numpy(words.numpy().astype(np.uint32).view(np.int32)).view(torch.uint32)
            state[module + ".scales"], state[module + ".biases"] = scale, bias
        else:
            state[name] = w.to(dt) if w.is_floating_point() else w
    save_file(state, str(out / "model.safetensors"), metadata={"format": "mlx"})
    config = json.loads((hf / "config.json").read_text())
    config["quantization"] = {"group_size": group, "bits": bits}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


LLAMA_SDIST = "llama-cpp-python==0.3.36"  # carries llama.cpp's convert_hf_to_gguf.py and its gguf-py


def llama_converter(cache: Path) -> Path | None:
    """llama.cpp's source folder out of the llama-cpp-python sdist (downloaded once into `cache`), or None when
    the registry cannot be reached."""
    import subprocess
    import sys
    import tarfile

    found = sorted(cache.glob("llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    if found:
        return found[-1].parent
    cache.mkdir(parents=True, exist_ok=True)
    got = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                          "-d", str(cache), LLAMA_SDIST], capture_output=True, text=True, timeout=600)
    sdists = sorted(cache.glob("llama_cpp_python-*.tar.gz"))
    if got.returncode or not sdists:
        return None
    with tarfile.open(sdists[-1]) as tar:
        tar.extractall(cache, members=[m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name and
                                        ("/gguf-py/" in m.name or "/conversion/" in m.name or
                                         m.name.endswith(("convert_hf_to_gguf.py", "/models/templates")))],
                       filter="data")
    found = sorted(cache.glob("llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    return found[-1].parent if found else None


def llama_converted(root: Path, hf_folder: Path, out: Path, outtype: str) -> Path:
    """`hf_folder` converted by llama.cpp's converter (tests/llama_convert.py) into `out`."""
    import subprocess
    import sys

    script = Path(__file__).with_name("llama_convert.py")
    # a Qwen3.5 checkpoint may carry multi-token-prediction layers, which tfq does not run; the converter takes
    # the flag for those models only
    mtp = ["--no-mtp"] if json.loads((Path(hf_folder) / "config.json").read_text())["model_type"].startswith(
        "qwen3_5") else []
    done = subprocess.run([sys.executable, str(script), str(root), str(hf_folder), "--outfile", str(out),
                           "--outtype", outtype, *mtp], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def held_bytes(model) -> int:
    """The bytes a loaded model holds in its weights: every linear layer's panels or blob, norms, biases, a
    DeltaNet layer's own tensors, and the embedding (a table left in its file's blocks: those bytes)."""
    from tfq.model.gguf_kept import BlockRows
    from tfq.model.layers import linears

    size = lambda t: 0 if t is None else t.numel() * t.element_size()  # noqa: E731
    out = size(model.lm_head.panels) + size(model.norm)
    out += model.embed.raw.nbytes if isinstance(model.embed, BlockRows) else size(model.embed)
    for layer in model.layers:
        fns = list(linears(layer).values())
        if layer.moe is not None:  # the router, every expert, Qwen3.5's shared expert and its gate
            m = layer.moe
            fns += [m.router] + [f for e in m.experts + [m.shared] if e is not None for f in (e.gate_up, e.down)]
            fns += [m.shared_gate] if m.shared_gate is not None else []
        out += sum(size(f.panels) + size(f.bias) for f in fns)
        out += size(layer.input_norm) + size(layer.post_norm)
        if hasattr(layer, "mixer"):
            out += sum(size(getattr(layer.mixer, f)) for f in ("conv", "A", "dt_bias", "norm"))
        else:
            out += size(layer.q_norm) + size(layer.k_norm)
    return out


def resident_bytes(address: int | None = None, nbytes: int = 0, path: str | None = None) -> int:
    """This process's resident bytes (Linux) in [address, address + nbytes), page by page (/proc/self/pagemap's
    present bit: the OS may merge a mapping with its neighbours, so a mapping's own count would take theirs), or
    in every mapping of the file at `path` (/proc/self/smaps)."""
    if path is None:
        page = os.sysconf("SC_PAGE_SIZE")
        first, last = address // page, (address + nbytes - 1) // page
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(first * 8)
            entries = np.frombuffer(f.read((last - first + 1) * 8), dtype=np.uint64)
        return int(((entries >> np.uint64(63)) & np.uint64(1)).sum()) * page
    total, counting = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):  # a mapping's first line: start-end perms ...
                counting = head[-1] == str(path)
            elif counting and head[0] == "Rss:":
                total += int(head[1]) * 1024
    return total


# Thinking templates (tests/test_thinking.py, tests/test_responses.py): the generation prompt of each family's
# template, the rest as the tiny template's; Qwen3's writes an empty closed block when thinking is off, Qwen3.5's
# opens the block in the prompt
OFF = "{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}"
TEMPLATES = {  # the generation prompt of each family's template (the rest as the tiny template's)
    "qwen3": "{{- '<|im_start|>assistant\\n' }}" + OFF + "{%- endif %}",
    "qwen3_5": "{{- '<|im_start|>assistant\\n' }}" + OFF + "{%- else %}{{- '<think>\\n' }}{%- endif %}",
}
THOUGHT = "[a-z ]{4,24}</think>\n\n[a-z ]{4,24}"  # the reply's shape inside an opened block
SHAPES = {"qwen3": "<think>" + THOUGHT, "qwen3_5": THOUGHT}


def write_thinking_model(source: Path, folder: Path, family: str) -> Path:
    """A copy of the tiny checkpoint `source` whose chat template thinks as `family`'s does."""
    import shutil

    shutil.copytree(source, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    head = CHAT_TEMPLATE[:CHAT_TEMPLATE.index("{%- if add_generation_prompt %}")]
    config["chat_template"] = head + "{%- if add_generation_prompt %}" + TEMPLATES[family] + "{%- endif %}"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder
