"""A model's layers as one C++ object (kernels/layer.py: layer_stack, stack_forward; kernels/cpu/layer.cpp): a
forward through every layer in one call, each layer a dense MLP's or a mixture of experts', by the same functions
on the same tensors as each layer in one call, so the same bits by construction; the start-up guard checks it on the
running build (tfq/engine/layer_guard.py: STACKED, each proved layer alone; CHAIN, those layers in a row).

Why: at one lane a decode step spent tens of microseconds a dense layer, and hundreds a mixture's, in Python
between its kernels, on every layer of every step.
"""
from __future__ import annotations

import operator

import torch

from tfq.kernels.attention import AttentionBatch
from tfq.kernels.layer import NO_SEGMENTS, BuiltStack, DrawFacts, StackInputs, bind_caches
from tfq.model.layers import Layer
from tfq.model.moe import untapped
from tfq.model.segments import Segments


class OneObject:
    """The part of Qwen (tfq/model/qwen.py) that builds and runs its layers as one object."""

    def one_object(self) -> BuiltStack | None:
        """The model's layers as one C++ object (attention and a hybrid's DeltaNet layers, a dense MLP or a mixture
        of experts each): a forward's layers in one call (kernels/layer.py), used while the model's layers and
        backend are the ones it was built from (the guard's tests swap in others)."""
        b = self.backend
        if b.stack is None:
            return None
        return BuiltStack(b, tuple(self.layers), self.stack_of(self.layers))

    def stack_of(self, layers: list):
        """`layers` as one C++ object (a handle), or None where one of them is not what the object runs. The object
        holds the model's final norm and head too (where the head is tfq's C++ linear layer), which a forward runs
        after its last layer: a decode step's head is then no call of its own."""
        return self.backend.stack([layer.fused for layer in layers], self.layer_sizes,
                                  self.sizes if self.config.hybrid else None, (self.norm, self.lm_head))

    def runs_as_stack(self, segments: Segments | None = None, cache=None) -> bool:
        """Whether this forward's layers run as the model's one C++ object (`stack`): built for these layers and
        this backend, a layer of each kind one the one-call layer runs; not with the chunked DeltaNet control or
        experts by load, nor where a hybrid's cache keeps a verify's inputs (drafting: each layer in one call
        gives them)."""
        if self.stack is None or self.stack.handle is None or self.stack.backend is not self.backend:
            return False
        built = self.stack.layers
        kinds = {type(layer): layer for layer in built}.values()  # the model's, where they are the built ones
        return (len(built) == len(self.layers) and all(map(operator.is_, built, self.layers))
                and not (segments is not None and (segments.chunked or segments.experts_by_load))
                and not (cache is not None and cache.state is not None and cache.state.verify_rows)
                and all(self.made_for_one_call(layer) for layer in kinds))

    def stack_inputs(self, layers: list, indices: list[int], cache, rope: tuple[torch.Tensor, torch.Tensor],
                     cache_rows: torch.Tensor, batch: AttentionBatch, segments: Segments | None) -> StackInputs:
        """What a forward brings `layers` as one object: each attention layer its caches at its index of `indices`,
        each DeltaNet layer its states there (bound once per cache: KVCache.bound)."""
        attention = tuple(isinstance(layer, Layer) for layer in layers)

        def bind():
            none = torch.empty(0)
            k, v = ([c[i] if a else none for a, i in zip(attention, indices)] for c in (cache.k, cache.v))
            if all(attention):
                return bind_caches(k, v, [], [], [], [])
            s = cache.state
            return bind_caches(k, v, *([t[i] if not a else none for a, i in zip(attention, indices)]
                                       for t in (s.conv, s.rec, s.saved_conv, s.saved_rec)))

        caches = cache.bound(("one object", attention, tuple(indices)), bind)
        return StackInputs(*rope, caches, cache_rows, cache.dtype_name, batch,
                           NO_SEGMENTS if all(attention) else segments.table)

    def run_stack(self, handle, layers: list[Layer], x: torch.Tensor, inputs: StackInputs,
                  segments: Segments | None = None, logit_rows: torch.Tensor | None = None,
                  facts: DrawFacts | None = None) -> torch.Tensor:
        """x through `layers` as their one object `handle` runs them, in one call; where some row's route in a
        mixture's layer was unsure (moe_route: an exp glibc cannot round for sure), that layer's mixture as its
        one call runs it (route asks mpmath for those rows; a shared expert too) on the token mixer's residual and
        post norm the object gave back, then the object goes on from the next layer: the ops of each layer in one
        call, in their order. With `logit_rows` (a handle with a head) it returns those rows' logits, and `facts`
        gains what a draw reads of each."""
        first = 0
        while True:
            out = self.backend.stack_forward(x, handle, inputs, self.layer_clock, first, logit_rows, facts)
            if out.layer == len(layers):
                return out.x
            x, first = out.x + self.mixture(layers[out.layer].moe, out.h, untapped, segments), out.layer + 1
