"""What one rank of a tensor-parallel model holds, chosen so that no sum is split between ranks.

Every linear layer is split by its outputs: a rank holds whole rows of the weight matrix (whole output
columns of the layer), so each output element is the one fixed-order sum tfq's kernel computes on one rank,
whatever the number of ranks. What a layer needs whole (the attention's output before o, the MLP's product
before down, o's and down's outputs for the residual, the logits) is gathered from every rank in rank order.

    qkv      by key/value head groups: a rank's query heads are those that read its key/value heads
    DeltaNet by key head groups (a hybrid's): a rank's value heads are those that read its key heads; its
             slice of in_proj, the convolution, the recurrence, its state and the gated norm are its heads'
    o        by hidden columns (its input, every head's output, gathered first)
    gate_up  by intermediate columns; SiLU(gate) * up is elementwise, so it runs on the rank's slice
    down     by hidden columns (its input, the whole product, gathered first)
    head     by vocabulary entries

Uneven splits: n units over w ranks give the first n % w ranks one unit more (896 hidden columns over 3
ranks: 299, 299, 298). Key/value heads are the unit of the attention, so with more ranks than key/value
heads some ranks hold no attention head at all (2 heads over 3 ranks: 1, 1, 0); those ranks still take
their share of o, the MLP and the head. Nothing about the bits depends on the split: only the work does.

`reduce` is the control of `tfq together`: o and down split by their inputs instead (Megatron's
"row-parallel" layers), each rank summing part of every output and an all-reduce adding the parts, so an
output is a sum split between ranks: other bits than one process computes.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from tfq.model.config import ModelConfig


def part(n: int, rank: int, world: int) -> slice:
    """Rank `rank`'s share of n units: contiguous, in rank order, the first n % world ranks one more."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (rank < extra))


def sizes(n: int, world: int) -> list[int]:
    """Every rank's share of n units, in rank order."""
    return [part(n, r, world).stop - part(n, r, world).start for r in range(world)]


@dataclass(frozen=True)
class Shard:
    config: ModelConfig  # the whole model's
    rank: int
    world: int
    reduce: bool = False  # the control: o and down split by their inputs, summed across ranks

    @property
    def kv_heads(self) -> slice:
        return part(self.config.num_kv_heads, self.rank, self.world)

    @property
    def q_heads(self) -> slice:
        g = self.config.num_heads // self.config.num_kv_heads
        return slice(self.kv_heads.start * g, self.kv_heads.stop * g)

    @property
    def hidden(self) -> slice:
        return part(self.config.hidden_size, self.rank, self.world)

    @property
    def intermediate(self) -> slice:
        return part(self.config.intermediate_size, self.rank, self.world)

    @property
    def vocab(self) -> slice:
        return part(self.config.vocab_size, self.rank, self.world)

    @property
    def key_heads(self) -> slice:
        """A hybrid's DeltaNet key heads (its unit: each reads its own value heads, which follow it)."""
        return part(self.config.deltanet.key_heads, self.rank, self.world)

    @property
    def value_heads(self) -> slice:
        n = self.config.deltanet
        r = n.value_heads // n.key_heads
        return slice(self.key_heads.start * r, self.key_heads.stop * r)

    def channels(self) -> torch.Tensor:
        """The DeltaNet convolution's channels this rank holds: its key heads' queries and keys, its value
        heads' values (three runs of the q | k | v channels)."""
        n, k, v = self.config.deltanet, self.key_heads, self.value_heads
        keys = n.key_heads * n.key_dim
        return torch.cat([torch.arange(k.start * n.key_dim, k.stop * n.key_dim),
                          keys + torch.arange(k.start * n.key_dim, k.stop * n.key_dim),
                          2 * keys + torch.arange(v.start * n.value_dim, v.stop * n.value_dim)])

    def local_config(self) -> ModelConfig:
        """The sizes this rank computes with: its heads and its slice of the MLP (hidden size and vocabulary
        stay whole: every rank holds every row's whole hidden state and, after the head's gather, its logits)."""
        c = self.config
        deltanet = c.deltanet and replace(c.deltanet, key_heads=_len(self.key_heads),
                                          value_heads=_len(self.value_heads))
        return replace(c, num_heads=_len(self.q_heads), num_kv_heads=_len(self.kv_heads),
                       intermediate_size=_len(self.intermediate), deltanet=deltanet)

    def _deltanet(self, name: str) -> tuple | None:
        n, v = self.config.deltanet, self.value_heads
        if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
            return self.channels(), None
        if name.endswith("in_proj_z.weight"):
            return slice(v.start * n.value_dim, v.stop * n.value_dim), None
        if name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", ".A", "dt_bias")):
            return v, None
        if name.endswith("out_proj.weight"):
            values = slice(v.start * n.value_dim, v.stop * n.value_dim)
            return (None, values) if self.reduce else (self.hidden, None)
        return None  # the gated norm's weight: one per value dim, shared by every head

    def params(self) -> int:
        """Parameters this rank holds: its shares, plus the whole embedding and norms every rank keeps."""
        c, d = self.config, self.config.head_dim
        h, q, kv = c.hidden_size, _len(self.q_heads) * d, _len(self.kv_heads) * d
        i = _len(self.intermediate)
        hidden = _len(self.hidden)
        attention = h * (q * (1 + c.hybrid) + 2 * kv) + (q + 2 * kv) * c.qkv_bias + 2 * d * c.qk_norm
        attention += h * q if self.reduce else hidden * c.num_heads * d
        mlp = 2 * i * h + (h * i if self.reduce else hidden * c.intermediate_size)
        head = 0 if c.tie_embeddings else _len(self.vocab) * h
        total = c.vocab_size * h + c.num_layers * (mlp + 2 * h) + len(c.attention_layers) * attention + h + head
        if c.hybrid:
            n, v = c.deltanet, _len(self.value_heads)
            channels, values = len(self.channels()), v * n.value_dim
            mixer = h * (channels + values + 2 * v) + channels * n.conv_kernel + 2 * v + n.value_dim
            mixer += h * values if self.reduce else hidden * n.value_heads * n.value_dim
            total += len(c.deltanet_layers) * mixer
        return total

    def keep(self, name: str) -> tuple[slice | None, slice | None] | None:
        """(rows, columns) of the checkpoint tensor `name` this rank holds; None: all of it (norms, the
        embedding)."""
        c, d = self.config, self.config.head_dim
        heads = {"q_proj": self.q_heads, "k_proj": self.kv_heads, "v_proj": self.kv_heads}
        for proj, h in heads.items():
            if f".self_attn.{proj}." in name:
                per = 2 * d if proj == "q_proj" and c.hybrid else d  # a hybrid's query head: queries, then gate
                return slice(h.start * per, h.stop * per), None
        if ".linear_attn." in name:
            return self._deltanet(name)
        if ".mlp.gate_proj." in name or ".mlp.up_proj." in name:
            return self.intermediate, None
        if name.endswith(".self_attn.o_proj.weight"):
            q = self.q_heads
            return (None, slice(q.start * d, q.stop * d)) if self.reduce else (self.hidden, None)
        if name.endswith(".mlp.down_proj.weight"):
            return (None, self.intermediate) if self.reduce else (self.hidden, None)
        if name == "lm_head.weight":
            return self.vocab, None
        return None


def _len(s: slice) -> int:
    return s.stop - s.start


def gathered_floats(config: ModelConfig) -> tuple[int, int]:
    """Floats a forward gathers (every rank's columns of the whole tensor): per row, over every layer (the
    heads' outputs, o's, the MLP's product, down's), and per logits row (the vocabulary)."""
    c = config
    values = c.deltanet.value_heads * c.deltanet.value_dim if c.hybrid else 0
    layers = [c.num_heads * c.head_dim if k == "full_attention" else values for k in c.kinds]
    return sum(heads + 2 * c.hidden_size + c.intermediate_size for heads in layers), c.vocab_size
