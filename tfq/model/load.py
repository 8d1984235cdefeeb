"""From a model spec (default, HF folder, .gguf) to a ready model and its tokenizer."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tfq.model.config import ModelConfig
from tfq.model.qwen import Qwen


@dataclass
class LoadedModel:
    folder: Path
    config: ModelConfig
    model: Qwen
    tokenizer: object  # tfq.model.tokenizer.Tokenizer


def load_model(spec: str, progress: bool = True) -> LoadedModel:
    from tfq.model.source import resolve_model
    from tfq.model.tokenizer import Tokenizer
    from tfq.model.weights import load_state_dict

    folder = resolve_model(spec, progress=progress)
    config = ModelConfig.from_folder(folder)
    tokenizer = Tokenizer.from_folder(folder)
    model = Qwen(config, load_state_dict(folder))
    return LoadedModel(folder, config, model, tokenizer)
