"""Write a GGUF file of a real model's shape with random blocks, for benchmarks at sizes no hub can give here.

    python benchmarks/write_shape.py qwen3-14b /data/qwen3-14b-shape.gguf

The tensors are laid out as llama.cpp's converter writes a qwen3, qwen35 (Qwen3.5 hybrid) or qwen3moe (a mixture
of experts, each layer's experts stacked in one tensor a kind, the router in F32) model and typed as llama.cpp's
Q4_K_M mix does (Q4_K, with Q6_K for the head and for attn_v and ffn_down in the layers `use_more_bits` picks); their
blocks are random integers under fp16 scales sized like a trained model's (tfq.proofs.kernel_check_rowwise.
random_blocks), so activations stay finite through every layer. The tokenizer and chat template are the
default model's (Qwen2.5's 151,936 tokens, which Qwen3 shares; padded to Qwen3.5's 248,320). Nothing is held in memory
beyond one tensor: the header goes first, then each tensor is made and written in turn, with a progress bar.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

# name -> (architecture, layers, hidden, heads, kv heads, head dim, FFN, vocab); the published shapes
SHAPES = {
    "qwen3-4b": ("qwen3", 36, 2560, 32, 8, 128, 9728, 151936),
    "qwen3-14b": ("qwen3", 40, 5120, 40, 8, 128, 17408, 151936),
    "qwen3-32b": ("qwen3", 64, 5120, 64, 8, 128, 25600, 151936),
    "qwen3.5-27b": ("qwen35", 64, 5120, 24, 4, 256, 17408, 248320),
    "qwen3-30b-a3b": ("qwen3moe", 48, 2048, 32, 4, 128, 6144, 151936),
}
# a qwen3moe shape's mixture (Qwen3-30B-A3B's): experts, chosen a row, each expert's FFN
EXPERTS = {"qwen3-30b-a3b": (128, 8, 768)}
# a qwen35 shape's Gated DeltaNet layers (Qwen3.5-27B's): key heads, value heads, their dims, convolution taps;
# every fourth layer is gated full attention
DELTANET = {"qwen3.5-27b": (16, 48, 128, 128, 4)}


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down Q4_K_M keeps in Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensors(name: str) -> list[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, row-major shape, type) for every tensor of the shape, in llama.cpp's order. F32 vectors are
    norms (ones) unless named: ssm_a (negative), ssm_dt.bias and ssm_conv1d.weight (small)."""
    arch, layers, hidden, heads, kv, dim, ffn, vocab = SHAPES[name]
    out = [("token_embd.weight", (vocab, hidden), "Q4_K")]
    for i in range(layers):
        more = "Q6_K" if use_more_bits(i, layers) else "Q4_K"
        b = f"blk.{i}."
        mlp = [(b + "ffn_gate.weight", (ffn, hidden), "Q4_K"), (b + "ffn_up.weight", (ffn, hidden), "Q4_K"),
               (b + "ffn_down.weight", (hidden, ffn), more)]
        if arch == "qwen3moe":
            n, _, inter = EXPERTS[name]
            mlp = [(b + "ffn_gate_inp.weight", (n, hidden), "F32"),
                   (b + "ffn_gate_exps.weight", (n, inter, hidden), "Q4_K"),
                   (b + "ffn_up_exps.weight", (n, inter, hidden), "Q4_K"),
                   (b + "ffn_down_exps.weight", (n, hidden, inter), more)]
        if arch == "qwen35" and (i + 1) % 4:
            nk, nv, kd, vd, taps = DELTANET[name]
            channels = 2 * nk * kd + nv * vd
            out += [(b + "attn_norm.weight", (hidden,), "F32"), (b + "ssm_a", (nv,), "F32"),
                    (b + "ssm_conv1d.weight", (channels, taps), "F32"), (b + "ssm_dt.bias", (nv,), "F32"),
                    (b + "ssm_alpha.weight", (nv, hidden), "Q4_K"), (b + "ssm_beta.weight", (nv, hidden), "Q4_K"),
                    (b + "attn_qkv.weight", (channels, hidden), "Q4_K"),
                    (b + "attn_gate.weight", (nv * vd, hidden), "Q4_K"), (b + "ssm_norm.weight", (vd,), "F32"),
                    (b + "ssm_out.weight", (hidden, nv * vd), "Q4_K")]
            out += mlp + [(b + "post_attention_norm.weight", (hidden,), "F32")]
            continue
        gated = 2 if arch == "qwen35" else 1  # a qwen35 attention layer's q_proj holds each head's gate too
        after = "post_attention_norm.weight" if arch == "qwen35" else "ffn_norm.weight"
        out += [(b + "attn_norm.weight", (hidden,), "F32"),
                (b + "attn_q.weight", (gated * heads * dim, hidden), "Q4_K"),
                (b + "attn_k.weight", (kv * dim, hidden), "Q4_K"), (b + "attn_v.weight", (kv * dim, hidden), more),
                (b + "attn_output.weight", (hidden, heads * dim), "Q4_K"), (b + "attn_q_norm.weight", (dim,), "F32"),
                (b + "attn_k_norm.weight", (dim,), "F32"), (b + after, (hidden,), "F32")] + mlp
    return out + [("output_norm.weight", (hidden,), "F32"), ("output.weight", (vocab, hidden), "Q6_K")]


def tokenizer_fields(writer, vocab: int) -> None:
    """The default model's tokenizer, chat template and special ids, copied from its GGUF header; a larger
    vocabulary (Qwen3.5's 248,320 rows) is padded with unused tokens, as Qwen pads its own."""
    from tfq.model.gguf_header import read_header
    from tfq.model.source import gguf_path

    meta = read_header(gguf_path("default", progress=True)).metadata
    tokens, types = list(meta["tokenizer.ggml.tokens"]), list(meta["tokenizer.ggml.token_type"])
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab)]
    types += [5] * (vocab - len(types))  # 5: unused
    writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    writer.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    writer.add_pad_token_id(meta["tokenizer.ggml.padding_token_id"])
    writer.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(meta["tokenizer.chat_template"])


def values(name: str, kind: str, dims: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """A tensor's bytes: random blocks for a matrix (each expert's of a stack), made in slices of rows (bounded
    memory) into one array, or fp32 values (norms ones, as a fresh model's; a DeltaNet layer's A negative, dt bias
    and convolution small; a router's rows random, so each row picks its own experts)."""
    from tfq.proofs.kernel_check_rowwise import random_blocks

    if len(dims) == 3 and kind != "F32":
        return np.concatenate([values(name, kind, dims[1:], rng) for _ in range(dims[0])])
    if kind == "F32":
        if name.endswith("ffn_gate_inp.weight"):
            return rng.normal(0, dims[1] ** -0.5, dims).astype(np.float32)
        if name.endswith("ssm_a"):
            return -rng.uniform(0.5, 2.0, dims).astype(np.float32)
        if name.endswith(("ssm_dt.bias", "ssm_conv1d.weight")):
            return rng.uniform(-0.5, 0.5, dims).astype(np.float32)
        return np.ones(dims, dtype=np.float32)
    n, k = dims
    step = max(1, (1 << 22) // k)
    return np.concatenate([random_blocks(kind, min(step, n - r), k, rng) for r in range(0, n, step)])


def write(shape_name: str, path: Path, seed: int = 0) -> None:
    import gguf
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from tqdm import tqdm

    arch, layers, hidden, heads, kv, dim, ffn, vocab = SHAPES[shape_name]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"random {shape_name} shape")
    w.add_block_count(layers)
    w.add_context_length(262144 if arch == "qwen35" else 40960)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(dim)
    w.add_value_length(dim)
    w.add_rope_freq_base(1e7 if arch == "qwen35" else 1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    if arch == "qwen35":  # the keys llama.cpp's converter writes for Qwen3.5 (conversion/qwen.py)
        nk, nv, kd, vd, taps = DELTANET[shape_name]
        w.add_ssm_conv_kernel(taps)
        w.add_ssm_state_size(kd)
        w.add_ssm_group_count(nk)
        w.add_ssm_time_step_rank(nv)
        w.add_ssm_inner_size(vd * nv)
        w.add_array(f"{arch}.attention.recurrent_layers", [bool((i + 1) % 4) for i in range(layers)])
        w.add_uint32(f"{arch}.full_attention_interval", 4)
        w.add_rope_dimension_count(dim // 4)
        w.add_array(f"{arch}.rope.dimension_sections", [11, 11, 10, 0])
    if arch == "qwen3moe":  # the keys llama.cpp's converter writes for Qwen3 MoE
        n, chosen, inter = EXPERTS[shape_name]
        w.add_expert_count(n)
        w.add_expert_used_count(chosen)
        w.add_expert_feed_forward_length(inter)
    tokenizer_fields(w, vocab)
    table = tensors(shape_name)
    total = 0
    for name, dims, kind in table:
        qtype = GGMLQuantizationType[kind]
        per, size = GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(dims)) // per * size
        total += nbytes
        raw_shape = dims if kind == "F32" else (*dims[:-1], dims[-1] // per * size)
        w.add_tensor_info(name, raw_shape, np.dtype(np.float32 if kind == "F32" else np.uint8), nbytes,
                          None if kind == "F32" else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {path.name}") as bar:
        for name, dims, kind in table:
            data = values(name, kind, dims, rng)
            w.write_tensor_data(data)
            bar.update(data.nbytes)
    w.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("path", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    write(args.shape, args.path, args.seed)


if __name__ == "__main__":
    main()
