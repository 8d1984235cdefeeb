"""A model's identity (receipts, the prefix store on disk): a sha256 of what decides its arithmetic, the same
wherever the files sit.

A GGUF file (the default model's joined parts too) is its own sha256; an HF or MLX folder is a sha256 over its
config and weight files, by name and content. Each file's hash is remembered by its path, size and time
(tfq/model/source.py: file_sha256), so a model is hashed once, not on every start.
"""
from __future__ import annotations

import hashlib

from tfq.model import default


def weights_sha256(spec: str) -> str:
    """The identity of model `spec` (`default`, an HF or MLX folder, a .gguf file)."""
    from tfq.model.source import _existing, file_sha256

    if spec == "default":
        return default.SHA256  # the joined file is checked against it when it is made
    from tfq.model.hub import is_hub_name, local_model

    path = _existing(local_model(spec) if is_hub_name(spec) else spec)
    if not path.is_dir():
        return file_sha256(path, progress=False)
    from tfq.model.weights import safetensors_files

    files = [path / "config.json", *safetensors_files(path)]
    lines = "".join(f"{f.name} {file_sha256(f, progress=False)}\n" for f in files)
    return hashlib.sha256(lines.encode()).hexdigest()

