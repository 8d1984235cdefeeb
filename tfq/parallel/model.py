"""A Qwen model's shard on one rank (tfq/parallel/shard.py says what it holds): the same forward as one
process runs, op for op, with a gather wherever a layer needs what other ranks computed.

Per attention layer, in order: the heads' outputs (before o), o's output, the MLP's SiLU(gate) * up (before
down), down's output; after the last layer, the logits. Each gather copies columns in rank order, so every
rank holds the same whole tensor, with the bits one process computes: every element of it was computed whole
on one rank, by the same kernels with the same fixed-order sums (the start-up guard proves that a column's bits
do not depend on the columns beside it). The control (`reduce`) splits o and down by their inputs and adds the
ranks' partial sums (an all-reduce), as Megatron-style tensor parallelism does.

On rank 0 a forward first sends its inputs to the other ranks (tfq/parallel/ranks.py), which run the same
forward on their shards; the engine above never knows the model is split. Ctrl-C waits for the end of the
forward (sigint_deferred): its collectives are issued one by one from here, and the other ranks are in them. Any
other fault on rank 0 inside it tears the group down (Group.in_step): the fault reaches the engine, and every
later forward on this model is refused in one line, where it would otherwise wait on a gather for ever.
"""
from __future__ import annotations

import contextlib
import itertools
import weakref

import torch

from tfq.kernels.quant import Quantized
from tfq.model.kernel_guard import check_columns
from tfq.model.qwen import Qwen
from tfq.model.taker import text_name
from tfq.parallel.ranks import sigint_deferred
from tfq.parallel.shard import Shard, sizes

_serials = itertools.count(1)


class ShardedQwen(Qwen):
    def __init__(self, config, weights: dict, backend, shard: Shard, group):
        self.shard, self.group = shard, group
        self.what = None  # the ModelSpec the ranks loaded it by (tfq/parallel/ranks.py)
        self.local = False  # True while the start-up guard proves this rank's ops alone (no collectives)
        self.dropped: list[int] = []  # caches rank 0 no longer holds, for the other ranks to drop
        c = config
        d = c.head_dim
        n = c.deltanet
        values = [k * n.value_dim * (n.value_heads // n.key_heads) for k in sizes(n.key_heads, shard.world)] \
            if n else []  # a hybrid's DeltaNet heads' outputs
        self.widths = {"heads": [w * d * c.group for w in sizes(c.num_kv_heads, shard.world)], "values": values,
                       "o": sizes(c.hidden_size, shard.world), "mlp": sizes(c.intermediate_size, shard.world),
                       "down": sizes(c.hidden_size, shard.world), "head": sizes(c.vocab_size, shard.world)}
        super().__init__(config, weights, backend, shard=shard)
        check_columns(_first_layer(weights, config), self.make_linear, backend)

    def joined(self, site: str, t: torch.Tensor) -> torch.Tensor:
        reduce = self.shard.reduce and site in ("heads", "values", "mlp", "o", "down")
        if reduce and site in ("heads", "values", "mlp"):
            return t  # the control's o and down take the rank's own inputs
        if self.local:  # the guard: this rank's columns in place, the others' zeros (no collective)
            if reduce:
                return t
            widths, r = self.widths[site], self.shard.rank
            whole = t.new_zeros(t.shape[0], sum(widths))
            start = sum(widths[:r])
            whole[:, start:start + widths[r]] = t
            return whole
        return self.group.all_reduce(t) if reduce else self.group.gather(t, self.widths[site])

    @contextlib.contextmanager
    def on_its_own(self, proof: tuple = ()):
        asks = bool(proof) and self.shard.rank == 0
        if asks:  # every rank proves its own shard at the same time (tfq/parallel/rank_main.py)
            self.group.send(("prove", self.what, None, proof))
        refused: list[str] = []
        self.local = True
        try:
            yield refused
        finally:  # even on Ctrl-C during rank 0's own proof: the other ranks wait for its answer
            self.local = False
            if asks:
                with sigint_deferred():
                    refused += [p for p in self.group.agree("") if p]

    def made_for_one_call(self, layer) -> bool:
        return False  # the gathers sit inside the layer: neither its one call nor the model's one object

    def roll_back(self, cache, slot: int, rows: int) -> None:
        with self._in_step():
            if self.shard.rank == 0:
                self.group.send(("roll_back", self.what, self._serial(cache), (slot, rows)))
            super().roll_back(cache, slot, rows)

    def copy_state(self, cache, source: int, target: int) -> None:
        with self._in_step():
            if self.shard.rank == 0:
                self.group.send(("copy_state", self.what, self._serial(cache), (source, target)))
            super().copy_state(cache, source, target)

    def _in_step(self):
        """Rank 0: Ctrl-C held and a fault tearing the group down (the other ranks run these from a message)."""
        return self.group.in_step() if self.shard.rank == 0 else sigint_deferred()

    def _serial(self, cache) -> int:
        """The number the other ranks know rank 0's `cache` by (given on first use; dropped when it is)."""
        if not hasattr(cache, "serial"):
            cache.serial = next(_serials)
            weakref.finalize(cache, self.dropped.append, cache.serial)
        return cache.serial

    @torch.inference_mode()
    def forward(self, ids, positions, cache, cache_rows, batch, logit_rows, segments=None, facts=None):
        if self.local or self.shard.rank != 0:
            return super().forward(ids, positions, cache, cache_rows, batch, logit_rows, segments, facts)
        with self.group.in_step():  # the other ranks run this forward's collectives with rank 0 to the end
            serial = self._serial(cache)
            dropped = list(self.dropped)
            self.dropped.clear()
            self.group.send(("forward", self.what, serial, cache.spec, dropped,
                             (ids, positions, cache_rows, batch, logit_rows, segments)))
            return super().forward(ids, positions, cache, cache_rows, batch, logit_rows, segments, facts)


def _first_layer(weights: dict, config) -> dict:
    """The first layer of each kind's matrices, the MLP's and the head, whole, as the checkpoint holds them (for
    check_columns)."""
    named = {text_name(k): k for k in weights}  # names only: a lazy checkpoint reads just what is asked for
    names = {"gate_proj": "model.layers.0.mlp.gate_proj", "down": "model.layers.0.mlp.down_proj",
             "head": "model.embed_tokens" if config.tie_embeddings else "lm_head"}
    if config.attention_layers:
        a = f"model.layers.{config.attention_layers[0]}.self_attn."
        names.update(q_proj=a + "q_proj", o=a + "o_proj")
    if config.deltanet_layers:
        a = f"model.layers.{config.deltanet_layers[0]}.linear_attn."
        names.update(in_proj_qkv=a + "in_proj_qkv", out_proj=a + "out_proj")
    out = {}
    for what, name in names.items():
        w, b = weights[named[name + ".weight"]], weights[named[name + ".bias"]] if name + ".bias" in named else None
        out[what] = (w if isinstance(w, Quantized) else w.float(), None if b is None else b.float())
    return out
