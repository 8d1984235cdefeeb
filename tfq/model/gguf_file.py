"""Convert a qwen2/qwen3 GGUF file to an HF checkpoint folder (fp32 weights, tokenizer.json): the one door to
GGUF files that the rest of tfq (model/source.py, model/default.py) goes through.

Each part has its own module: the header (gguf_header), the tensors (gguf_tensors), config.json (gguf_config),
the tokenizer (gguf_tokenizer).
"""
from __future__ import annotations

import json
from pathlib import Path

from tfq.model.gguf_config import hf_config
from tfq.model.gguf_header import MAGIC, GgufHeader, read_header
from tfq.model.gguf_tensors import hf_layouts, hf_name, hf_shape, iter_tensors, tensor_names
from tfq.model.gguf_tokenizer import build_tokenizer

# Callers reach GGUF files through this module's names (and tests replace read_header and convert here to see
# that a cached conversion is not redone), so the parts' entry points stay names of this module.
__all__ = ["MAGIC", "WEIGHTS", "GgufHeader", "build_tokenizer", "convert", "write_weights", "hf_config", "hf_name",
           "iter_tensors", "read_header", "tensor_names"]


WEIGHTS = "model.safetensors"  # a converted folder's fp32 weights (written only when asked for)


def convert(
    path: Path, out: Path, progress: bool = True, header: GgufHeader | None = None, label: str | None = None,
    weights: bool = True,
) -> None:
    """Write `out` (an existing empty folder) as an HF checkpoint of the GGUF file at `path`: config and
    tokenizer from its header, and, with `weights`, every tensor dequantized to fp32."""
    h = header or read_header(path)
    config = hf_config(h)
    tok, tok_config, gen_config = build_tokenizer(h)
    if weights:
        write_weights(path, out / WEIGHTS, progress, h, label)
    tok.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", tok_config)
    _write_json(out / "generation_config.json", gen_config)
    _write_json(out / "config.json", config)


def write_weights(path: Path, dest: Path, progress: bool = True, header: GgufHeader | None = None,
                  label: str | None = None) -> None:
    """The GGUF file's tensors as one fp32 safetensors file at `dest`, one tensor in memory at a time."""
    from tfq.model.weights import write_safetensors

    h = header or read_header(path)
    layouts = hf_layouts(h)
    shapes = {name: hf_shape(t, layouts.get(t.name)) for name, t in tensor_names(h)}
    write_safetensors(dest, shapes, iter_tensors(h), progress=progress,
                      desc=f"converting {label or Path(path).name}")


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
