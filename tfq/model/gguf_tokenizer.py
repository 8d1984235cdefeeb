"""The tokenizer of a GGUF file: a `tokenizers` byte-level BPE built from its vocabulary and merges, as Qwen2's
own tokenizer.json is, with tokenizer_config and generation_config from its metadata."""
from __future__ import annotations

from tfq.errors import TfqError
from tfq.model.gguf_header import GgufHeader

# llama.cpp token types
CONTROL, USER_DEFINED = 3, 4

# The split regex of Qwen2's tokenizer (also Qwen2.5 and Qwen3), keyed by the file's `tokenizer.ggml.pre`.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {"qwen2": QWEN2_SPLIT, "deepseek-r1-qwen": QWEN2_SPLIT, "megrez": QWEN2_SPLIT}


def build_tokenizer(h: GgufHeader):
    """(tokenizers.Tokenizer, tokenizer_config dict, generation_config dict) from the file's vocabulary."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    md = h.metadata
    kind, pre = md.get("tokenizer.ggml.model"), md.get("tokenizer.ggml.pre")
    tokens, merges = md.get("tokenizer.ggml.tokens"), md.get("tokenizer.ggml.merges")
    if kind != "gpt2" or not tokens or merges is None:
        raise TfqError(f"{h.path}: tokenizer {kind!r} is not a byte-level BPE with merges; tfq reads Qwen GGUF files")
    if pre not in PRE_TOKENIZER_SPLITS:
        raise TfqError(f"{h.path}: tokenizer pre-tokenizer {pre!r} is not supported "
                       f"(known: {sorted(PRE_TOKENIZER_SPLITS)})")
    types = md.get("tokenizer.ggml.token_type") or [1] * len(tokens)

    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    byte_map = bytes_to_unicode()

    def spelled(tok: str) -> str:
        # every token of a byte-level vocabulary is written in the byte alphabet; respell any that is not
        return tok if set(tok) <= alphabet else "".join(byte_map[b] for b in tok.encode("utf-8"))

    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(spelled(tok), i)
    pairs = []
    for m in merges:
        a, _, b = m.partition(" ")
        pairs.append((a, b))
    bpe = BPE(
        vocab=vocab, merges=pairs, unk_token=None, continuing_subword_prefix="", end_of_word_suffix="",
        fuse_unk=False, byte_fallback=False, ignore_merges=False,
    )
    tok = Tokenizer(bpe)
    # As in Qwen2's own tokenizer.json: NFC, then the split regex, then bytes to the byte alphabet.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE_TOKENIZER_SPLITS[pre]), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.add_special_tokens([
        AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == CONTROL
    ])
    tok.add_tokens([
        AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED
    ])

    def name(key: str) -> str | None:
        i = md.get(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    eos_id = md.get("tokenizer.ggml.eos_token_id")
    template = md.get("tokenizer.chat_template")
    tok_config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": name("bos_token_id"),
        "eos_token": name("eos_token_id"),
        "pad_token": name("padding_token_id"),
        "unk_token": None,
        "add_bos_token": bool(md.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(md.get("tokenizer.ggml.add_eos_token", False)),
        "model_max_length": int(md.get(f"{md.get('general.architecture')}.context_length", 32768)),
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "errors": "replace",
    }
    if template:
        tok_config["chat_template"] = template
    eos_ids = [int(eos_id)] if eos_id is not None else []
    if "<|endoftext|>" in vocab and vocab["<|endoftext|>"] not in eos_ids:
        eos_ids.append(vocab["<|endoftext|>"])
    gen_config = {"eos_token_id": eos_ids}
    for key, field in (("bos_token_id", "bos_token_id"), ("pad_token_id", "padding_token_id")):
        if md.get(f"tokenizer.ggml.{field}") is not None:
            gen_config[key] = int(md[f"tokenizer.ggml.{field}"])
    return tok, tok_config, gen_config


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: printable bytes stand for themselves, the rest map to chars from U+0100."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))
