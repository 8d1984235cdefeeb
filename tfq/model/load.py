"""From a model spec (default, HF folder, .gguf) to a ready model and its tokenizer."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tfq.errors import TfqError
from tfq.kernels.backend import Backend, torch_backend, triton_backend
from tfq.model.config import ModelConfig
from tfq.model.qwen import Qwen


@dataclass
class LoadedModel:
    folder: Path
    config: ModelConfig
    model: Qwen
    tokenizer: object  # tfq.model.tokenizer.Tokenizer


def load_model(spec: str, progress: bool = True, device: str | torch.device = "cpu") -> LoadedModel:
    """device: where the model runs (cpu: the torch kernels; cuda: the Triton kernels)."""
    from tfq.model.source import resolve_model
    from tfq.model.tokenizer import Tokenizer
    from tfq.model.weights import load_state_dict

    folder = resolve_model(spec, progress=progress)
    config = ModelConfig.from_folder(folder)
    tokenizer = Tokenizer.from_folder(folder)
    if progress:
        _say_if_building(torch.device(device))
    model = Qwen(config, load_state_dict(folder), backend_for(torch.device(device)))
    return LoadedModel(folder, config, model, tokenizer)


def _say_if_building(device: torch.device) -> None:
    """One line before tfq's CPU kernels compile for this machine (once, about 10 s), so the wait is explained."""
    import sys

    from tfq.kernels import cpu_build

    try:
        if device.type == "cpu" and cpu_build.choice() != "torch" and not cpu_build.built() and not cpu_build.cached():
            print("tfq: building its CPU kernels for this machine (once, about 10 s)", file=sys.stderr, flush=True)
    except (ValueError, OSError, AttributeError):
        pass  # a bad TFQ_CPU_KERNELS is reported by backend_for, in its own words


def backend_for(device: torch.device) -> Backend:
    """The kernels for `device`: torch on the CPU, Triton on CUDA."""
    if device.type == "cpu":
        from tfq.kernels import cpu_build

        try:
            cpu_build.wanted()
        except (ValueError, RuntimeError) as e:
            raise TfqError(f"{e}; install a C++ compiler (gcc) or set TFQ_CPU_KERNELS=auto" if isinstance(e, RuntimeError)
                           else str(e)) from None
        return torch_backend()
    if device.type != "cuda":
        raise TfqError(f"device {device} is not supported; use cpu or cuda")
    backend, why = triton_backend(device)
    if backend is None or backend.device.type != "cuda":
        raise TfqError(f"device {device}: the Triton kernels cannot run ({why}); use device: cpu")
    return backend
