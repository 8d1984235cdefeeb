"""One interface to the kernels, two implementations: torch on the CPU, Triton on a GPU.

The model, the cache and the kernel check hold a Backend and call its linear, rms_norm, attend and store;
none of them asks where a tensor lives. Both implementations keep the arithmetic contract (docs/contract.md);
their bits differ from each other, and each obeys the exactness rule on its own.

The Triton backend also runs on the CPU under TRITON_INTERPRET=1 (slowly): that is how the tests and CI
check it without a GPU. The variable is read when the kernels are defined, so it must be set before
kernels.triton_attention or kernels.triton_rowwise is first imported.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from .contract import LinearFn

TRITON_MODULES = tuple(f"{__package__}.{m}" for m in ("triton_attention", "triton_rowwise"))


@dataclass(frozen=True)
class Backend:
    name: str  # torch | triton
    device: torch.device
    where: str  # "CPU", "interpreter (CPU)" or the GPU's name
    linear: Callable[[torch.Tensor, torch.Tensor | None], LinearFn]  # (weight [out, in], bias) -> y = x W^T + b
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]  # (x [..., n], weight [n], eps)
    attend: Callable[..., torch.Tensor]  # kernels.attention.attend's signature
    store: Callable[..., None]  # (cache_k, cache_v, rows, k, v, dtype_name): new keys/values into the cache
    silu: Callable[[torch.Tensor], torch.Tensor]  # the MLP's activation, x * sigmoid(x)
    layer: Callable[..., torch.Tensor] | None = None  # a whole decoder layer in one call (kernels/layer.py)
    quant_linear: Callable[..., LinearFn] | None = None  # (Quantized, bias) -> layer, on GGUF blocks (kernels/quant.py)
    delta_layer: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None  # a hybrid's DeltaNet layer in one call
    attention_layer: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None  # a mixture's attention half
    # a mixture's routes (ids, weights, unsure rows), and its experts with their combine (kernels/moe.py)
    moe_route: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
    moe_mixture: Callable[..., torch.Tensor] | None = None
    # a model's attention layers (dense, or mixtures of experts) as one object, and a forward through them in one
    # call (kernels/layer.py)
    stack: Callable[..., object] | None = None
    stack_forward: Callable[..., tuple] | None = None

    @property
    def interpreted(self) -> bool:
        """Triton under TRITON_INTERPRET=1: the tests' harness, never a user's run."""
        return self.where.startswith("interpreter")


def torch_backend() -> Backend:
    from . import cpu_build
    from .attention import attend, attend_fixed, write
    from .rowwise import OneDnnLinear, onednn_available, rms_norm, silu

    if cpu_build.wanted():  # tfq's C++ kernels (kernels/cpu/): every output one fixed-order computation
        from .layer import attention_layer_fixed, decoder_layer_fixed, delta_layer_fixed, layer_stack, stack_forward
        from .moe import mixture_fixed, route_fixed
        from .quant import QuantLinear
        from .rowwise import FixedOrderLinear, rms_norm_fixed, silu_fixed

        return Backend("torch", torch.device("cpu"), "CPU, tfq's fixed-order kernels (linear layers, attention, "
                       "RMS norm, SiLU)", FixedOrderLinear, rms_norm_fixed, attend_fixed, write, silu_fixed,
                       decoder_layer_fixed, QuantLinear, delta_layer_fixed, attention_layer_fixed, route_fixed,
                       mixture_fixed, layer_stack, stack_forward)
    linear = "oneDNN (packed fp32)" if onednn_available() else "torch, one row at a time"
    return Backend("torch", torch.device("cpu"), f"CPU, linear layers by {linear}, attention as bmm items",
                   OneDnnLinear, rms_norm, attend, write, silu)


def triton_backend(device: torch.device | None = None) -> tuple[Backend | None, str]:
    """The Triton kernels on CUDA, or under the interpreter on a machine without it; (None, why) if neither."""
    cuda = torch.cuda.is_available()
    if not cuda and not any(m in sys.modules for m in TRITON_MODULES):
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        from . import triton_attention as ta
        from . import triton_rowwise as tr
    except ImportError as e:
        return None, f"triton is not importable ({e})"
    interpreted = type(ta._rows_kernel).__name__ == "InterpretedFunction"
    if not cuda and not interpreted:
        return None, ("the Triton kernels were imported without TRITON_INTERPRET=1 on a machine without CUDA; "
                      "run in a fresh process")
    if interpreted:
        device, where = torch.device("cpu"), "interpreter (CPU)"
    else:
        device = torch.device(device if device is not None else "cuda")
        where = torch.cuda.get_device_name(device)

    def linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> LinearFn:
        return tr.TritonLinear(weight, bias, device)

    from .rowwise import silu

    return Backend("triton", device, where, linear, tr.rms_norm, ta.attend, ta.write, silu), where
