"""Write a GGUF file of a real model's shape with random blocks, for benchmarks at sizes no hub can give here.

    python benchmarks/write_shape.py qwen3-14b /data/qwen3-14b-shape.gguf

The tensors are laid out as llama.cpp's converter writes a qwen3 model and typed as llama.cpp's Q4_K_M mix
does (Q4_K, with Q6_K for the head and for attn_v and ffn_down in the layers `use_more_bits` picks); their blocks
are random integers under fp16 scales sized like a trained model's (tfq.proofs.kernel_check_rowwise.
random_blocks), so activations stay finite through every layer. The tokenizer and chat template are the
default model's (Qwen2.5's 151,936 tokens, which Qwen3 shares). Nothing is held in memory beyond one tensor:
the header goes first, then each tensor is made and written in turn, with a progress bar.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

# name -> (layers, hidden, heads, kv heads, head dim, FFN); Qwen3's published shapes
SHAPES = {
    "qwen3-14b": (40, 5120, 40, 8, 128, 17408),
    "qwen3-32b": (64, 5120, 64, 8, 128, 25600),
    "qwen3-4b": (36, 2560, 32, 8, 128, 9728),
}
VOCAB = 151936


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down Q4_K_M keeps in Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensors(shape: tuple) -> list[tuple[str, tuple[int, int] | tuple[int], str]]:
    """(GGUF name, row-major shape, type) for every tensor of a qwen3 model of this shape, in llama.cpp's order."""
    layers, hidden, heads, kv, dim, ffn = shape
    out = [("token_embd.weight", (VOCAB, hidden), "Q4_K")]
    for i in range(layers):
        more = "Q6_K" if use_more_bits(i, layers) else "Q4_K"
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (hidden,), "F32"), (b + "attn_q.weight", (heads * dim, hidden), "Q4_K"),
                (b + "attn_k.weight", (kv * dim, hidden), "Q4_K"), (b + "attn_v.weight", (kv * dim, hidden), more),
                (b + "attn_output.weight", (hidden, heads * dim), "Q4_K"), (b + "attn_q_norm.weight", (dim,), "F32"),
                (b + "attn_k_norm.weight", (dim,), "F32"), (b + "ffn_norm.weight", (hidden,), "F32"),
                (b + "ffn_gate.weight", (ffn, hidden), "Q4_K"), (b + "ffn_up.weight", (ffn, hidden), "Q4_K"),
                (b + "ffn_down.weight", (hidden, ffn), more)]
    return out + [("output_norm.weight", (hidden,), "F32"), ("output.weight", (VOCAB, hidden), "Q6_K")]


def tokenizer_fields(writer) -> None:
    """The default model's tokenizer, chat template and special ids, copied from its GGUF header."""
    from tfq.model.gguf_header import read_header
    from tfq.model.source import gguf_path

    meta = read_header(gguf_path("default", progress=True)).metadata
    writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    writer.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    writer.add_pad_token_id(meta["tokenizer.ggml.padding_token_id"])
    writer.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(meta["tokenizer.chat_template"])


def block(kind: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks for an [n, k] matrix, made in slices of rows (bounded memory) into one array."""
    from tfq.proofs.kernel_check_rowwise import random_blocks

    if kind == "F32":
        return np.ones((n,) if k == 0 else (n, k), dtype=np.float32)  # norms: ones, as a fresh model's
    step = max(1, (1 << 22) // k)
    return np.concatenate([random_blocks(kind, min(step, n - r), k, rng) for r in range(0, n, step)])


def write(shape_name: str, path: Path, seed: int = 0) -> None:
    import gguf
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from tqdm import tqdm

    shape = SHAPES[shape_name]
    layers, hidden, heads, kv, dim, ffn = shape
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_name(f"random {shape_name} shape")
    w.add_block_count(layers)
    w.add_context_length(40960)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(dim)
    w.add_value_length(dim)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    tokenizer_fields(w)
    table = tensors(shape)
    total = 0
    for name, dims, kind in table:
        qtype = GGMLQuantizationType[kind]
        per, size = GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(dims)) // per * size
        total += nbytes
        raw_shape = dims if kind == "F32" else (dims[0], dims[1] // per * size)
        w.add_tensor_info(name, raw_shape, np.dtype(np.float32 if kind == "F32" else np.uint8), nbytes,
                          None if kind == "F32" else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {path.name}") as bar:
        for name, dims, kind in table:
            data = block(kind, dims[0], dims[1] if len(dims) == 2 else 0, rng)
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
