"""From a model spec (default, HF folder, .gguf) to a ready model and its tokenizer."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tfq.errors import TfqError
from tfq.kernels.backend import Backend, torch_backend, triton_backend
from tfq.model.config import ModelConfig
from tfq.model.footprint import activations_of, weights_kind
from tfq.model.qwen import Qwen


@dataclass
class LoadedModel:
    folder: Path
    config: ModelConfig
    model: Qwen
    tokenizer: object  # tfq.model.tokenizer.Tokenizer
    weights: str = "fp32"  # fp32 | gguf | mlx: how the matrices are kept (load_model's `weights`)


def load_model(spec: str, progress: bool = True, device: str | torch.device = "cpu",
               weights: str = "auto", tp: int = 1, group=None, reduce: bool = False) -> LoadedModel:
    """device: where the model runs (cpu: the torch kernels; cuda: the Triton kernels). weights: fp32 (every
    tensor as float32), gguf (a GGUF's quantized matrices kept in their blocks: tfq.kernels.quant), mlx (an MLX
    checkpoint's affine groups kept: tfq.model.mlx), gguf-q8 (gguf, activations rounded to 8 bits: llama.cpp's
    kind of arithmetic, docs/quantized.md) or auto (`weights_kind`). tp: split over this many ranks
    (tfq/parallel: rank 0's shard is returned, the other ranks load theirs); group: a rank's end of the group
    (the ranks call this with it); reduce: the all-reduce control's split."""
    if tp > 1:
        from tfq.model.source import resolve_model
        from tfq.parallel.ranks import ModelSpec, ranks

        if ModelConfig.from_folder(resolve_model(spec, progress=False, weights=False)).moe is not None:
            raise TfqError(f"tp: {tp} does not split a mixture of experts yet (tensor parallelism splits dense "
                           f"matrices and attention heads); use tp: 1 for {spec}")
        return ranks(tp, torch.device(device)).load(ModelSpec(spec, str(device), weights, reduce), load_shard, progress)
    from tfq.model.source import resolve_model
    from tfq.model.tokenizer import Tokenizer

    if progress:
        _say_if_building(torch.device(device))
    backend = backend_for(torch.device(device))
    kind = weights_kind(weights, spec, device)[0]
    if weights == "auto" and backend.quant_linear is None:  # tfq's CPU kernels did not build here
        kind = "fp32"
    folder = resolve_model(spec, progress=progress, weights=False)  # a GGUF's weights are read from the file
    config = ModelConfig.from_folder(folder)
    tokenizer = Tokenizer.from_folder(folder)
    tensors = model_weights(spec, folder, kind, backend, progress)
    if group is None:
        return LoadedModel(folder, config, Qwen(config, tensors, backend), tokenizer, kind)
    from tfq.parallel.model import ShardedQwen
    from tfq.parallel.shard import Shard

    model = ShardedQwen(config, tensors, backend, Shard(config, group.rank, group.world, reduce), group)
    return LoadedModel(folder, config, model, tokenizer, kind)


def load_shard(what, group, progress: bool = False):
    """This rank's shard, or the one line saying why it could not load (every rank must answer)."""
    try:
        loaded = load_model(what.spec, progress=progress, device=group.device, weights=what.weights, group=group,
                            reduce=what.reduce)
        loaded.model.what = what  # the name rank 0's forwards give it
        return loaded, ""
    except TfqError as e:
        return None, f"rank {group.rank}: {e}" if group.rank else str(e)
    except Exception as e:  # noqa: BLE001 - a rank's crash must reach rank 0 as a line, not a hang
        return None, f"rank {group.rank} could not load its shard: {type(e).__name__}: {e}"


def model_weights(spec: str, folder: Path, weights: str, backend: Backend, progress: bool = True) -> dict:
    """The model's tensors by HF name, as `weights` says they are kept."""
    from tfq.model.gguf_file import read_header
    from tfq.model.gguf_kept import kept_tensors
    from tfq.model.gguf_tensors import fp32_tensors
    from tfq.model.source import gguf_path
    from tfq.model.weights import lazy_state_dict

    if weights == "fp32" and gguf_path(spec, progress) is not None:  # a GGUF file: dequantized as taken
        return fp32_tensors(read_header(gguf_path(spec, progress)))
    if weights in ("fp32", "mlx"):
        from tfq.model.mlx import folder_quantization, load_mlx_state

        quant = folder_quantization(folder)  # an MLX checkpoint's groups: dequantized as MLX does, or kept
        if weights == "mlx" and quant is None:
            raise TfqError(f"weights: mlx keeps an MLX checkpoint's quantized groups, and {spec} is not one; set "
                           f"weights: fp32")
        if weights == "mlx" and backend.quant_linear is None:
            raise TfqError(f"weights: mlx keeps an MLX checkpoint's quantized groups on tfq's CPU kernels, which "
                           f"this run does not have ({backend.where}); set weights: fp32")
        if quant is None:
            return lazy_state_dict(folder)
        return load_mlx_state(folder, quant, keep=weights == "mlx")
    if backend.quant_linear is None:
        raise TfqError(f"weights: {weights} computes with tfq's CPU kernels, which this run does not have "
                       f"({backend.where}); set weights: fp32")
    path = gguf_path(spec, progress)
    if path is None:
        raise TfqError(f"weights: {weights} keeps a GGUF file's quantized blocks, and {spec} is an HF folder; "
                       f"set weights: fp32, or run a .gguf model")
    return kept_tensors(read_header(path), activations=activations_of(weights))


def _say_if_building(device: torch.device) -> None:
    """One line before tfq's CPU kernels compile for this machine (once, about 30 s), so the wait is explained."""
    import sys

    from tfq.kernels import cpu_build

    try:
        if device.type == "cpu" and cpu_build.choice() != "torch" and not cpu_build.built() and not cpu_build.cached():
            print("tfq: building its CPU kernels for this machine (once, about 30 s)", file=sys.stderr, flush=True)
    except (ValueError, OSError, AttributeError):
        pass  # a bad TFQ_CPU_KERNELS is reported by backend_for, in its own words


def _say_emulated(march: str) -> None:
    """One line, once a process, where the kernels have no fused multiply-add instruction to run on."""
    import sys

    if getattr(_say_emulated, "said", False):
        return
    _say_emulated.said = True
    why = f"built for -march={march} (TFQ_CPU_MARCH)" if march != "native" else "this CPU has no FMA instruction"
    print(f"tfq: slow build: {why}, so tfq's kernels compute every fused multiply-add exactly from doubles (the same "
          f"bits as on CPUs with FMA, about 18x slower); on a CPU with FMA (x86-64 since 2013, any ARMv8) leave "
          f"TFQ_CPU_MARCH unset", file=sys.stderr, flush=True)


def backend_for(device: torch.device) -> Backend:
    """The kernels for `device`: torch on the CPU, Triton on CUDA."""
    if device.type == "cpu":
        from tfq.kernels import cpu_build

        try:
            if cpu_build.wanted() and cpu_build.lanes() == cpu_build.EMULATED:
                _say_emulated(cpu_build.march())
        except (ValueError, RuntimeError) as e:
            hint = "; install a C++ compiler (gcc) or set TFQ_CPU_KERNELS=auto" if isinstance(e, RuntimeError) else ""
            raise TfqError(f"{e}{hint}") from None
        return torch_backend()
    if device.type != "cuda":
        raise TfqError(f"device {device} is not supported; use cpu or cuda")
    backend, why = triton_backend(device)
    if backend is None or backend.device.type != "cuda":
        raise TfqError(f"device {device}: the Triton kernels cannot run ({why}); use device: cpu")
    return backend
