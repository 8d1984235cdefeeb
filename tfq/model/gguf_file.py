"""Read a qwen2/qwen3 GGUF file and convert it to an HF checkpoint folder (fp32 weights, tokenizer.json).

The header (metadata and tensor table) is parsed here directly: `gguf.GGUFReader` builds a numpy view per
vocabulary string and takes seconds on a 150k-token file, while `model_config` must be fast. Tensor bytes
are dequantized with `gguf.quants.dequantize`.
"""
from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from tfq.errors import TfqError
from tfq.model.config import ModelConfig

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF value types: id -> struct format (scalars); 8 is a string, 9 an array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9

# llama.cpp token types
CONTROL, USER_DEFINED = 3, 4

FAMILIES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# The split regex of Qwen2's tokenizer (also Qwen2.5 and Qwen3), keyed by the file's `tokenizer.ggml.pre`.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {"qwen2": QWEN2_SPLIT, "deepseek-r1-qwen": QWEN2_SPLIT, "megrez": QWEN2_SPLIT}

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF order (fastest-varying first), as ggml's ne
    ggml_type: int
    offset: int  # absolute byte offset in the file
    n_bytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The row-major (torch) shape: GGUF dims reversed."""
        return tuple(reversed(self.dims))


@dataclass(frozen=True)
class GgufHeader:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    file_size: int

    def tensor(self, name: str) -> TensorInfo | None:
        return next((t for t in self.tensors if t.name == name), None)


class _Cursor:
    def __init__(self, buf, pos: int = 0):
        self.buf, self.pos = buf, pos

    def scalar(self, fmt: str):
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.scalar("<Q")
        end = self.pos + n
        if end > len(self.buf):
            raise struct.error("string runs past the end of the file")
        s = bytes(self.buf[self.pos:end]).decode("utf-8", errors="surrogateescape")
        self.pos = end
        return s

    def value(self, vtype: int):
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.scalar("<I"), self.scalar("<Q")
            if etype in _NUMPY:
                dt = np.dtype(_NUMPY[etype])
                end = self.pos + count * dt.itemsize
                if end > len(self.buf):
                    raise struct.error("array runs past the end of the file")
                arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos).tolist()
                self.pos = end
                return arr
            return [self.value(etype) for _ in range(count)]
        raise ValueError(f"unknown GGUF value type {vtype}")


def read_header(path: Path) -> GgufHeader:
    """Metadata and tensor table of a GGUF file; TfqError if it is not one or is cut short."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size < 24:
                raise TfqError(f"{path}: too short to be a GGUF file ({size} bytes); the file may be truncated")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                header = _parse(path, mm, size)
    except OSError as e:
        raise TfqError(f"{path}: cannot read the GGUF file ({e.strerror or e})") from None
    end = max((t.offset + t.n_bytes for t in header.tensors), default=0)
    if end > size:
        raise TfqError(
            f"{path}: truncated GGUF file: its tensors need {end:,} bytes but the file has {size:,}; "
            "download or copy it again"
        )
    return header


def _parse(path: Path, mm, size: int) -> GgufHeader:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    if mm[:4] != MAGIC:
        raise TfqError(f"{path}: not a GGUF file (it does not start with 'GGUF')")
    c = _Cursor(mm, 4)
    try:
        version = c.scalar("<I")
        if version not in (2, 3):
            raise TfqError(f"{path}: GGUF version {version} is not supported (2 and 3 are; big-endian files are not)")
        n_tensors, n_kv = c.scalar("<Q"), c.scalar("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = c.string()
            metadata[key] = c.value(c.scalar("<I"))
        raw = []
        for _ in range(n_tensors):
            name = c.string()
            n_dims = c.scalar("<I")
            dims = tuple(c.scalar("<Q") for _ in range(n_dims))
            raw.append((name, dims, c.scalar("<I"), c.scalar("<Q")))
    except (struct.error, ValueError, IndexError) as e:
        raise TfqError(f"{path}: the GGUF header is cut short or damaged ({e}); the file may be truncated") from None
    align = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    data_start = (c.pos + align - 1) // align * align
    tensors = []
    for name, dims, gtype, rel in raw:
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(gtype)]
        except (ValueError, KeyError):
            raise TfqError(f"{path}: tensor {name} has unknown ggml type {gtype}") from None
        n_bytes = int(np.prod(dims, dtype=np.int64)) // block * type_size
        tensors.append(TensorInfo(name, dims, gtype, data_start + rel, n_bytes))
    return GgufHeader(path, version, metadata, tensors, size)


def _float32_repr(v: float) -> float:
    """GGUF stores floats as f32; write the shortest decimal that round-trips (1e-06, not 9.99999997e-07)."""
    return float(str(np.float32(v)))


def hf_config(h: GgufHeader) -> dict:
    """The HF config.json a conversion of this file writes."""
    md = h.metadata
    arch = md.get("general.architecture")
    if arch not in FAMILIES:
        raise TfqError(
            f"{h.path}: GGUF architecture {arch!r} is not supported; tfq runs {', '.join(sorted(FAMILIES))} models"
        )

    def key(name: str, default=None):
        v = md.get(f"{arch}.{name}", default)
        if v is None:
            raise TfqError(f"{h.path}: GGUF metadata lacks {arch}.{name}; the file is not a complete {arch} model")
        return v

    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    q = h.tensor("blk.0.attn_q.weight")
    head_dim = md.get(f"{arch}.attention.key_length") or (q.dims[1] // heads if q else hidden // heads)
    tokens = md.get("tokenizer.ggml.tokens")
    embd = h.tensor("token_embd.weight")
    vocab = len(tokens) if tokens is not None else (embd.dims[1] if embd else None)
    if vocab is None:
        raise TfqError(f"{h.path}: GGUF file has neither a vocabulary nor token_embd.weight")
    eos = md.get("tokenizer.ggml.eos_token_id")
    bos = md.get("tokenizer.ggml.bos_token_id")
    config = {
        "architectures": [FAMILIES[arch]],
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": int(head_dim),
        "max_position_embeddings": int(key("context_length", 32768)),
        "rope_theta": _float32_repr(key("rope.freq_base", 10000.0)),
        "rms_norm_eps": _float32_repr(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "hidden_act": "silu",
        "tie_word_embeddings": h.tensor("output.weight") is None,
        "torch_dtype": "float32",
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": None if eos is None else int(eos),
        "use_sliding_window": False,
        "attention_dropout": 0.0,
    }
    if arch == "qwen3":
        config["attention_bias"] = False
    scaling = _rope_scaling(h, arch)
    if scaling:
        config["rope_scaling"] = scaling
    ModelConfig.from_dict(config, str(h.path))  # refuse here what the converted folder would be refused for
    return config


# llama.cpp's rope.scaling keys that tfq does not compute, and their values that change nothing.
_NEUTRAL_SCALING = {"attn_factor": (1.0,), "yarn_log_multiplier": (0.0,), "yarn_ext_factor": (-1.0, 1.0),
                    "yarn_attn_factor": (1.0,), "finetuned": (True, False)}


def _rope_scaling(h: GgufHeader, arch: str) -> dict | None:
    """config.json's rope_scaling of a file written by llama.cpp's converter (`{arch}.rope.scaling.*`), or None.

    The converter writes type, factor and original_context_length for a yarn or linear checkpoint. Read as
    llama.cpp reads them: no type means linear, type none or a linear factor of 0 means no scaling. A key tfq
    would have to guess the meaning of is refused rather than dropped (dropping it runs the model wrong)."""
    prefix = f"{arch}.rope.scaling."
    md = {k[len(prefix):]: v for k, v in h.metadata.items() if k.startswith(prefix)}
    if "factor" not in md and f"{arch}.rope.scale_linear" in h.metadata:
        md["factor"] = h.metadata[f"{arch}.rope.scale_linear"]  # the key's older name
    kind = md.pop("type", "linear")
    if kind == "none" or (kind == "linear" and not md.get("factor")):
        return None
    if kind not in ("linear", "yarn"):
        raise TfqError(f"{h.path}: GGUF {prefix}type {kind!r} is not supported; tfq runs none, linear and yarn "
                       f"rope scaling")
    if not md.get("factor"):
        raise TfqError(f"{h.path}: GGUF {prefix}type is yarn but {prefix}factor is missing or 0; "
                       f"the file is incomplete: convert the checkpoint again")
    out: dict[str, Any] = {"rope_type": kind, "factor": _float32_repr(md.pop("factor"))}
    if kind == "yarn":
        if "original_context_length" in md:
            out["original_max_position_embeddings"] = int(md.pop("original_context_length"))
        for key in ("beta_fast", "beta_slow"):
            if f"yarn_{key}" in md:
                out[key] = _float32_repr(md.pop(f"yarn_{key}"))
    for key, value in md.items():
        if value not in _NEUTRAL_SCALING.get(key, ()):
            raise TfqError(f"{h.path}: GGUF metadata {prefix}{key} = {value!r} is not supported; tfq computes "
                           f"{kind} rope scaling from type, factor and original_context_length only")
    return out


def hf_name(name: str) -> str:
    """The HF parameter name of a GGUF tensor name."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    raise KeyError(name)


def tensor_names(h: GgufHeader) -> list[tuple[str, TensorInfo]]:
    """(HF name, tensor) for every tensor, in HF name order; TfqError on a tensor tfq does not know."""
    out = []
    for t in h.tensors:
        try:
            out.append((hf_name(t.name), t))
        except KeyError:
            raise TfqError(f"{h.path}: unexpected tensor {t.name!r}; tfq reads qwen2/qwen3 GGUF files") from None
    return sorted(out, key=lambda p: p[0])


def dequantized(h: GgufHeader, data: np.ndarray, t: TensorInfo) -> np.ndarray:
    """One tensor as float32, in its row-major shape."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType(t.ggml_type)
    rows = t.shape[:-1]
    raw = data[t.offset:t.offset + t.n_bytes].reshape(*rows, t.n_bytes // max(1, int(np.prod(rows, dtype=np.int64))))
    try:
        out = dequantize(raw, qtype)
    except NotImplementedError:
        raise TfqError(f"{h.path}: tensor {t.name} is {qtype.name}, which the gguf package cannot dequantize") from None
    out = np.asarray(out, dtype=np.float32).reshape(t.shape)
    return out


def iter_tensors(h: GgufHeader) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, float32 array) in HF name order, one dequantized at a time."""
    names = tensor_names(h)
    data = np.memmap(h.path, dtype=np.uint8, mode="r")
    for name, t in names:
        yield name, dequantized(h, data, t)


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
        raise TfqError(f"{h.path}: tokenizer pre-tokenizer {pre!r} is not supported (known: {sorted(PRE_TOKENIZER_SPLITS)})")
    types = md.get("tokenizer.ggml.token_type") or [1] * len(tokens)

    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    byte_map = _bytes_to_unicode()

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


def _bytes_to_unicode() -> dict[int, str]:
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


def convert(
    path: Path, out: Path, progress: bool = True, header: GgufHeader | None = None, label: str | None = None
) -> None:
    """Write `out` (an existing empty folder) as an HF checkpoint of the GGUF file at `path`."""
    from tfq.model.weights import write_safetensors

    h = header or read_header(path)
    config = hf_config(h)
    tok, tok_config, gen_config = build_tokenizer(h)
    names = tensor_names(h)
    shapes = {name: t.shape for name, t in names}
    write_safetensors(
        out / "model.safetensors", shapes, iter_tensors(h),
        progress=progress, desc=f"converting {label or Path(path).name}",
    )
    tok.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", tok_config)
    _write_json(out / "generation_config.json", gen_config)
    _write_json(out / "config.json", config)


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
