"""A Qwen3.5 hybrid's Gated DeltaNet token mixer: the recurrence tfq runs, and the chunked one it does not.

`deltanet_rows` (kernels/cpu/delta.cpp) is the arithmetic of every row: the recurrent update, row after row,
whether the row comes in a long prompt chunk, a decode step or a draft's verify. One arithmetic per position
makes a row's bits independent of how its prompt was chunked and of what shares its forward.

`deltanet_chunks` is the other arithmetic, the one transformers and the fast GPU kernels use to prefill: rows in
blocks of 64 counted from the start of each forward's segment, each block solved as a triangular system, the
state carried from block to block. It gives other bits than the recurrence and depends on where the blocks fall,
so tfq runs it only as a control of `tfq together` (it must come out RED) and in the measurement of
docs/hybrid.md. It is plain torch, written after the algorithm's description, computing what transformers'
`torch_chunk_gated_delta_rule` computes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import cpu_build

CHUNK = 64  # rows a block of the chunked algorithm (transformers' and the fla kernels' default)


@dataclass(frozen=True)
class DeltaSizes:
    conv_kernel: int
    key_heads: int
    key_dim: int
    value_heads: int
    value_dim: int


@dataclass
class DeltaWeights:
    """One DeltaNet layer's own tensors (the projections are linear layers of the model)."""

    conv: torch.Tensor  # [K, channels]: tap j of every channel, transposed from HF's [channels, 1, K]
    A: torch.Tensor  # [value_heads]: -exp(A_log), computed once (as transformers does) or as a GGUF stores it
    dt_bias: torch.Tensor  # [value_heads]
    norm: torch.Tensor  # [value_dim]: the gated RMS norm's weight


NONE = torch.empty(0)  # no saved states


def deltanet_rows(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, w: DeltaWeights, conv_state: torch.Tensor,
                  rec_state: torch.Tensor, segments: torch.Tensor, n: DeltaSizes, save_conv: torch.Tensor = NONE,
                  save_rec: torch.Tensor = NONE) -> torch.Tensor:
    """The recurrence over every segment (kernels/cpu/delta.cpp); x [N, channels], a and b [N, value_heads];
    the states of the segments' slots are updated in place, and those of segments marked to save copied first
    into save_conv and save_rec (shaped as the states). Returns o [N, value_heads * value_dim]."""
    return cpu_build.op("deltanet")(x.contiguous(), a.contiguous(), b.contiguous(), w.conv, w.A, w.dt_bias,
                                    conv_state, rec_state, segments, save_conv, save_rec, n.key_heads, n.key_dim,
                                    n.value_heads, n.value_dim)


def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, z: torch.Tensor, eps: float) -> torch.Tensor:
    """((x * r) * weight) * silu(z) over the last dimension, r = 1 / sqrt(mean(x^2) + eps)."""
    return cpu_build.op("gated_rms_norm")(x.contiguous(), weight, z.contiguous(), eps)


def sigmoid_gate(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(g), element by element (gated attention's output)."""
    return cpu_build.op("sigmoid_gate")(x.contiguous(), g.contiguous())


# ---------------------------------------------------------------------------------------- the control

def deltanet_chunks(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, w: DeltaWeights, conv_state: torch.Tensor,
                    rec_state: torch.Tensor, segments: torch.Tensor, n: DeltaSizes) -> torch.Tensor:
    """The chunked algorithm over each segment of more than one row (a decode row runs the recurrence, as
    transformers decodes): same inputs and state updates as `deltanet_rows`, other bits."""
    out = torch.empty(x.shape[0], n.value_heads * n.value_dim)
    for row0, count, slot, fresh, _ in segments.tolist():
        one = segments.new_tensor([[row0, count, slot, fresh, 0]])
        if count == 1:
            out[row0:row0 + 1] = deltanet_rows(x, a, b, w, conv_state, rec_state, one, n)[row0:row0 + 1]
            continue
        rows = slice(row0, row0 + count)
        if fresh:
            conv_state[slot].zero_()
            rec_state[slot].zero_()
        seq = torch.cat([conv_state[slot], x[rows]])  # [K - 1 + count, channels]
        conv_state[slot] = seq[seq.shape[0] - (n.conv_kernel - 1):]
        y = F.silu(F.conv1d(seq.T[None], w.conv.T[:, None, :], groups=seq.shape[1])[0].T)  # [count, channels]
        qk = n.key_heads * n.key_dim
        q = y[:, :qk].reshape(count, n.key_heads, n.key_dim)
        k = y[:, qk:2 * qk].reshape(count, n.key_heads, n.key_dim)
        v = y[:, 2 * qk:].reshape(count, n.value_heads, n.value_dim)
        beta = b[rows].sigmoid()
        g = w.A * F.softplus(a[rows] + w.dt_bias)
        o, rec_state[slot] = _chunked_rule(q, k, v, g, beta, rec_state[slot])
        out[rows] = o.reshape(count, -1)
    return out


def _chunked_rule(q, k, v, g, beta, state):
    """The gated delta rule in blocks of CHUNK rows for one stream: q, k [T, Hk, dk], v [T, Hv, dv], g and beta
    [T, Hv], state [Hv, dk, dv]; returns (o [T, Hv, dv], the state after the last row)."""
    T, repeat = q.shape[0], v.shape[1] // q.shape[1]
    q, k = (t.repeat_interleave(repeat, 1) for t in (q, k))
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * q.shape[-1] ** -0.5
    pad = (-T) % CHUNK
    q, k, v = (F.pad(t.transpose(0, 1), (0, 0, 0, pad)) for t in (q, k, v))  # [H, T + pad, d]
    g, beta = (F.pad(t.T, (0, pad)) for t in (g, beta))  # [H, T + pad]
    H, blocks = v.shape[0], (T + pad) // CHUNK
    q, k, v = (t.reshape(H, blocks, CHUNK, -1) for t in (q, k, v))
    g, beta = g.reshape(H, blocks, CHUNK), beta.reshape(H, blocks, CHUNK)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    decay = g.cumsum(-1)  # log of the decay from a block's start to each row
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool).triu(1)
    pair = (decay[..., :, None] - decay[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pair
    inner = (q @ k.transpose(-1, -2)) * pair
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    keys_read = torch.linalg.solve_triangular(system, k_beta * decay.exp()[..., None], upper=False,
                                              unitriangular=True)
    q = q * decay.exp()[..., None]
    k = k * (decay[..., -1:] - decay).exp()[..., None]
    block_decay = decay[..., -1].exp()[..., None, None]
    out = torch.empty_like(values)
    for i in range(blocks):
        fresh = values[:, i] - keys_read[:, i] @ state
        out[:, i] = q[:, i] @ state + inner[:, i] @ fresh
        state = state * block_decay[:, i] + k[:, i].transpose(-1, -2) @ fresh
    return out.reshape(H, -1, out.shape[-1])[:, :T].transpose(0, 1), state
