"""A whole decoder layer in one call to tfq's C++ kernels (kernels/cpu/layer.cpp for attention layers, a
hybrid's gated ones included; kernels/cpu/delta_layer.cpp for a hybrid's DeltaNet layers): the same ops in the
same order as the layer written op by op (tfq/model/qwen.py), so the same bits by construction, and the start-up
guard checks on the running build that both give every row the same bits (tfq/engine/layer_guard.py).

It exists for speed alone: at one lane a decode step spent several milliseconds between its linear layers
dispatching ~25 small ops a layer from Python, each on cold caches after a linear layer's stream of weights.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import cpu_build
from .attention import attention_tables
from .contract import KEY_TILE, SATURATE, SPLIT_ROWS, AttentionBatch, LinearFn
from .delta import DeltaSizes, DeltaWeights
from .quant import QuantLinear
from .rowwise import FixedOrderLinear


def fusable(*linears) -> bool:
    """Whether these layers are tfq's C++ linear kernels (fp32 panels or quantized blobs), which the one-call
    layer runs (and nothing else)."""
    return all(type(f) in (FixedOrderLinear, QuantLinear) for f in linears)


@dataclass(frozen=True, eq=False)
class LayerSizes:
    """A model's sizes as the one-call layers take them, built once with the model."""

    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # the dense MLP's
    eps: float  # every RMS norm's
    scale: float  # attention's, 1 / sqrt(head_dim)
    experts_intermediate: int = 0  # a mixture's experts' (0: no mixture)
    shared_intermediate: int = 0  # a mixture's shared expert's (Qwen3.5; 0: none)


@dataclass(frozen=True, eq=False)
class MixtureWeights:
    """A mixture of experts' weights as a Stack takes them (tfq/model/moe.py: MoE.stacked): the router and each
    expert's panels, by id, and a shared expert's (Qwen3.5); only where every one of them is tfq's C++ linear layer."""

    router: LinearFn
    gate_ups: list[torch.Tensor]
    downs: list[torch.Tensor]
    chosen: int
    normalized: bool
    shared: tuple[torch.Tensor, ...] = ()  # the shared expert's gate_up, down and gate [1, hidden] panels, or none


@dataclass(frozen=True, eq=False)
class AttentionWeights:
    """An attention layer's weights as its one call takes them, built once per layer (tfq/model/layers.py). The
    call reads the linear layers' panels: it runs only on fusable ones."""

    input_norm: torch.Tensor
    qkv: LinearFn
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: LinearFn
    post_norm: torch.Tensor
    gate_up: LinearFn | None  # None in a mixture's layer (its attention half alone runs in one call)
    down: LinearFn | None
    gated: bool  # a hybrid's attention: qkv's last rows are a gate of its output
    mixture: MixtureWeights | None = None  # a mixture's layer: its MLP, where a Stack runs it


@dataclass(frozen=True, eq=False)
class DeltaLayerWeights:
    """A hybrid's DeltaNet layer's weights as its one call takes them, built once per layer."""

    input_norm: torch.Tensor
    in_proj: LinearFn
    mixer: DeltaWeights
    out_proj: LinearFn
    post_norm: torch.Tensor
    gate_up: LinearFn | None  # None in a mixture's layer (Qwen3.5 MoE): delta_layer cannot take it, a Stack can
    down: LinearFn | None
    mixture: MixtureWeights | None = None


@dataclass(frozen=True, eq=False)
class AttentionInputs:
    """What one forward brings an attention layer: its rows' rotary tables, the layer's cache and the rows the
    new keys and values go to, the batch."""

    cos: torch.Tensor
    sin: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    rows: torch.Tensor
    cache_dtype: str
    batch: AttentionBatch


@dataclass(frozen=True, eq=False)
class DeltaState:
    """One DeltaNet layer's states this forward: the slots' convolution windows and recurrent states (updated in
    place), the segments' table, and where a segment marked to save copies its slot's states first."""

    conv: torch.Tensor
    rec: torch.Tensor
    segments: torch.Tensor
    save_conv: torch.Tensor
    save_rec: torch.Tensor


def _attention_half(x: torch.Tensor, w: AttentionWeights, n: LayerSizes, at: AttentionInputs) -> tuple:
    """The arguments layer.cpp's two entry points share, up to the post norm, in their order."""
    table, offsets, lengths = attention_tables(at.batch, x.shape[0])
    return (x, w.input_norm, w.qkv.panels, w.qkv.bias, w.q_norm, w.k_norm, at.cos, at.sin, at.k_cache, at.v_cache,
            at.rows, SATURATE.get(at.cache_dtype, 0.0), table, offsets, lengths, n.scale, KEY_TILE,
            SPLIT_ROWS if at.batch.partial else 0, w.o.panels, w.post_norm)


@dataclass(frozen=True, eq=False)
class StackCaches:
    """The caches a Stack's forward writes, one entry a layer in the stack's order (kernels/cpu/layer.cpp: Caches):
    an attention layer's key and value caches, a DeltaNet layer's states and their saved copies (those four lists
    empty in a model without DeltaNet layers; an entry without elements at a layer of the other kind). Built once
    per cache (`bind_caches`): handing torch every layer's tensors took 40-90 us a forward."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    conv: list[torch.Tensor]
    rec: list[torch.Tensor]
    save_conv: list[torch.Tensor]
    save_rec: list[torch.Tensor]
    handle: object  # torch.classes.tfq_cpu.Caches over the same tensors
    id: int  # the handle's, which a forward's call names it by


def bind_caches(k: list, v: list, conv: list, rec: list, save_conv: list, save_rec: list) -> StackCaches:
    """These lists as the C++ object a Stack's forward takes (their tensors, not copies)."""
    lists = (k, v, conv, rec, save_conv, save_rec)
    handle = torch.classes.tfq_cpu.Caches(*lists)
    return StackCaches(*lists, handle, handle.id())


class StackHandle(NamedTuple):
    """A Stack (torch.classes.tfq_cpu.Stack) and its id, which a forward's call names it by: torch hands an op's
    TorchScript object arguments over through C++ exceptions, about 20 us a call."""

    obj: object
    id: int
    head: bool = False  # it holds the model's final norm and head: a forward given logit rows returns their logits


@dataclass(frozen=True, eq=False)
class StackInputs:
    """What one forward brings a Stack: AttentionInputs with every layer's caches bound (StackCaches), and the
    segments' table a hybrid's DeltaNet layers read (no rows elsewhere)."""

    cos: torch.Tensor
    sin: torch.Tensor
    caches: StackCaches
    rows: torch.Tensor
    cache_dtype: str
    batch: AttentionBatch
    segments: torch.Tensor


@dataclass
class DrawFacts:
    """A table the one object's head fills, a row for each logits row it returns: (1 if every value is finite else
    0, the row's first largest, `stamp`) (kernels/cpu/row_facts.h). Its owner advances `stamp` before each forward,
    so a row holding another stamp was not written by this forward (its head ran elsewhere)."""

    table: torch.Tensor  # [rows, 3] int64
    stamp: int = 0

    @classmethod
    def blank(cls, rows: int, stamp: int) -> DrawFacts:
        """A table for `rows` logits rows that no forward has written (stamp 0 in every row)."""
        return cls(torch.zeros(rows, 3, dtype=torch.int64), stamp)


class BuiltStack(NamedTuple):
    """A model's layers as one C++ object (layer_stack), with the backend and the layers it was built from: it runs
    only while the model still holds both."""

    backend: object
    layers: tuple
    handle: StackHandle | None  # None where the layers are not what it runs


class StackOut(NamedTuple):
    """What a forward through a Stack gives: the rows after its last layer (`layer` then the stack's layer count);
    or, where some row's route in a mixture's layer was unsure (kernels/moe.py: route_fixed), the rows after that
    layer's attention half (`layer` then that layer) and their post norm `h`, for the caller's route to finish the
    layer and the stack to go on from the next."""

    x: torch.Tensor
    layer: int
    h: torch.Tensor  # no rows where every layer ran


def layer_stack(layers: list[AttentionWeights | DeltaLayerWeights], n: LayerSizes, d: DeltaSizes | None = None,
                head: tuple[torch.Tensor, LinearFn] | None = None):
    """A model's layers (attention layers, and a hybrid's DeltaNet layers of `d`'s sizes; a dense MLP or a mixture
    of experts each) as one C++ object built once (kernels/cpu/layer.cpp), which runs them all in one call
    (stack_forward); None where a layer is not what the one-call layer runs. `head`: the model's final norm and
    head, which the object holds too where the head is tfq's C++ linear layer without a bias."""
    attention = [w for w in layers if isinstance(w, AttentionWeights)]
    deltas = [w for w in layers if isinstance(w, DeltaLayerWeights)]
    if not layers or (deltas and d is None) or not all(_stackable(w) for w in layers):
        return None
    if len({w.gated for w in attention}) > 1:
        return None
    none = torch.empty(0)  # what a layer lacks: a DeltaNet layer's qkv, a dense layer's router, ...

    def each(get) -> list | None:  # an attention layer's optional tensor: in every one of them or in none
        values = [get(w) if isinstance(w, AttentionWeights) else none for w in layers]
        present = [get(w) is not None for w in attention]
        return [] if not any(present) else values if all(present) else None

    optional = [each(lambda w: w.qkv.bias), each(lambda w: w.q_norm), each(lambda w: w.k_norm)]
    if any(o is None for o in optional):
        return None
    mixtures = [w.mixture for w in layers if w.gate_up is None]
    if len({(len(m.gate_ups), m.chosen, m.normalized, len(m.shared)) for m in mixtures}) > 1:
        return None  # one count of experts, chosen and normalized alike in every mixture; shared experts in all or none
    m = mixtures[0] if mixtures else None
    routers = [none if w.gate_up is not None else w.mixture.router.panels for w in layers] if mixtures else []
    mixer = [t for w in deltas for t in (w.in_proj.panels, w.mixer.conv, w.mixer.A, w.mixer.dt_bias, w.mixer.norm,
                                         w.out_proj.panels)]
    qkv, o = ([getattr(w, name).panels if isinstance(w, AttentionWeights) else none for w in layers]
              for name in ("qkv", "o"))
    held = head is not None and fusable(head[1]) and head[1].bias is None
    stack = torch.classes.tfq_cpu.Stack(
        [w.input_norm for w in layers], qkv, *optional, o, [w.post_norm for w in layers],
        [w.gate_up.panels if w.gate_up is not None else none for w in layers],
        [w.down.panels if w.down is not None else none for w in layers], routers,
        [g for mix in mixtures for g in mix.gate_ups], [down for mix in mixtures for down in mix.downs],
        [t for mix in mixtures for t in mix.shared], mixer, [head[0], head[1].panels] if held else [],
        [n.heads, n.kv_heads, n.head_dim, n.intermediate, len(m.gate_ups) if m else 0, m.chosen if m else 0,
         n.experts_intermediate if m else 0, int(m.normalized) if m else 0,
         *((d.key_heads, d.key_dim, d.value_heads, d.value_dim) if deltas else (0, 0, 0, 0)),
         n.shared_intermediate if m and m.shared else 0, head[1].out_features if held else 0],
        n.eps, n.scale, attention[0].gated if attention else False)
    return StackHandle(stack, stack.id(), held)


def _stackable(w: AttentionWeights | DeltaLayerWeights) -> bool:
    """Whether a layer is made of what the one object runs: tfq's C++ linear layers (a DeltaNet layer's without
    biases), and a dense MLP or a mixture the object runs."""
    mlp = fusable(w.gate_up, w.down) if w.gate_up is not None else w.mixture is not None
    if isinstance(w, DeltaLayerWeights):
        return fusable(w.in_proj, w.out_proj) and w.in_proj.bias is None and w.out_proj.bias is None and mlp
    return fusable(w.qkv, w.o) and mlp


def stack_forward(x: torch.Tensor, stack: StackHandle, at: StackInputs, clock: torch.Tensor | None = None,
                  first: int = 0, logit_rows: torch.Tensor | None = None, facts: DrawFacts | None = None) -> StackOut:
    """x [N, hidden] through the layers of `stack` from `first` in one call: decoder_layer_fixed layer after layer
    (a DeltaNet layer: delta_layer_fixed's ops; a mixture's: attention_layer_fixed, the router, route_fixed and
    mixture_fixed), the same functions on the same tensors (kernels/cpu/layer.cpp). `clock` gains the router's
    seconds with the experts'. `logit_rows` (a stack with a head): the output is those rows' logits, the final norm
    and the head run after the last layer; `facts`, then, gains what a draw reads of each (DrawFacts)."""
    table, offsets, lengths = attention_tables(at.batch, x.shape[0])
    return StackOut(*cpu_build.op("stack_forward")(
        x, stack.id, first, at.cos, at.sin, at.caches.id, at.rows, SATURATE.get(at.cache_dtype, 0.0), table, offsets,
        lengths, KEY_TILE, SPLIT_ROWS if at.batch.partial else 0, at.segments, logit_rows, clock,
        facts and facts.table, facts.stamp if facts else 0))


NO_SEGMENTS = torch.empty(0, 5, dtype=torch.int64)  # a model without DeltaNet layers


def decoder_layer_fixed(x: torch.Tensor, w: AttentionWeights, n: LayerSizes, at: AttentionInputs,
                        clock: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, hidden] through one layer; its keys and values go to the cache at `at.rows`. Rotary turns each
    head's first cos.shape[-1] dimensions; `w.gated`: a hybrid's attention, qkv's last rows a gate of its
    output. `clock` (float64 [2]), when given, gains the seconds spent in linear layers and in attention."""
    return cpu_build.op("layer")(*_attention_half(x, w, n, at), w.gate_up.panels, w.down.panels, n.heads,
                                 n.kv_heads, n.head_dim, n.intermediate, n.eps, w.gated, clock)


def attention_layer_fixed(x: torch.Tensor, w: AttentionWeights, n: LayerSizes, at: AttentionInputs,
                          clock: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A mixture-of-experts layer's attention half in one call: (x + the attention's output projected, its post
    norm), the ops of decoder_layer_fixed before its MLP."""
    return cpu_build.op("attention_layer")(*_attention_half(x, w, n, at), n.heads, n.kv_heads, n.head_dim, n.eps,
                                           w.gated, clock)


def delta_layer_fixed(x: torch.Tensor, w: DeltaLayerWeights, n: LayerSizes, d: DeltaSizes, state: DeltaState,
                      clock: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, hidden] through a hybrid's DeltaNet layer, the states of the segments' slots updated in place (and
    saved first where a segment says so, as kernels.delta.deltanet_rows does). Returns (the output, in_proj's
    output: qkv | z | b | a, from which a draft verify keeps the recurrence's inputs). `clock` gains the seconds
    of linear layers ([0]) and of the recurrence ([1])."""
    m = w.mixer
    return cpu_build.op("delta_layer")(
        x, w.input_norm, w.in_proj.panels, m.conv, m.A, m.dt_bias, m.norm, state.conv, state.rec, state.segments,
        state.save_conv, state.save_rec, d.key_heads, d.key_dim, d.value_heads, d.value_dim, w.out_proj.panels,
        w.post_norm, w.gate_up.panels, w.down.panels, n.intermediate, n.eps, clock)
